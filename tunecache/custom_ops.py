"""The ops as PyTorch sees them: `torch.library` custom ops with fake (meta) kernels and autograd.

`torch.ops.tunecache.matmul` and `torch.ops.tunecache.conv2d_nhwc` call the tuned ops of
`tunecache.ops`; registered as custom ops, `torch.compile(fullgraph=True)` captures them
without a graph break (the fake kernels give the output's shape from the inputs' alone),
autograd differentiates them, and `torch.library.opcheck` checks all of it.

Backward passes are tuned ops too: a matmul's gradients are matmuls of transposed views (the
GEMM kernels read column-major operands in place), a convolution's weight gradient is the
wgrad kernel, and the gradient of its input is the dgrad kernel, which splits it by output phase
(on Blackwell, which has no dgrad kernel yet, `dgrad` does that split here, `dgrad_phases`):
at stride sh x sw, the grad_x positions of one phase (rows a::sh, columns b::sw) are reached
only by the filter taps r0::sh, s0::sw, and are a stride-1 forward convolution of the output's
gradient with those taps flipped and transposed, tuned like any other convolution; no
multiply-add is spent on the zeros a dilated gradient would hold.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

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


@torch.library.custom_op("tunecache::matmul", mutates_args=())
def matmul(a: Tensor, b: Tensor) -> Tensor:
    """a @ b of 2-D tensors, tuned (`tunecache.ops.matmul`)."""
    return ops.matmul(_operand(a), _operand(b))


@matmul.register_fake
def _(a: Tensor, b: Tensor) -> Tensor:
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "matmul takes 2-D tensors")
    torch._check(a.shape[1] == b.shape[0], lambda: f"a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    return a.new_empty((a.shape[0], b.shape[1]))


def _matmul_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _matmul_backward(ctx, grad: Tensor):
    a, b = ctx.saved_tensors
    grad_a = matmul(grad, b.t()) if ctx.needs_input_grad[0] else None
    grad_b = matmul(a.t(), grad) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


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


@dataclass(frozen=True)
class DgradPhase:
    """One output phase of a convolution's input gradient: the grad_x positions rows a::sh,
    columns b::sw, reached only by the filter taps r0::sh, s0::sw. They are a stride-1 forward
    convolution of grad_out (padded by `pad` = (top, bottom, left, right); negative crops) with
    those taps flipped and transposed: every multiply-add is one the gradient needs."""

    a: int
    b: int
    r0: int
    s0: int
    taps: tuple[int, int]  # (rows, columns) of the phase's filter; 0 when no tap reaches it
    pad: tuple[int, int, int, int]

    def conv(self, p: int, q: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """The forward convolution that computes this phase from a grad_out of P x Q: ((H, W)
        of its input, grad_out's own), (its symmetric padding), (the first row and column of
        its output that the phase takes). An uneven or negative `pad` is met by its larger side
        and a window of the output: a row or column more is computed, where a padded copy of
        grad_out would cost all of it."""
        top, bottom, left, right = self.pad
        ph, pw = max(top, bottom, 0), max(left, right, 0)
        return (p, q), (ph, pw), (ph - top, pw - left)


def dgrad_phases(x_shape, w_shape, stride, padding) -> list[DgradPhase]:
    """The sh x sw output phases of conv2d_nhwc's input gradient (x NHWC, w [Co, R, S, Ci])."""
    return list(_phases(tuple(x_shape), tuple(w_shape), tuple(stride), tuple(padding)))


@functools.lru_cache(maxsize=4096)
def _phases(x_shape, w_shape, stride, padding) -> tuple[DgradPhase, ...]:
    """`dgrad_phases`, computed once per geometry: a backward pass asks at every step."""
    _, h, w, _ = x_shape
    _, r, s, _ = w_shape
    (sh, sw), (ph, pw) = stride, padding
    p, q = problems.out_size(h, r, sh, ph), problems.out_size(w, s, sw, pw)

    def axis(a: int, size: int, taps: int, st: int, pd: int, out_size: int) -> tuple[int, int, int, int, int]:
        first = (a + pd) % st
        n_taps = len(range(first, taps, st))
        rows = len(range(a, size, st))
        top = n_taps - 1 - (a + pd - first) // st
        return first, n_taps, top, rows + n_taps - 1 - out_size - top, rows

    phases = []
    for a in range(sh):
        r0, kr, top, bottom, rows = axis(a, h, r, sh, ph, p)
        for b in range(sw):
            s0, ks, left, right, cols = axis(b, w, s, sw, pw, q)
            if rows and cols:
                phases.append(DgradPhase(a, b, r0, s0, (kr, ks), (top, bottom, left, right)))
    return tuple(phases)


def dgrad(grad_out: Tensor, w: Tensor, x_shape, stride, padding) -> Tensor:
    """grad_x[N, H, W, Ci] of conv2d_nhwc (grad_out NHWC and w [Co, R, S, Ci] contiguous;
    stride, padding: (h, w) pairs): one tuned forward convolution per output phase, each
    launched through `ops.conv2d_fprop` directly (no custom op's dispatch per phase: on small
    layers that cost more than the convolution), the filter flipped once for all of them."""
    n, h, wd, ci = x_shape
    sh, sw = stride
    phases = _phases(tuple(x_shape), tuple(w.shape), tuple(stride), tuple(padding))
    flipped = w if w.shape[1:3] == (1, 1) else w.flip(1, 2)  # flip copies even where it is the identity
    if len(phases) == 1 and (sh, sw) == (1, 1):
        return _phase(grad_out, flipped, phases[0], stride, h, wd).contiguous()
    gaps = any(0 in ph.taps for ph in phases)
    gx = grad_out.new_zeros((n, h, wd, ci)) if gaps else grad_out.new_empty((n, h, wd, ci))
    for ph in phases:
        if 0 not in ph.taps:
            rows, cols = len(range(ph.a, h, sh)), len(range(ph.b, wd, sw))
            gx[:, ph.a :: sh, ph.b :: sw, :] = _phase(grad_out, flipped, ph, stride, rows, cols)
    return gx


def _phase(grad_out: Tensor, flipped: Tensor, ph: DgradPhase, stride, rows: int, cols: int) -> Tensor:
    """The phase's rows x cols of grad_x (a view of its convolution's output). `flipped` is the
    filter with its taps reversed: the phase's taps r0::sh, reversed, are a strided slice of it."""
    sh, sw = stride
    (kr, ks), (r, s) = ph.taps, flipped.shape[1:3]
    r1, s1 = r - 1 - ph.r0 - sh * (kr - 1), s - 1 - ph.s0 - sw * (ks - 1)
    taps = flipped[:, r1 : r1 + sh * (kr - 1) + 1 : sh, s1 : s1 + sw * (ks - 1) + 1 : sw, :]
    w_t = taps.permute(3, 1, 2, 0).contiguous()  # [Ci, kr, ks, Co]
    _, padding, (dr, dc) = ph.conv(grad_out.shape[1], grad_out.shape[2])
    out = ops.conv2d_fprop(grad_out, w_t, (1, 1), padding)
    return out[:, dr : dr + rows, dc : dc + cols, :]


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


def _conv_backward(ctx, grad: Tensor):
    x, w = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = (
        conv2d_dgrad_nhwc(grad, w, x.shape[1], x.shape[2], ctx.stride, ctx.padding) if ctx.needs_input_grad[0] else None
    )
    grad_w = (
        conv2d_wgrad_nhwc(x, grad, w.shape[1], w.shape[2], ctx.stride, ctx.padding) if ctx.needs_input_grad[1] else None
    )
    return grad_x, grad_w, None, None


conv2d_nhwc.register_autograd(_conv_backward, setup_context=_conv_setup)
