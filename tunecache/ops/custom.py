"""The ops as PyTorch sees them: `torch.library` custom ops with fake (meta) kernels and autograd.

`torch.ops.tunecache.matmul` and `torch.ops.tunecache.conv2d_nhwc` call the tuned ops of
`tunecache.ops`; registered as custom ops, `torch.compile(fullgraph=True)` captures them
without a graph break (the fake kernels give the output's shape from the inputs' alone),
autograd differentiates them, and `torch.library.opcheck` checks all of it.

Backward passes are tuned ops too: a matmul's gradients are matmuls of transposed views (the
GEMM kernels read column-major operands in place), a convolution's weight gradient is the
wgrad kernel, and the gradient of its input is the dgrad kernel, which splits it by output phase:
at stride sh x sw, the grad_x positions of one phase (rows a::sh, columns b::sw) are reached
only by the filter taps r0::sh, s0::sw, so no multiply-add is spent on the zeros a dilated
gradient would hold.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tunecache.ops import tuned as ops
from tunecache_kernels import problems

# the ops' kernels for CPU and CUDA tensors, registered with the dispatcher as they are:
# custom_op's own kernel wraps each call in a pytree walk and an alias check (5 us of a compiled
# model's call of the op on a 2-core host, a third of the op's dispatch)
_KERNELS = torch.library.Library("tunecache", "IMPL")


def _custom_op(name: str):
    """`fn` as the custom op tunecache::`name` (its schema from fn's annotations), with fn
    itself as its CPU and CUDA kernels."""

    def make(fn):
        op = torch.library.custom_op(f"tunecache::{name}", fn, mutates_args=())
        for key in ("CPU", "CUDA"):
            _KERNELS.impl(name, fn, key)
        return op

    return make


# ---- matmul ------------------------------------------------------------------------------


def _operand(t: Tensor) -> Tensor:
    """`t` itself when the GEMM kernels read it in place (`problems.matrix_layout`), else a copy."""
    if t.is_contiguous() or _column_major(t) or t.t().is_contiguous():  # what matrix_layout takes
        return t
    try:
        problems.matrix_layout(t, "operand")
    except ValueError:
        return t.contiguous()
    return t


def _column_major(t: Tensor) -> bool:
    """Whether 2-D `t` is a row-major tensor's transpose (a linear layer's weight.t()), read
    off its strides: `t.t().is_contiguous()` makes a view to ask, a layer call's host time."""
    if t.dim() != 2:
        return False  # matrix_layout's checks say what is wrong
    (n0, n1), (s0, s1) = t.shape, t.stride()
    return (s0 == 1 or n0 == 1) and (s1 == n0 or n1 == 1)


def _tuned_matmul(a: Tensor, b: Tensor) -> Tensor:
    return ops.matmul(_operand(a), _operand(b))


@_custom_op("matmul")
def matmul(a: Tensor, b: Tensor) -> Tensor:
    """a @ b of 2-D tensors, tuned (`tunecache.ops.matmul`)."""
    return _tuned_matmul(a, b)


@matmul.register_fake
def _(a: Tensor, b: Tensor) -> Tensor:
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "matmul takes 2-D tensors")
    torch._check(a.shape[1] == b.shape[0], lambda: f"a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    return a.new_empty((a.shape[0], b.shape[1]))


def _matmul_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _matmul_grads(mm, a: Tensor, b: Tensor, grad: Tensor, needs) -> tuple:
    """(grad_a, grad_b) of a @ b by `mm`: matmuls of transposed views, read in place."""
    return (mm(grad, b.t()) if needs[0] else None, mm(a.t(), grad) if needs[1] else None)


def _matmul_backward(ctx, grad: Tensor):
    return _matmul_grads(matmul, *ctx.saved_tensors, grad, ctx.needs_input_grad)


matmul.register_autograd(_matmul_backward, setup_context=_matmul_setup)


# ---- conv2d (NHWC) -----------------------------------------------------------------------


def _out_size(size, k: int, stride: int, pad: int):
    return (size + 2 * pad - k) // stride + 1


@_custom_op("conv2d_nhwc")
def conv2d_nhwc(x: Tensor, w: Tensor, stride: list[int], padding: list[int]) -> Tensor:
    """y[N, P, Q, Co] = conv2d(x[N, H, W, Ci], w[Co, R, S, Ci]), tuned (`tunecache.ops.conv2d_fprop`)."""
    return ops.conv2d_fprop(x.contiguous(), w.contiguous(), tuple(stride), tuple(padding))


@conv2d_nhwc.register_fake
def _(x: Tensor, w: Tensor, stride: list[int], padding: list[int]) -> Tensor:
    torch._check(x.dim() == 4 and w.dim() == 4, lambda: "conv2d_nhwc takes 4-D NHWC tensors")
    torch._check(x.shape[3] == w.shape[3], lambda: f"x has {x.shape[3]} channels, w {w.shape[3]}")
    n, h, wd, _ = x.shape
    co, r, s, _ = w.shape
    p = _out_size(h, r, stride[0], padding[0])
    q = _out_size(wd, s, stride[1], padding[1])
    return x.new_empty((n, p, q, co))


@_custom_op("conv2d_wgrad_nhwc")
def conv2d_wgrad_nhwc(x: Tensor, grad_out: Tensor, R: int, S: int, stride: list[int], padding: list[int]) -> Tensor:
    """grad_w[Co, R, S, Ci] of conv2d_nhwc, tuned (`tunecache.ops.conv2d_wgrad`)."""
    return ops.conv2d_wgrad(x.contiguous(), grad_out.contiguous(), R, S, tuple(stride), tuple(padding))


@conv2d_wgrad_nhwc.register_fake
def _(x: Tensor, grad_out: Tensor, R: int, S: int, stride: list[int], padding: list[int]) -> Tensor:
    return x.new_empty((grad_out.shape[3], R, S, x.shape[3]))


@_custom_op("conv2d_dgrad_nhwc")
def conv2d_dgrad_nhwc(grad_out: Tensor, w: Tensor, H: int, W: int, stride: list[int], padding: list[int]) -> Tensor:
    """grad_x[N, H, W, Ci] of conv2d_nhwc, tuned (`tunecache.ops.conv2d_dgrad`)."""
    return ops.conv2d_dgrad(grad_out, w, H, W, tuple(stride), tuple(padding))


@conv2d_dgrad_nhwc.register_fake
def _(grad_out: Tensor, w: Tensor, H: int, W: int, stride: list[int], padding: list[int]) -> Tensor:
    return grad_out.new_empty((grad_out.shape[0], H, W, w.shape[3]))


def _conv_setup(ctx, inputs, output) -> None:
    x, w, stride, padding = inputs
    ctx.save_for_backward(x, w)
    ctx.stride, ctx.padding = list(stride), list(padding)


def _conv_grads(dgrad, wgrad, x: Tensor, w: Tensor, grad: Tensor, stride, padding, needs) -> tuple:
    """(grad_x, grad_w, None, None) of conv2d_nhwc by `dgrad` and `wgrad`."""
    grad = grad.contiguous()
    grad_x = dgrad(grad, w, x.shape[1], x.shape[2], stride, padding) if needs[0] else None
    grad_w = wgrad(x, grad, w.shape[1], w.shape[2], stride, padding) if needs[1] else None
    return grad_x, grad_w, None, None


def _conv_backward(ctx, grad: Tensor):
    x, w = ctx.saved_tensors
    dgrad, wgrad = conv2d_dgrad_nhwc, conv2d_wgrad_nhwc
    return _conv_grads(dgrad, wgrad, x, w, grad, ctx.stride, ctx.padding, ctx.needs_input_grad)


conv2d_nhwc.register_autograd(_conv_backward, setup_context=_conv_setup)


# ---- the eager path -------------------------------------------------------------------------
# A torch.library custom op costs ~80 us of host time per call on an H100 host (its dispatch,
# the autograd wrapper's pytree work, the alias check), three of them per convolution trained:
# ResNet-50's step waited 27 ms on the host (0.65x torch). Outside torch.compile the same ops
# and backward run through plain autograd.Functions that take the layers' own tensors (NCHW,
# the weight as the module holds it) and do the permutes, reshapes and bias inside: autograd
# records one node per layer, not five (each view and the bias add were nodes of their own).


def _conv2d_forward(x: Tensor, w: Tensor, bias: Tensor | None, stride: tuple, padding: tuple):
    """(y NCHW, x NHWC, w NHWC): NHWC views of channels_last tensors, copies of others."""
    xn, wn = x.permute(0, 2, 3, 1).contiguous(), w.permute(0, 2, 3, 1).contiguous()
    return ops.conv2d_layer(x, w, xn, wn, bias, stride, padding), xn, wn


class _Conv2d(torch.autograd.Function):
    """conv2d of NCHW x and weight (read as NHWC: channels_last tensors in place), + bias."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, bias: Tensor | None, stride: tuple, padding: tuple) -> Tensor:
        y, xn, wn = _conv2d_forward(x, w, bias, stride, padding)
        ctx.save_for_backward(xn, wn)
        ctx.stride, ctx.padding, ctx.has_bias = stride, padding, bias is not None
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        xn, wn = ctx.saved_tensors
        gn = grad.permute(0, 2, 3, 1)
        needs = ctx.needs_input_grad
        dgrad, wgrad = ops.conv2d_dgrad, ops.conv2d_wgrad
        gx, gw, _, _ = _conv_grads(dgrad, wgrad, xn, wn, gn, ctx.stride, ctx.padding, needs[:2])
        gb = grad.sum((0, 2, 3)) if ctx.has_bias and needs[2] else None
        gx = None if gx is None else gx.permute(0, 3, 1, 2)
        gw = None if gw is None else gw.permute(0, 3, 1, 2)
        return gx, gw, gb, None, None


def _linear_forward(x: Tensor, w: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """(y, x as 2-D)."""
    a = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    y = _tuned_matmul(a, w.t()) if bias is None else ops.matmul_add(_operand(a), _operand(w.t()), bias)
    return (y if a is x else y.reshape(*x.shape[:-1], w.shape[0])), a


class _Linear(torch.autograd.Function):
    """x @ weight.T + bias for x of any leading dims (the weight read transposed in place)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
        y, a = _linear_forward(x, w, bias)
        ctx.save_for_backward(a, w)
        ctx.x_shape, ctx.has_bias = x.shape, bias is not None
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        a, w = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        needs = ctx.needs_input_grad
        ga = _tuned_matmul(g, w).reshape(ctx.x_shape) if needs[0] else None
        gw = _tuned_matmul(g.t(), a) if needs[1] else None  # [out, in], as the weight lies
        gb = g.sum(0) if ctx.has_bias and needs[2] else None
        return ga, gw, gb


def _applier(fn: type[torch.autograd.Function]):
    """`fn.apply` without its Python wrapper (which binds default arguments and unwraps functorch's
    dead wrappers: a third of a small layer's host time) where functorch's transforms are off, as
    the wrapper itself then calls it; the wrapper where they are on (vmap, grad)."""
    direct = super(torch.autograd.Function, fn).apply
    wrapped = fn.apply

    def apply(*args):
        return wrapped(*args) if torch._C._are_functorch_transforms_active() else direct(*args)

    return apply


_conv2d_apply, _linear_apply = _applier(_Conv2d), _applier(_Linear)


def _tracked(a: Tensor, b: Tensor, bias: Tensor | None) -> bool:
    """Whether autograd must record this call (spelled out: a layer's hot path)."""
    if not torch.is_grad_enabled():
        return False
    return a.requires_grad or b.requires_grad or (bias is not None and bias.requires_grad)


_AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)


def _autocast(x: Tensor, w: Tensor, bias: Tensor | None) -> tuple:
    """The tensors as autocast hands them to torch's conv2d and linear where it is on (mixed
    precision training: fp32 parameters, the layers in its lower precision), else as they are.
    A custom Function is outside autocast's op lists: without this, an AMP model's layers ran in
    fp32 and gave fp32 where torch's give bf16 or fp16. The casts are autograd's own: the fp32
    parameters get fp32 gradients."""
    dev = "cuda" if x.is_cuda else "cpu" if x.is_cpu else None  # the kernels' devices
    if dev is None or not torch.is_autocast_enabled(dev):
        return x, w, bias
    dt = torch.get_autocast_dtype(dev)

    def cast(t):
        return t if t is None or t.dtype == dt or t.dtype not in _AUTOCAST_CASTS else t.to(dt)

    return cast(x), cast(w), cast(bias)


def conv2d(x: Tensor, w: Tensor, bias: Tensor | None, stride: tuple[int, int], padding: tuple[int, int]) -> Tensor:
    """conv2d of NCHW tensors with autograd: the custom op under torch.compile, the eager path
    otherwise (without autograd's bookkeeping where no gradient is wanted); in autocast's
    precision where it is on."""
    x, w, bias = _autocast(x, w, bias)
    if torch.compiler.is_compiling():
        y = conv2d_nhwc(x.permute(0, 2, 3, 1), w.permute(0, 2, 3, 1), list(stride), list(padding))
        y = y.permute(0, 3, 1, 2)
        return y if bias is None else y + bias.view(1, -1, 1, 1)
    if _tracked(x, w, bias):
        return _conv2d_apply(x, w, bias, stride, padding)
    return _conv2d_forward(x, w, bias, stride, padding)[0]


def linear(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """x @ w.T + bias with autograd: the custom op under torch.compile, the eager path otherwise;
    in autocast's precision where it is on."""
    x, w, bias = _autocast(x, w, bias)
    if torch.compiler.is_compiling():
        y = matmul(x.reshape(-1, x.shape[-1]), w.t()).reshape(*x.shape[:-1], w.shape[0])
        return y if bias is None else y + bias
    if _tracked(x, w, bias):
        return _linear_apply(x, w, bias)
    return _linear_forward(x, w, bias)[0]
