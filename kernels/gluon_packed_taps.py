"""Packed taps: the im2col of a conv with few input channels, gathered through pointers (both
Gluon backends' fprop and wgrad).

With Ci <= 8 a tap's channels fill at most half of WGMMA's and tcgen05's smallest k-step (16),
so a k-loop over taps multiplies mostly zeros (the 7x7 stem, Ci = 3 padded to 8 and walked at
BLOCK_K = 16, does 5.3x the work). Packing the taps makes K = R*S*Ci one dense dimension,
k = (r*S + s)*Ci + c; TMA cannot gather such a tile, so it is loaded through pointers (for a
given r, the (s, c) run is contiguous in x) and stored to shared memory for the MMA.

Beside them, what both fprop backends decide alike: their splits (fprop_splits) and their
compile specs (fprop_specs), the packed kernel's among them, and the packed kernel's rings and
tile (packed_fprop_rings, packed_fprop_tile).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from . import KernelSpec
from .geometry import is_pointwise
from .gluon_device import grouped_tile
from .gluon_host import (
    cdiv,
    desc_sig,
    im2col_desc_sig,
    pad_last_dim,
    padded_channels,
    ptr_sig,
    round_up,
    sm_count_of,
    tma_multiple,
)
from .gluon_split_k import modeled_splits, split_k_reduce_spec

PACKED_MAX_CI = 8


def packs_taps(p: dict) -> bool:
    """A conv whose im2col the Gluon kernels gather with the taps packed (see above)."""
    return p["Ci"] <= PACKED_MAX_CI


def packed_k(p: dict) -> int:
    return p["R"] * p["S"] * p["Ci"]


def packed_weights(w: torch.Tensor) -> torch.Tensor:
    """w [Co, R, S, Ci] as the packed GEMM's [Co, K] with K padded to TMA's 16-byte rows (the
    zeros past K meet the gather's zeros)."""
    co = w.shape[0]
    return pad_last_dim(w.reshape(co, w[0].numel()), packed_width(w))


def packed_width(w: torch.Tensor) -> int:
    """The packed GEMM's K of w [Co, R, S, Ci]: R*S*Ci padded to TMA's 16-byte rows."""
    return round_up(w[0].numel(), tma_multiple(w.dtype))


@gluon.jit
def packed_rows(m0, M, PQ, Q, H, W, Ci, stride_h, stride_w, pad_h, pad_w, BLOCK_M: gl.constexpr, layout: gl.constexpr):
    """The gather's rows for output pixels m0...: each one's window corner (h0, w0) and the
    corner's offset in x [N, H, W, Ci]. Rows past M get a corner below every image (masked)."""
    m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    pq = m % PQ
    h0 = (pq // Q) * stride_h - pad_h
    w0 = (pq % Q) * stride_w - pad_w
    base = (((m // PQ).to(gl.int64) * H + h0) * W + w0) * Ci
    return base, gl.where(m < M, h0, 1 << 28), w0


@gluon.jit
def packed_gather(x_ptr, base, h0, w0, k0, K, SCi, Ci, H, W, BLOCK_K: gl.constexpr, layout: gl.constexpr):
    """A [rows, BLOCK_K] tile of im2col(x) at packed columns k0...: zeros past K and where the
    window overhangs the image."""
    k = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    r = k // SCi
    rem = k - r * SCi
    s = rem // Ci
    r = gl.where(k < K, r, 1 << 28)  # past K: a tap below every image
    ih = h0[:, None] + r[None, :]
    iw = w0[:, None] + s[None, :]
    ok = (ih < H) & (ih >= 0) & (iw >= 0) & (iw < W)
    return gl.load(x_ptr + (base[:, None] + (r * (W * Ci) + rem)[None, :]), mask=ok, other=0.0)


@gluon.jit
def packed_fprop_rings(w_desc, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """The operand rings of both architectures' packed fprop kernels: STAGES stages of the
    gathered A tile [BLOCK_M, BLOCK_K] (it shares the weights' swizzle: same dtype and row
    length) and of the packed weights' TMA tile [BLOCK_N, BLOCK_K]. Returns (a_bufs, b_bufs)."""
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], w_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    return a_bufs, b_bufs


@gluon.jit
def packed_fprop_tile(M, Co, K, GROUP_M, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """A packed fprop CTA's one output tile, in grouped order: (first pixel, first output
    channel, the k-steps of K)."""
    pid_m, pid_n = grouped_tile(gl.program_id(0), gl.cdiv(M, BLOCK_M), gl.cdiv(Co, BLOCK_N), GROUP_M)
    return pid_m * BLOCK_M, pid_n * BLOCK_N, gl.cdiv(K, BLOCK_K)


@gluon.constexpr_function
def packed_gather_layout(BLOCK_K, num_warps):
    """Threads along k in runs of 8 (one 16-byte shared-memory store each), warps along rows."""
    tpw_k = max(1, min(32, BLOCK_K // 8))
    return gl.BlockedLayout([1, BLOCK_K // tpw_k], [32 // tpw_k, tpw_k], [num_warps, 1], [1, 0])


# the packed kernels' integer arguments, in order (both backends)
PACKED_FPROP_INTS = ("M", "Co", "Ci", "K", "SCi", "H", "W", "PQ", "Q", "stride_h", "stride_w", "pad_h", "pad_w")


PACKED_FPROP_INTS += ("GROUP_M",)


def packed_fprop_ints(x_shape, w_shape, stride, padding, PQ: tuple[int, int], group_m: int) -> tuple:
    """A packed fprop kernel's PACKED_FPROP_INTS."""
    N, H, W, Ci = (int(v) for v in x_shape)
    Co, R, S, _ = (int(v) for v in w_shape)
    P, Q = PQ
    return (N * P * Q, Co, Ci, R * S * Ci, S * Ci, H, W, P * Q, Q, *stride, *padding, group_m)


def fprop_splits(p: dict, c: dict, sms: int) -> tuple[int, int]:
    """(splits, k-steps per split) of forward-conv config c on problem p, both backends' rule
    (gluon_split_k.modeled_splits); the packed-taps kernel never splits."""
    k_steps = p["R"] * p["S"] * cdiv(padded_channels(p["Ci"], p["dtype"]), c["BLOCK_K"])
    if packs_taps(p):
        return 1, k_steps
    tiles = cdiv(p["gemm_M"], c["BLOCK_M"]) * cdiv(p["Co"], c["BLOCK_N"])
    return modeled_splits(c, tiles, k_steps, p["gemm_M"] * padded_channels(p["Co"], p["dtype"]), sms)


def fprop_specs(kernels: tuple, p: dict, c: dict, blocks, constexprs: tuple, device, options=None) -> list[KernelSpec]:
    """Both Gluon fprop backends' compile specs. kernels = (the TMA kernel, the packed-taps one),
    constexprs = their constexpr functions ((c, im2col, split) and (c)); blocks = the x, w and y
    descriptors' blocks; every other non-constexpr parameter is an i32. The TMA kernel takes
    `options` and, where p splits, is followed by the split reduction."""
    dt = p["dtype"]
    x_blk, w_blk, y_blk = blocks
    fn, packed_fn = kernels
    sig = {"w_desc": desc_sig(dt, w_blk), "y_desc": desc_sig(dt, y_blk)}
    if packs_taps(p):
        fn, ce, options, split = packed_fn, constexprs[1](c), None, False
        sig = {"x_ptr": ptr_sig(dt), **sig}
    else:
        im2col = not is_pointwise(p)
        split = fprop_splits(p, c, sm_count_of(device))[0] > 1
        ce = constexprs[0](c, im2col, split)
        sig = {"x_desc": im2col_desc_sig(dt, x_blk) if im2col else desc_sig(dt, x_blk), **sig, "ws_ptr": "*fp32"}
    sig.update({k: "i32" for k in fn.arg_names if k not in sig and k not in ce})
    sig.update({k: "constexpr" for k in ce})
    spec = KernelSpec(fn, sig, ce, num_warps=c["num_warps"], options=options or {}, name=fn.__name__)
    numel = p["gemm_M"] * padded_channels(p["Co"], dt)  # y, the reduction's outputs
    return [spec, split_k_reduce_spec(dt, numel, sm_count_of(device))] if split else [spec]
