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

from tunecache_kernels import problems

from . import ops

# ---- matmul ------------------------------------------------------------------------------


def _operand(t: Tensor) -> Tensor:
    """`t` itself when the GEMM kernels read it in place (`problems.matrix_layout`), else a copy."""
    try:
        problems.matrix_layout(t, "operand")
    except ValueError:
        return t.contiguous()
    return t


def _tuned_matmul(a: Tensor, b: Tensor) -> Tensor:
    return ops.matmul(_operand(a), _operand(b))


@torch.library.custom_op("tunecache::matmul", mutates_args=())
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


@torch.library.custom_op("tunecache::conv2d_nhwc", mutates_args=())
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


@torch.library.custom_op("tunecache::conv2d_wgrad_nhwc", mutates_args=())
def conv2d_wgrad_nhwc(x: Tensor, grad_out: Tensor, R: int, S: int, stride: list[int], padding: list[int]) -> Tensor:
    """grad_w[Co, R, S, Ci] of conv2d_nhwc, tuned (`tunecache.ops.conv2d_wgrad`)."""
    return ops.conv2d_wgrad(x.contiguous(), grad_out.contiguous(), R, S, tuple(stride), tuple(padding))


@conv2d_wgrad_nhwc.register_fake
def _(x: Tensor, grad_out: Tensor, R: int, S: int, stride: list[int], padding: list[int]) -> Tensor:
    return x.new_empty((grad_out.shape[3], R, S, x.shape[3]))


@torch.library.custom_op("tunecache::conv2d_dgrad_nhwc", mutates_args=())
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
# and backward run through a plain autograd.Function; under torch.compile the custom ops are
# what the graph captures.


class _Conv2dNHWC(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, stride: tuple, padding: tuple) -> Tensor:
        x, w = x.contiguous(), w.contiguous()  # NHWC views of channels_last tensors: no copies
        ctx.save_for_backward(x, w)
        ctx.stride, ctx.padding = stride, padding
        return ops.conv2d_fprop(x, w, stride, padding)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, w = ctx.saved_tensors
        dgrad, wgrad = ops.conv2d_dgrad, ops.conv2d_wgrad
        return _conv_grads(dgrad, wgrad, x, w, grad, ctx.stride, ctx.padding, ctx.needs_input_grad)


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor) -> Tensor:
        ctx.save_for_backward(a, b)
        return _tuned_matmul(a, b)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _matmul_grads(_tuned_matmul, *ctx.saved_tensors, grad, ctx.needs_input_grad)


def conv2d_autograd(x: Tensor, w: Tensor, stride: tuple[int, int], padding: tuple[int, int]) -> Tensor:
    """conv2d_nhwc with autograd: the custom op under torch.compile, the eager path otherwise."""
    if torch.compiler.is_compiling():
        return conv2d_nhwc(x, w, list(stride), list(padding))
    return _Conv2dNHWC.apply(x, w, tuple(stride), tuple(padding))


def matmul_autograd(a: Tensor, b: Tensor) -> Tensor:
    """matmul with autograd: the custom op under torch.compile, the eager path otherwise."""
    if torch.compiler.is_compiling():
        return matmul(a, b)
    return _Matmul.apply(a, b)
