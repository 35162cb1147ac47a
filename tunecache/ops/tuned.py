"""The tuned ops as the kernels take them (NHWC convs, 2-D matmul): each call looks its raw shape
up in its op's memo (`tunecache.ops.launcher.Op`) and launches; a miss resolves the config once.
`tunecache.ops` offers these, and the autograd custom ops (`tunecache.ops.custom`) call them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tunecache.ops.launcher import Op
from tunecache_kernels import problems
from tunecache_kernels.geometry import patches, runs_as_matmul, wgrad_runs_as_matmul

_matmul = Op("matmul", problems.matmul_problem)
_fprop = Op("conv2d_fprop", problems.conv2d_fprop_problem)
_wgrad = Op("conv2d_wgrad", problems.conv2d_wgrad_problem)
_dgrad = Op("conv2d_dgrad", problems.conv2d_dgrad_problem)

OP_LAUNCHERS = {op.name: op for op in (_matmul, _fprop, _wgrad, _dgrad)}  # each op's memo and slow path


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """c = a @ b for 2-D fp16/bf16/fp32 tensors, row- or column-major."""
    return _run_matmul(_matmul_key(a, b), a, b)


def matmul_add(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """a @ b + bias, the bias a row added to every row (a linear layer's): one launch of
    torch.addmm where the vendor's op won the matmul's key (as torch's own linear runs it),
    else the tuned matmul, then the add."""
    raw = _matmul_key(a, b)
    entry = _matmul.memo.get(raw)
    if entry is not None and entry.vendor and bias.dtype is a.dtype:
        return torch.addmm(bias, a, b)
    y = _run_matmul(raw, a, b)
    y += bias
    return y


def _run_matmul(raw: tuple, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    entry = _matmul.memo.get(raw)
    if entry is None or entry.provisional:
        entry = _matmul.resolve(raw, (a, b), a)
    return entry.run(a, b)


def _matmul_key(a: torch.Tensor, b: torch.Tensor) -> tuple:
    raw = (a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype, b.device)
    return raw + _fp32("matmul") if a.dtype is _F32 else raw


_F32 = torch.float32


def _fp32(kind: str) -> tuple:
    """A float32 call's precision, for its memo key: torch's settings may change between calls."""
    return (problems.fp32_precision(kind),)


def _settled(op: Op, raw: tuple, args: tuple, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """A conv's output where its raw key is settled: its memo entry's launch (a winner, not a
    provisional default), or a pointwise conv's launch on its matmul's plan (op.as_matmul, on
    the views a @ b); None where neither is (then the call takes its slow path)."""
    entry = op.memo.get(raw)
    if entry is not None and not entry.provisional:
        return entry.run(*args)
    fast = op.as_matmul.get(raw)
    return None if fast is None else fast(a, b)


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
    return _conv2d_fprop(_fprop_key(x, w, stride, padding), x, w, stride, padding)


def _conv2d_fprop(raw: tuple, x: torch.Tensor, w: torch.Tensor, stride, padding) -> torch.Tensor:
    """conv2d_fprop of the call whose memo key is `raw` (_fprop_key)."""
    args = (x, w, stride, padding)
    y = _settled(_fprop, raw, args, x, w)
    if y is not None:
        return y
    if w.dim() == 4 == x.dim() and runs_as_matmul(w.shape[1], w.shape[2], stride, padding):
        n, h, wd, ci = x.shape
        if w.shape[3] == ci and x.is_contiguous() and w.is_contiguous():  # else the conv's checks or copies
            return _as_matmul(_fprop, raw, x.view(n * h * wd, ci), w.view(w.shape[0], ci).t(), (n, h, wd, w.shape[0]))
    if (
        w.dim() == 4
        and _patch_conv(x, w.shape[1], w.shape[2], w.shape[3], stride, padding)
        and (x.dtype, x.device) == (w.dtype, w.device)
        and w.is_contiguous()
    ):
        rows, npq = _patch_rows(x, w.shape[1], w.shape[2])
        co = w.shape[0]
        return matmul(rows, w.reshape(co, -1).t()).view(*npq, co)
    return _fprop.resolve(raw, args, x).run(*args)


def _fprop_key(x: torch.Tensor, w: torch.Tensor, stride, padding) -> tuple:
    raw = (x.shape, x.stride(), x.dtype, x.device, w.shape, w.stride(), w.dtype, w.device, stride, padding)
    return raw + _fp32("conv") if x.dtype is _F32 else raw


def conv2d_layer(x, w, xn, wn, bias, stride: tuple, padding: tuple) -> torch.Tensor:
    """A conv layer's output, NCHW, from its NCHW tensors x and w and their NHWC views xn and
    wn (stride and padding as pairs): torch's own conv2d with its bias, as the layer would run
    it, where the vendor's op won the NHWC conv's key; else conv2d_fprop on the views, then the
    bias."""
    raw = _fprop_key(xn, wn, stride, padding)
    entry = _fprop.memo.get(raw)
    if entry is not None and entry.vendor:
        return F.conv2d(x, w, bias, stride, padding)
    y = _conv2d_fprop(raw, xn, wn, stride, padding)
    if bias is not None:
        y += bias
    return y.permute(0, 3, 1, 2)


def _patch_conv(x: torch.Tensor, R: int, S: int, ci: int, stride, padding) -> bool:
    """A patch embedding's conv (geometry.patches) of R x S filters over ci channels on an NHWC
    x that holds at least one patch (else the conv's own checks say what is wrong)."""
    return x.dim() == 4 and patches(R, S, stride, padding) and x.shape[3] == ci and x.shape[1] >= R and x.shape[2] >= S


def _patch_rows(x: torch.Tensor, R: int, S: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """x[N, H, W, C]'s patches of R x S as the rows [N*P*Q, R*S*C] of a matmul (a copy), and
    (N, P, Q); the rows and columns past the last whole patch are not read."""
    n, h, wd, c = x.shape
    p, q = h // R, wd // S
    rows = x[:, : p * R, : q * S].reshape(n, p, R, q, S, c).permute(0, 1, 3, 2, 4, 5).reshape(n * p * q, R * S * c)
    return rows, (n, p, q)


def _patch_image(rows: torch.Tensor, n: int, p: int, q: int, R: int, S: int, H: int, W: int) -> torch.Tensor:
    """_patch_rows backwards: rows [N*P*Q, R*S*C] back into an image [N, H, W, C], zero where no
    patch reaches."""
    c = rows.shape[1] // (R * S)
    img = rows.view(n, p, q, R, S, c).permute(0, 1, 3, 2, 4, 5).reshape(n, p * R, q * S, c)
    if (p * R, q * S) == (H, W):
        return img
    out = img.new_zeros((n, H, W, c))
    out[:, : p * R, : q * S] = img
    return out


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
    if x.dtype is _F32:
        raw += _fp32("conv")
    args = (x, grad_out, R, S, stride, padding)
    gw = _settled(_wgrad, raw, args, grad_out, x)
    if gw is not None:
        return gw
    if x.dim() == 4 == grad_out.dim() and wgrad_runs_as_matmul(
        R, S, stride, padding, x.shape[0] * x.shape[1] * x.shape[2]
    ):
        n, h, wd, ci = x.shape
        co = grad_out.shape[3]
        if grad_out.shape[:3] == x.shape[:3] and x.is_contiguous() and grad_out.is_contiguous():  # else the checks
            return _as_matmul(_wgrad, raw, grad_out.view(n * h * wd, co).t(), x.view(n * h * wd, ci), (co, 1, 1, ci))
    if type(R) is int and type(S) is int and grad_out.dim() == 4 and _patch_conv(x, R, S, x.shape[-1], stride, padding):
        rows, (n, p, q) = _patch_rows(x, R, S)
        if grad_out.shape[:3] == (n, p, q) and grad_out.dtype == x.dtype:  # else the wgrad's checks
            co = grad_out.shape[3]
            return matmul(grad_out.reshape(n * p * q, co).t(), rows).view(co, R, S, x.shape[3])
    return _wgrad.resolve(raw, args, x).run(*args)


def conv2d_dgrad(grad_out: torch.Tensor, w: torch.Tensor, H: int, W: int, stride=1, padding=0) -> torch.Tensor:
    """grad_x[N, H, W, Ci] of conv2d_fprop, from grad_out[N, P, Q, Co] and w[Co, R, S, Ci]: one
    tuned kernel over every output phase of the stride, none of them on a dilated gradient's
    zeros (the phases: tunecache_kernels.gluon_host); a pointwise conv's, the matmul it is
    (geometry.runs_as_matmul)."""
    if type(stride) is list or type(padding) is list:
        stride, padding = _hashable(stride), _hashable(padding)
    grad_out, w = grad_out.contiguous(), w.contiguous()  # a gradient may come in any layout
    raw = (grad_out.shape, grad_out.stride(), grad_out.dtype, grad_out.device, w.shape, w.stride(), w.dtype, w.device)
    raw += (H, W, stride, padding) + (_fp32("conv") if w.dtype is _F32 else ())
    args = (grad_out, w, H, W, stride, padding)
    gx = _settled(_dgrad, raw, args, grad_out, w)
    if gx is not None:
        return gx
    if w.dim() == 4 == grad_out.dim() and runs_as_matmul(w.shape[1], w.shape[2], stride, padding):
        n, p, q, co = grad_out.shape
        if (p, q) == (H, W) and w.shape[0] == co:  # else the dgrad's checks say what is wrong
            return _as_matmul(_dgrad, raw, grad_out.view(n * p * q, co), w.view(co, w.shape[3]), (n, p, q, w.shape[3]))
    if _patch_dgrad(grad_out, w, H, W, stride, padding):
        n, p, q, co = grad_out.shape
        rows = matmul(grad_out.view(n * p * q, co), w.view(co, -1))
        return _patch_image(rows, n, p, q, w.shape[1], w.shape[2], H, W)
    return _dgrad.resolve(raw, args, grad_out).run(*args)


def _patch_dgrad(grad_out: torch.Tensor, w: torch.Tensor, H, W, stride, padding) -> bool:
    """A patch embedding's dgrad whose arguments agree (else the dgrad's checks say what is wrong)."""
    if grad_out.dim() != 4 or w.dim() != 4 or not (isinstance(H, int) and isinstance(W, int)):
        return False
    R, S = w.shape[1], w.shape[2]
    return (
        patches(R, S, stride, padding)
        and grad_out.shape[1:] == (H // R, W // S, w.shape[0])
        and grad_out.dtype == w.dtype
        and grad_out.device == w.device
    )


def _hashable(v):
    return tuple(v) if type(v) is list else v


def clear_memo() -> None:
    """Forget every in-process decision (the store keeps them), the store's read handles and the
    trials read to rank candidates by."""
    from tunecache.cache.config_cache import CACHE
    from tunecache.store import quick_read

    for op in OP_LAUNCHERS.values():
        op.clear()
    quick_read.forget()
    CACHE.forget_rankings()


# ---- with autograd and torch.compile: the calls of torch.nn.functional ----------------------
