"""Blackwell (sm_100a) conv2d forward in Gluon: implicit GEMM on TMA im2col and tcgen05.

y[N*P*Q, Co] = im2col(x)[N*P*Q, R*S*Ci] @ w[Co, R*S*Ci]^T, NHWC, fp16 or bf16, per-axis
stride and padding.

Persistent and warp-specialized like matmul_blackwell (building blocks in gluon_blackwell):
  load partition (1 warp)   per k-step one TMA im2col load of the activations (BLOCK_M
                            consecutive output pixels, TMA wrapping rows and images itself,
                            times BLOCK_K channels of one filter tap (r, s), zeros where the
                            window overhangs the padding) and one tiled load of w viewed as
                            [Co, R*S*Ci];
  MMA partition (1 warp)    tcgen05 MMAs into a double-buffered fp32 accumulator in tensor
                            memory (the weight tile fed through a permuted view: K-major B);
  epilogue (num_warps)      tensor memory -> registers -> shared -> TMA store of y [M, Co].
A 1x1, stride-1, unpadded conv reads x as the plain [N*H*W, Ci] matrix it is (tiled TMA).
Channel counts that break TMA's 16-byte stride rule are zero-padded on the host (gluon_host),
the same host code the Hopper backend runs.

The k-steps walk the channel blocks of a tap before the next tap: the weight tile's columns
advance contiguously, and a channel block that overhangs Ci reads zeros from im2col (TMA's
out-of-bounds fill), so the neighbouring tap's weights it meets add nothing.

Where the tiles leave SMs idle (batch 1, few output channels), SPLIT_K 0 splits each tile's
k-steps the work model's number of ways (gluon_packed_taps.fprop_splits, the Hopper fprop's rule):
work items are (split, tile) pairs numbered split-major, and the split binary's epilogue
writes each one's fp32 partial from tensor memory for gluon_split_k.split_k_reduce to sum in
split order.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import fence_async_shared, mbarrier, tma

from . import KernelSpec, problems
from . import gluon_blackwell as gbw
from . import gluon_device as gdev
from . import gluon_host as gh
from . import gluon_packed_taps as gpt
from . import gluon_split_k as sk
from .geometry import is_pointwise  # noqa: F401 (its specs pick their kernel by it: in the version)
from .gluon_blackwell import (
    WORKER_REGS,
    free_stage,
    gather_rings,
    likeliest_first,
    mma_partition,
    mma_when_loaded,
    partial_epilogue,
    pipeline_rings,
    ring_slot,
    split_k_range,
    store_gathered,
    tma_store_epilogue,
    wait_acc,
)
from .spaces.blackwell import SPACES

OP, BACKEND, KERNEL, problem, inputs, reference, flops = problems.backend_names("conv2d_fprop", "blackwell")
# the kernel's shape arguments: unspecialized i32, so one compile per config serves every shape
_SHAPE_ARGS = ("M", "Co", "Ci", "R", "S", "PQ", "Q", "stride_h", "stride_w", "pad_h", "pad_w", "group_m")


# ---- device code ---------------------------------------------------------------------------


@gluon.jit
def _load_partition(
    x_desc,
    w_desc,
    a_bufs,
    b_bufs,
    ready,
    empty,
    walk,
    conv,
    IM2COL: gl.constexpr,
):
    """The loader warp: each work item's (walk = (tile rows, tile columns, work items, k-steps
    a work item)) TMA loads of x by im2col and w's tiles into the ring; conv: the kernel's
    shape arguments (_SHAPE_ARGS)."""
    num_pid_m, num_pid_n, num_work, k_per_split = walk
    _, _, Ci, R, S, PQ, Q, stride_h, stride_w, pad_h, pad_w, group_m = conv
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
    ci_blocks = gl.cdiv(Ci, BLOCK_K)
    tiles = num_pid_m * num_pid_n
    use = 0
    for work_id in range(gl.program_id(0), num_work, gl.num_programs(0)):
        split, k_start, k_count = split_k_range(work_id, tiles, R * S * ci_blocks, k_per_split)
        pid_m, pid_n = gdev.grouped_tile(work_id - split * tiles, num_pid_m, num_pid_n, group_m)
        # first output pixel of the tile -> the top-left corner of its window in the input
        m0 = pid_m * BLOCK_M
        n = m0 // PQ
        pq = m0 % PQ
        h0 = (pq // Q) * stride_h - pad_h
        w0 = (pq % Q) * stride_w - pad_w
        off_n = pid_n * BLOCK_N
        # the split's first k-step -> its tap (r, s) and channel block; then stepped, not divided
        tap = k_start // ci_blocks
        c0 = (k_start - tap * ci_blocks) * BLOCK_K
        r = tap // S
        s = tap - r * S
        for _k in range(k_count):
            slot, bar = free_stage(use, empty, ready, nbytes)
            if IM2COL:
                offsets = [r.to(gl.int16), s.to(gl.int16)]
                tma.async_load_im2col(x_desc, [n, h0, w0, c0], offsets, bar, a_bufs.index(slot))
            else:  # 1x1, stride 1, no padding: x is the GEMM's A as it lies, [N*H*W, Ci]
                tma.async_load(x_desc, [m0, c0], bar, a_bufs.index(slot))
            tma.async_load(w_desc, [off_n, (r * S + s) * Ci + c0], bar, b_bufs.index(slot))
            c0, r, s, wrapped = gdev.next_conv_k(c0, r, s, Ci, R, S, BLOCK_K)
            use += 1


@gluon.jit
def _epilogue(
    y_desc, c_smem, ws_ptr, acc_tmem, acc_ready, acc_empty, num_pid_m, num_pid_n, group_m, num_work, M, LDW,
    SPLIT: gl.constexpr,
):  # fmt: skip
    """The binary's epilogue: fp32 partials into ws (SPLIT), else y by TMA store."""
    if SPLIT:
        partial_epilogue(ws_ptr, acc_tmem, acc_ready, acc_empty, num_pid_m, num_pid_n, group_m, num_work, M, LDW)
    else:
        tma_store_epilogue(y_desc, c_smem, acc_tmem, acc_ready, acc_empty, num_pid_m, num_pid_n, group_m)


@gluon.jit(do_not_specialize=[*_SHAPE_ARGS, "SPLITS", "K_PER", "LDW"])
def conv2d_fprop_kernel(
    x_desc,
    w_desc,
    y_desc,
    ws_ptr,
    M,
    Co,
    Ci,
    R,
    S,
    PQ,
    Q,
    stride_h,
    stride_w,
    pad_h,
    pad_w,
    group_m,
    SPLITS,
    K_PER,
    LDW,
    NUM_BUFFERS: gl.constexpr,
    NUM_ACC: gl.constexpr,
    IM2COL: gl.constexpr,
    SPLIT: gl.constexpr,
):
    """x_desc: im2col over x [N, H, W, Ci] (IM2COL) or tiles of x as [N*H*W, Ci];
    w_desc: tiles of w [Co, R*S*Ci]; y_desc: y [M, Co] in [BLOCK_M, epilogue slice] blocks.
    SPLIT (the tiles leave SMs idle: batch 1, few output channels): work items are (split,
    tile) pairs numbered split-major, K_PER k-steps each, and ws_ptr [SPLITS, M, LDW] fp32
    (LDW: y's row, Co padded) receives their partials; the unsplit binary ignores all four."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    rings = pipeline_rings(x_desc, w_desc, NUM_BUFFERS, NUM_ACC, BLOCK_M, BLOCK_N)
    a_bufs, b_bufs, ready, empty, acc_ready, acc_empty, acc_tmem = rings
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(Co, BLOCK_N)
    tiles = num_pid_m * num_pid_n
    k_iters = R * S * gl.cdiv(Ci, BLOCK_K)
    if SPLIT:
        num_work = tiles * SPLITS
        k_per_split = K_PER
        c_smem = a_bufs  # unused: the split binary's partials leave from tensor memory
    else:
        num_work = tiles
        k_per_split = k_iters
        c_smem = gl.allocate_shared_memory(y_desc.dtype, [2] + y_desc.block_type.shape, y_desc.layout)
    walk = (num_pid_m, num_pid_n, num_work, k_per_split)
    conv = (M, Co, Ci, R, S, PQ, Q, stride_h, stride_w, pad_h, pad_w, group_m)  # _SHAPE_ARGS
    # the partitions' argument lists written out: a tuple kept in a variable loses its
    # constexpr members
    # fmt: off
    gl.warp_specialize(
        [
            (_epilogue, (
                y_desc, c_smem, ws_ptr, acc_tmem, acc_ready, acc_empty, num_pid_m, num_pid_n, group_m, num_work, M,
                LDW, SPLIT,
            )),
            (mma_partition, (rings, num_work, tiles, k_iters, k_per_split, False, True)),
            (_load_partition, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, walk, conv, IM2COL)),
        ],
        [1, 1],
        [WORKER_REGS, WORKER_REGS],
    )
    # fmt: on
    gdev.invalidate_rings(ready, empty, acc_ready, acc_empty)


@gluon.jit
def _packed_b_load(use, k_tiles, n0, w_desc, b_bufs, ready, done):
    """TMA-load k-step `use`'s tile of the packed weights once the MMA that last read its slot
    is done (no-op past the tile's k-loop)."""
    NUM_BUFFERS: gl.constexpr = b_bufs.shape[0]
    slot, phase = ring_slot(use, NUM_BUFFERS)
    pred = use < k_tiles
    mbarrier.wait(done.index(slot), phase ^ 1, pred=pred)
    mbarrier.expect(ready.index(slot), w_desc.block_type.nbytes, pred)
    tma.async_load(w_desc, [n0, use * w_desc.block_type.shape[1]], ready.index(slot), b_bufs.index(slot), pred)


@gluon.jit(do_not_specialize=list(gpt.PACKED_FPROP_INTS))
def conv2d_fprop_packed_kernel(
    x_ptr,
    w_desc,
    y_desc,
    M,
    Co,
    Ci,
    K,
    SCi,
    H,
    W,
    PQ,
    Q,
    stride_h,
    stride_w,
    pad_h,
    pad_w,
    GROUP_M,
    BLOCK_M: gl.constexpr,
    NUM_BUFFERS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Few input channels (gluon_packed_taps.packs_taps), the Hopper packed kernel's schedule on
    tcgen05: K = R*S*Ci packed, one output tile per CTA, x gathered one k-step ahead in
    registers (gluon_packed_taps.packed_gather) into the A ring, the packed weights [Co, K] by TMA
    (w_desc), the fp32 accumulator in tensor memory, y [M, Co] stored by TMA in slices of
    y_desc's block width."""
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    EPI_N: gl.constexpr = y_desc.block_type.shape[1]
    dtype: gl.constexpr = y_desc.dtype
    g_layout: gl.constexpr = gpt.packed_gather_layout(BLOCK_K, num_warps)
    a_bufs, b_bufs = gpt.packed_fprop_rings(w_desc, BLOCK_M, NUM_BUFFERS)
    c_smem = gl.allocate_shared_memory(dtype, [2] + y_desc.block_type.shape, y_desc.layout)
    ready, done, acc_bar, acc = gather_rings(NUM_BUFFERS, 1, BLOCK_M, BLOCK_N)

    m0, n0, k_tiles = gpt.packed_fprop_tile(M, Co, K, GROUP_M, BLOCK_M, BLOCK_N, BLOCK_K)
    for i in gl.static_range(NUM_BUFFERS - 1):
        _packed_b_load(i, k_tiles, n0, w_desc, b_bufs, ready, done)
    base, h0, w0 = gpt.packed_rows(m0, M, PQ, Q, H, W, Ci, stride_h, stride_w, pad_h, pad_w, BLOCK_M, g_layout)
    a = gpt.packed_gather(x_ptr, base, h0, w0, 0, K, SCi, Ci, H, W, BLOCK_K, g_layout)
    for kk in range(k_tiles):
        slot, phase = store_gathered(a, a_bufs, done, kk)
        a = gpt.packed_gather(x_ptr, base, h0, w0, (kk + 1) * BLOCK_K, K, SCi, Ci, H, W, BLOCK_K, g_layout)
        mma_when_loaded(a_bufs, b_bufs, acc, slot, phase, ready, done, kk, False, True)
        _packed_b_load(kk + NUM_BUFFERS - 1, k_tiles, n0, w_desc, b_bufs, ready, done)
    wait_acc(acc_bar)
    for j in gl.static_range(BLOCK_N // EPI_N):
        buf = c_smem.index(j % 2)
        part = acc.slice(j * EPI_N, EPI_N).load().to(dtype)
        tma.store_wait(1)  # the store issued from this buffer two slices ago has read it
        buf.store(part)
        fence_async_shared()
        tma.async_store(y_desc, [m0, n0 + j * EPI_N], buf)
    tma.store_wait(0)
    gdev.invalidate_rings(ready, done, acc_bar)


JIT_FUNCTIONS = (conv2d_fprop_kernel, conv2d_fprop_packed_kernel)


# ---- configs ---------------------------------------------------------------------------------


def supports(p: dict, device) -> bool:
    return gbw.on_blackwell(device) and p.get("dtype") in gh.MMA_DTYPES and gh.conv_geometry_ok(p)


def config_space(p: dict, device) -> list[dict]:
    return gbw.space_worth_trying(SPACES[OP], p, device, worth_trying)


def worth_trying(c: dict, p: dict, sms: int = 148) -> bool:
    """The performance rule (config_space() applies it): no tile far larger than the problem. A
    k-step covers one filter tap, so channel blocks beyond the (padded) Ci only read zeros; wide
    N tiles beyond Co compute padding; a 16-wide N tile only for an image head's few output
    channels; SPLIT_K 0 only where the work model splits (else the same launch as 1). Whether
    it fits the device is resources_ok()'s question."""
    if c["SPLIT_K"] == 0 and gpt.fprop_splits(p, c, sms)[0] == 1:
        return False
    ci = gh.padded_channels(p["Ci"], p["dtype"])
    if gpt.packs_taps(p):
        # the packed kernel's ring holds weights (L2-resident) and A tiles written a step ahead
        ci = gpt.packed_k(p)
        if c["NUM_BUFFERS"] > 3 or c["BLOCK_N"] < 32:
            return False
    if c["BLOCK_N"] < 32 and gh.padded_channels(p["Co"], p["dtype"]) > c["BLOCK_N"]:
        return False
    return (
        c["BLOCK_K"] <= max(32, gh.pow2_at_least(ci))
        and c["BLOCK_N"] <= max(32, gh.pow2_at_least(p["Co"]))
        and c["BLOCK_M"] <= max(64, gh.pow2_at_least(p["gemm_M"]))
    )


def resources_ok(c: dict, p: dict, sms: int = 148) -> bool:
    """gluon_blackwell.fits, of the binary this config launches on this problem: the split one's
    partials leave from registers, with no staging slices."""
    split = gpt.fprop_splits(p, c, sms)[0] > 1
    return gbw.fits(c, gbw.smem_bytes(c, p, staged=not split))


def prune(configs: list[dict], p: dict, device) -> list[dict]:
    """Configs that fit the device, the likeliest winners first (gluon_blackwell.likeliest_first)."""
    sms = gh.sm_count_of(device)
    return likeliest_first([c for c in configs if resources_ok(c, p, sms)], gh.tap_k_step(p["Ci"]))


def default_config(p: dict, device) -> dict:
    """The Hopper fprop's choice by shape class: 128-row tiles (64 for 64 pixels or fewer) as
    wide as Co allows, a 16- or 32-wide one for an image head, and the work model's split
    (SPLIT_K 0) where it splits."""
    sms = gh.sm_count_of(device)
    ci = gh.padded_channels(p["Ci"], p["dtype"])
    co = gh.padded_channels(p["Co"], p["dtype"])
    bk = min(64, max(32, gh.pow2_at_least(ci)))
    bn = 256 if p["Co"] >= 256 else 128 if p["Co"] >= 128 else 64 if co > 32 else 32 if co > 16 else 16
    bm = 128 if p["gemm_M"] > 64 else 64
    c = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "NUM_BUFFERS": 4, "NUM_ACC": 2, "GROUP_M": 8}
    c.update(SPLIT_K=0, num_warps=4)
    if gpt.packs_taps(p):
        c.update(BLOCK_N=max(32, min(bn, 128)), BLOCK_K=32, NUM_BUFFERS=2, SPLIT_K=1)
    if c["SPLIT_K"] == 0 and gpt.fprop_splits(p, c, sms)[0] == 1:
        c["SPLIT_K"] = 1  # the model does not split: the unsplit config (SPLIT_K 0 is dropped as its twin)
    space = config_space(p, device)
    if c not in space or not resources_ok(c, p, sms):
        fitting = prune(space, p, device)
        c = max(fitting, key=lambda x: (x["BLOCK_M"] * x["BLOCK_N"], x["BLOCK_K"], x["NUM_BUFFERS"]))
    return c


# ---- host side ---------------------------------------------------------------------------------


def _constexprs(c: dict, im2col: bool, split: bool) -> dict:
    return {"NUM_BUFFERS": c["NUM_BUFFERS"], "NUM_ACC": c["NUM_ACC"], "IM2COL": im2col, "SPLIT": split}


def _blocks(c: dict):
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    return [bm, bk], [bn, bk], [bm, gbw.epilogue_n(c)]


def launch(config: dict, x: torch.Tensor, w: torch.Tensor, stride=1, padding=0) -> torch.Tensor:
    (sh, sw), (ph, pw) = problems.stride_padding(stride, padding)
    N, H, W, Ci = x.shape
    Co, R, S, _ = w.shape
    P, Q = problems.out_size(H, R, sh, ph), problems.out_size(W, S, sw, pw)
    M = N * P * Q
    co_pad = gh.padded_channels(Co, x.dtype)
    y = torch.empty((M, co_pad), device=x.device, dtype=x.dtype)
    x_blk, w_blk, y_blk = _blocks(config)
    if gpt.packs_taps({"Ci": Ci}):
        w_desc, y_desc = gh.tiled_desc(gpt.packed_weights(w), w_blk), gh.tiled_desc(y, y_blk)
        grid = (triton.cdiv(M, config["BLOCK_M"]) * triton.cdiv(Co, config["BLOCK_N"]),)
        ints = gpt.packed_fprop_ints(x.shape, w.shape, (sh, sw), (ph, pw), (P, Q), config["GROUP_M"])
        conv2d_fprop_packed_kernel[grid](x, w_desc, y_desc, *ints, **_packed_constexprs(config))
        y = y if co_pad == Co else y[:, :Co].contiguous()
        return y.view(N, P, Q, Co)
    xp, wp = gh.pad_channels(x), gh.pad_channels(w)
    Ci = xp.shape[-1]
    im2col, x_desc_of = gh.conv_x_desc(R, S, (sh, sw), (ph, pw), (P, Q), x_blk)
    x_desc = x_desc_of(xp)
    w_desc = gh.tiled_desc(wp.view(Co, R * S * Ci), w_blk)
    y_desc = gh.tiled_desc(y, y_blk)
    tiles = triton.cdiv(M, config["BLOCK_M"]) * triton.cdiv(Co, config["BLOCK_N"])
    sms = gh.num_sms(x.device)
    k_steps = R * S * triton.cdiv(Ci, config["BLOCK_K"])
    n_split, per = sk.modeled_splits(config, tiles, k_steps, M * co_pad, sms)
    split = n_split > 1
    ws = sk.split_k_workspace(n_split, M, co_pad, x.device) if split else sk.no_split_workspace(x.device)
    grid = gh.persistent_grid(tiles * n_split, sms)
    scalars = (M, Co, Ci, R, S, P * Q, Q, sh, sw, ph, pw, config["GROUP_M"], n_split, per, co_pad)
    conv2d_fprop_kernel[grid](
        x_desc, w_desc, y_desc, ws, *scalars, num_warps=config["num_warps"], **_constexprs(config, im2col, split)
    )
    if split:
        sk.split_k_reduce(ws, y)
    y = y if co_pad == Co else y[:, :Co].contiguous()
    return y.view(N, P, Q, Co)


def _packed_constexprs(c: dict) -> dict:
    return {"BLOCK_M": c["BLOCK_M"], "NUM_BUFFERS": c["NUM_BUFFERS"], "num_warps": c["num_warps"]}


def compile_specs(p: dict, config: dict, device) -> list[KernelSpec]:
    kernels = (conv2d_fprop_kernel, conv2d_fprop_packed_kernel)
    return gpt.fprop_specs(kernels, p, config, _blocks(config), (_constexprs, _packed_constexprs), device)
