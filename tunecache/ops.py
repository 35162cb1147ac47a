"""The ops: tuned once per (kernel, device class, shape), then launched from the memo.

y = tunecache.ops.conv2d_fprop(x, w, stride=1, padding=1)     # NHWC
gw = tunecache.ops.conv2d_wgrad(x, grad_out, R, S, stride=1, padding=0)
c = tunecache.ops.matmul(a, b)
"""

from __future__ import annotations

import torch

from tunecache_kernels import problems

from .launcher import Op

_matmul = Op("matmul", problems.matmul_problem)
_fprop = Op("conv2d_fprop", problems.conv2d_fprop_problem)
_wgrad = Op("conv2d_wgrad", problems.conv2d_wgrad_problem)

OP_LAUNCHERS = {op.name: op for op in (_matmul, _fprop, _wgrad)}  # each op's memo and slow path


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """c = a @ b for 2-D fp16/bf16/fp32 tensors, row- or column-major."""
    raw = (a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype, b.device)
    entry = _matmul.memo.get(raw)
    if entry is None or entry.watch:
        entry = _matmul.resolve(raw, (a, b), a)
    return entry.run(a, b)


def conv2d_fprop(x: torch.Tensor, w: torch.Tensor, stride=1, padding=0) -> torch.Tensor:
    """y[N, P, Q, Co] = conv2d(x[N, H, W, Ci], w[Co, R, S, Ci]); stride/padding: int or (h, w)."""
    if type(stride) is list or type(padding) is list:  # lists cannot key the memo
        stride, padding = _hashable(stride), _hashable(padding)
    raw = (x.shape, x.stride(), x.dtype, x.device, w.shape, w.stride(), w.dtype, w.device, stride, padding)
    entry = _fprop.memo.get(raw)
    if entry is None or entry.watch:
        entry = _fprop.resolve(raw, (x, w, stride, padding), x)
    return entry.run(x, w, stride, padding)


def conv2d_wgrad(x: torch.Tensor, grad_out: torch.Tensor, R: int, S: int, stride=1, padding=0) -> torch.Tensor:
    """grad_w[Co, R, S, Ci] of conv2d_fprop, from x[N, H, W, Ci] and grad_out[N, P, Q, Co]."""
    if type(stride) is list or type(padding) is list:
        stride, padding = _hashable(stride), _hashable(padding)
    raw = (
        x.shape,
        x.stride(),
        x.dtype,
        x.device,
        grad_out.shape,
        grad_out.stride(),
        grad_out.dtype,
        grad_out.device,
        R,
        S,
        stride,
        padding,
    )
    entry = _wgrad.memo.get(raw)
    if entry is None or entry.watch:
        entry = _wgrad.resolve(raw, (x, grad_out, R, S, stride, padding), x)
    return entry.run(x, grad_out, R, S, stride, padding)


def _hashable(v):
    return tuple(v) if type(v) is list else v


def clear_memo() -> None:
    """Forget every in-process decision (the store keeps them), and the store's read handles."""
    from . import quick_read

    for op in OP_LAUNCHERS.values():
        op.clear()
    quick_read.forget()
