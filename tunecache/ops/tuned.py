"""The tuned ops as the kernels take them (NHWC convs, 2-D matmul): each call looks its raw shape
up in its op's memo (`tunecache.ops.launcher.Op`) and launches; a miss resolves the config once.
`tunecache.ops` offers these, and the autograd custom ops (`tunecache.ops.custom`) call them."""

from __future__ import annotations

import torch

from tunecache.ops.launcher import Op
from tunecache_kernels import problems
from tunecache_kernels.geometry import runs_as_matmul, wgrad_runs_as_matmul

_matmul = Op("matmul", problems.matmul_problem)
_fprop = Op("conv2d_fprop", problems.conv2d_fprop_problem)
_wgrad = Op("conv2d_wgrad", problems.conv2d_wgrad_problem)
_dgrad = Op("conv2d_dgrad", problems.conv2d_dgrad_problem)

OP_LAUNCHERS = {op.name: op for op in (_matmul, _fprop, _wgrad, _dgrad)}  # each op's memo and slow path


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """c = a @ b for 2-D fp16/bf16/fp32 tensors, row- or column-major."""
    return _run_matmul(_matmul_key(a, b), a, b)


def _run_matmul(raw: tuple, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    entry = _matmul.memo.get(raw)
    if entry is None or entry.provisional:
        entry = _matmul.resolve(raw, (a, b), a)
    return entry.run(a, b)


def _matmul_key(a: torch.Tensor, b: torch.Tensor) -> tuple:
    return (a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype, b.device)


def _as_matmul(op, raw: tuple, a: torch.Tensor, b: torch.Tensor, out_shape: tuple) -> torch.Tensor:
    """A pointwise conv's call as the matmul a @ b (views on its tensors), its output viewed
    as `out_shape`; its later calls launch straight on the matmul's plan (op.as_matmul)."""
    mraw = _matmul_key(a, b)
    out = _run_matmul(mraw, a, b).view(out_shape)
    op.remember_as_matmul(raw, _matmul, mraw, out_shape)
    return out


def conv2d_fprop(x: torch.Tensor, w: torch.Tensor, stride=1, padding=0) -> torch.Tensor:
    """y[N, P, Q, Co] = conv2d(x[N, H, W, Ci], w[Co, R, S, Ci]); stride/padding: int or (h, w).
    A pointwise conv runs as the matmul it is (geometry.runs_as_matmul)."""
    if type(stride) is list or type(padding) is list:  # lists cannot key the memo
        stride, padding = _hashable(stride), _hashable(padding)
    raw = (x.shape, x.stride(), x.dtype, x.device, w.shape, w.stride(), w.dtype, w.device, stride, padding)
    fast = _fprop.as_matmul.get(raw)
    if fast is not None:
        y = fast(x, w)
        if y is not None:
            return y
    if w.dim() == 4 == x.dim() and runs_as_matmul(w.shape[1], w.shape[2], stride, padding):
        n, h, wd, ci = x.shape
        if w.shape[3] == ci and x.is_contiguous() and w.is_contiguous():  # else the conv's checks or copies
            return _as_matmul(_fprop, raw, x.view(n * h * wd, ci), w.view(w.shape[0], ci).t(), (n, h, wd, w.shape[0]))
    entry = _fprop.memo.get(raw)
    if entry is None or entry.provisional:
        entry = _fprop.resolve(raw, (x, w, stride, padding), x)
    return entry.run(x, w, stride, padding)


def conv2d_wgrad(x: torch.Tensor, grad_out: torch.Tensor, R: int, S: int, stride=1, padding=0) -> torch.Tensor:
    """grad_w[Co, R, S, Ci] of conv2d_fprop, from x[N, H, W, Ci] and grad_out[N, P, Q, Co]. A
    pointwise conv's over few pixels runs as the matmul it is (geometry.wgrad_runs_as_matmul)."""
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
    fast = _wgrad.as_matmul.get(raw)
    if fast is not None:
        gw = fast(grad_out, x)
        if gw is not None:
            return gw
    if x.dim() == 4 == grad_out.dim() and wgrad_runs_as_matmul(
        R, S, stride, padding, x.shape[0] * x.shape[1] * x.shape[2]
    ):
        n, h, wd, ci = x.shape
        co = grad_out.shape[3]
        if grad_out.shape[:3] == x.shape[:3] and x.is_contiguous() and grad_out.is_contiguous():  # else the checks
            return _as_matmul(_wgrad, raw, grad_out.view(n * h * wd, co).t(), x.view(n * h * wd, ci), (co, 1, 1, ci))
    entry = _wgrad.memo.get(raw)
    if entry is None or entry.provisional:
        entry = _wgrad.resolve(raw, (x, grad_out, R, S, stride, padding), x)
    return entry.run(x, grad_out, R, S, stride, padding)


def conv2d_dgrad(grad_out: torch.Tensor, w: torch.Tensor, H: int, W: int, stride=1, padding=0) -> torch.Tensor:
    """grad_x[N, H, W, Ci] of conv2d_fprop, from grad_out[N, P, Q, Co] and w[Co, R, S, Ci]: one
    tuned kernel over every output phase of the stride, none of them on a dilated gradient's
    zeros (the phases: tunecache_kernels.gluon_host); a pointwise conv's, the matmul it is
    (geometry.runs_as_matmul)."""
    if type(stride) is list or type(padding) is list:
        stride, padding = _hashable(stride), _hashable(padding)
    grad_out, w = grad_out.contiguous(), w.contiguous()  # a gradient may come in any layout
    raw = (grad_out.shape, grad_out.stride(), grad_out.dtype, grad_out.device, w.shape, w.stride(), w.dtype, w.device)
    raw += (H, W, stride, padding)
    fast = _dgrad.as_matmul.get(raw)
    if fast is not None:
        gx = fast(grad_out, w)
        if gx is not None:
            return gx
    if w.dim() == 4 == grad_out.dim() and runs_as_matmul(w.shape[1], w.shape[2], stride, padding):
        n, p, q, co = grad_out.shape
        if (p, q) == (H, W) and w.shape[0] == co:  # else the dgrad's checks say what is wrong
            return _as_matmul(_dgrad, raw, grad_out.view(n * p * q, co), w.view(co, w.shape[3]), (n, p, q, w.shape[3]))
    entry = _dgrad.memo.get(raw)
    if entry is None or entry.provisional:
        entry = _dgrad.resolve(raw, (grad_out, w, H, W, stride, padding), grad_out)
    return entry.run(grad_out, w, H, W, stride, padding)


def _hashable(v):
    return tuple(v) if type(v) is list else v


def clear_memo() -> None:
    """Forget every in-process decision (the store keeps them), and the store's read handles."""
    from tunecache.store import quick_read

    for op in OP_LAUNCHERS.values():
        op.clear()
    quick_read.forget()


# ---- with autograd and torch.compile: the calls of torch.nn.functional ----------------------
