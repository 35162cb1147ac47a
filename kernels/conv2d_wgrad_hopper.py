"""Hopper (sm_90a) conv2d weight gradient in Gluon: split-K GEMM on TMA im2col and WGMMA.

grad_w[Co, R*S*Ci] = grad_out^T[Co, N*P*Q] @ im2col(x)[N*P*Q, R*S*Ci], NHWC, fp16 or bf16.

A tile is (BLOCK_M output channels) x (BLOCK_N input channels of one filter tap (r, s)); its
reduction runs over the N*P*Q output pixels, BLOCK_K at a time: grad_out rows by tiled TMA
(read as [pixels, Co] and fed to WGMMA transposed), x by TMA im2col at offset (r, s).

Two schedules, chosen by SPLIT_K (see spaces/hopper.py):
- split-K: persistent CTAs over (split, tile) units numbered split-major,
  so the CTAs running together share the same pixel range of grad_out and x in L2; each split
  writes an fp32 partial and gluon_split_k.split_k_reduce sums them in a fixed order
  (deterministic); with one split the kernel writes grad_w directly. Warp-specialized: a
  one-warp TMA loader feeds the WGMMA warps through a `num_stages` mbarrier ring.
- stream-K: every CTA runs an equal share of the (tile, k-step)
  iterations, for problems with too few tiles for whole waves and too short a reduction to
  split (ResNet-50's 512-channel 7x7 layer: 72 tiles of 98 k-steps on 132 SMs); the tiles
  that CTAs share are summed inside the kernel in CTA order (deterministic).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import KernelSpec, problems
from . import gluon_device as gdev
from . import gluon_hopper as ghop
from . import gluon_host as gh
from . import gluon_launch as direct
from . import gluon_packed_taps as gpt
from . import gluon_split_k as sk
from . import gluon_wgrad as gwg
from .geometry import is_pointwise  # noqa: F401 (its specs pick their kernel by it: in the version)
from .gluon_hopper import wgmma_acc_layout
from .gluon_wgrad import wgrad_num_pieces, wgrad_piece
from .spaces.hopper import SPACES

OP, BACKEND, KERNEL, problem, inputs, reference, flops = problems.backend_names("conv2d_wgrad", "hopper")


# ---- device code -------------------------------------------------------------------------------


@gluon.jit
def _issue_load(slot, kk, co_blk, ci_blk, r, s, g_desc, x_desc, a_bufs, b_bufs, ready, conv, IM2COL: gl.constexpr):
    """TMA-load k-step kk's pixels m0... of grad_out (output channel block co_blk) and of
    im2col(x) at tap (r, s) (input channel block ci_blk) into ring slot `slot`, completing on
    ready[slot]; conv: the kernel's integer arguments."""
    m0 = kk * g_desc.block_type.shape[0]
    co0 = co_blk * g_desc.block_type.shape[1]
    ci0 = ci_blk * x_desc.block_type.shape[1]
    _, _, _, _, PQ, Q, stride_h, stride_w, pad_h, pad_w, _, _, _ = conv
    bar = ready.index(slot)
    mbarrier.expect(bar, g_desc.block_type.nbytes + x_desc.block_type.nbytes)
    tma.async_load(g_desc, [m0, co0], bar, a_bufs.index(slot))
    if IM2COL:
        pq = m0 % PQ
        tma.async_load_im2col(
            x_desc,
            [m0 // PQ, (pq // Q) * stride_h - pad_h, (pq % Q) * stride_w - pad_w, ci0],
            [r.to(gl.int16), s.to(gl.int16)],
            bar,
            b_bufs.index(slot),
        )
    else:  # 1x1, stride 1, no padding: x as it lies, [N*H*W, Ci]
        tma.async_load(x_desc, [m0, ci0], bar, b_bufs.index(slot))


@gluon.jit
def _load_partition(
    g_desc,
    x_desc,
    a_bufs,
    b_bufs,
    ready,
    empty,
    conv,
    STREAM: gl.constexpr,
    IM2COL: gl.constexpr,
):
    """The loader warp: TMA loads of every piece of this CTA's work into the ring, each slot as
    soon as the WGMMA warps release it."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_M: gl.constexpr = g_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = x_desc.block_type.shape[1]
    Co, Ci, RS, S, _, _, _, _, _, _, k_steps, per, num_splits = conv
    co_blocks = gl.cdiv(Co, BLOCK_M)
    ci_blocks = gl.cdiv(Ci, BLOCK_N)
    tiles = co_blocks * ci_blocks * RS
    use = 0
    for i in range(wgrad_num_pieces(tiles, k_steps, per, num_splits, STREAM)):
        _, _, co_blk, ci_blk, rs, k_from, k_to = wgrad_piece(i, co_blocks, ci_blocks, tiles, k_steps, per, STREAM)
        r = rs // S
        s = rs % S
        for kk in range(k_from, k_to):
            slot = use % STAGES
            mbarrier.wait(empty.index(slot), ((use // STAGES) & 1) ^ 1)
            _issue_load(slot, kk, co_blk, ci_blk, r, s, g_desc, x_desc, a_bufs, b_bufs, ready, conv, IM2COL)
            use += 1


@gluon.jit
def _mma_partition(
    a_bufs,
    b_bufs,
    ready,
    empty,
    c_desc,
    c_smem,
    out_ptr,
    ws_ptr,
    flags_ptr,
    conv,
    STREAM: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The WGMMA warps: one WGMMA in flight, each ring slot released once the WGMMA that read it
    has retired; a piece's epilogue runs while the loader already fills the next piece's slots.

    Split-K stores each piece into its split's slab of out_ptr. Stream-K stores a tile it ran
    whole into out_ptr; a tile shared by CTAs c_lo..c_hi is finished by c_hi, which holds its
    last k-steps: the others (each holds at most one such piece, the first it runs) store
    their fp32 partial in ws_ptr [CTAs, BLOCK_M, BLOCK_N] and raise flags_ptr[cta]; c_hi
    reaches the tile last in its own run, adds the partials in CTA order (deterministic),
    lowers the flags and stores the sum. It only waits on lower-numbered CTAs, started before it.
    A finished tile of grad_w leaves through c_smem by TMA store (c_desc: grad_w as [Co, RS, Ci],
    its Ci edge clipped): stored from registers, the accumulator's fragments went out in 4-byte
    pieces, a third of the time of a 7x7 layer's 25-k-step tiles (H100). fp32 split partials
    still go out from registers."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.shape[2]
    acc_layout: gl.constexpr = wgmma_acc_layout(BLOCK_M, BLOCK_N, num_warps)
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
    rows0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    tile_offs = rows0[:, None] * BLOCK_N + cols0[None, :]
    pid = gl.program_id(0)
    Co, Ci, RS, _, _, _, _, _, _, _, k_steps, per, num_splits = conv
    co_blocks = gl.cdiv(Co, BLOCK_M)
    ci_blocks = gl.cdiv(Ci, BLOCK_N)
    tiles = co_blocks * ci_blocks * RS
    row_len = RS * Ci
    use = 0
    for i in range(wgrad_num_pieces(tiles, k_steps, per, num_splits, STREAM)):
        split, t, co_blk, ci_blk, rs, k_from, k_to = wgrad_piece(i, co_blocks, ci_blocks, tiles, k_steps, per, STREAM)
        for kk in range(k_from, k_to):
            slot = use % STAGES
            mbarrier.wait(ready.index(slot), (use // STAGES) & 1)
            acc = warpgroup_mma(
                a_bufs.index(slot).permute((1, 0)), b_bufs.index(slot), acc, use_acc=kk != k_from, is_async=True
            )
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # the previous k-step's WGMMA has retired: its slot goes back to the loader
            mbarrier.arrive(empty.index((use + STAGES - 1) % STAGES), pred=kk != k_from)
            use += 1
        # outside the k-loop: no WGMMA is in flight across the epilogue's branches
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((use + STAGES - 1) % STAGES))
        if STREAM:
            if k_to < k_steps:
                gl.store(ws_ptr + pid.to(gl.int64) * (BLOCK_M * BLOCK_N) + tile_offs, acc)
                gl.barrier()
                gl.atomic_store(flags_ptr + pid, 1, sem="release", scope="gpu")
            elif k_from > 0:
                for c in range(t * k_steps // per, pid):
                    gl.atomic_poll(flags_ptr + c, 1, sem="acquire", scope="gpu")
                    acc += gl.load(ws_ptr + c.to(gl.int64) * (BLOCK_M * BLOCK_N) + tile_offs, cache_modifier=".cg")
                    gl.atomic_store(flags_ptr + c, 0, sem="relaxed", scope="gpu")
            done = k_to == k_steps
        else:
            done = k_to > 0
        if done:
            if out_ptr.dtype.element_ty == gl.float32:
                rows = co_blk * BLOCK_M + rows0
                ci = ci_blk * BLOCK_N + cols0
                mask = (rows < Co)[:, None] & (ci < Ci)[None, :]
                base = (split.to(gl.int64) * Co + rows.to(gl.int64)) * row_len + rs * Ci
                gl.store(out_ptr + base[:, None] + ci[None, :], acc, mask=mask)
            else:
                tma.store_wait(pendings=0)  # the previous tile's store has left c_smem
                c_smem.reshape([BLOCK_M, BLOCK_N]).store(acc.to(c_desc.dtype))
                fence_async_shared()
                tma.async_store(c_desc, [co_blk * BLOCK_M, rs, ci_blk * BLOCK_N], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit(do_not_specialize=list(gwg.WGRAD_INTS))
def conv2d_wgrad_kernel(
    g_desc,
    x_desc,
    c_desc,
    out_ptr,
    ws_ptr,
    flags_ptr,
    Co,
    Ci,
    RS,
    S,
    PQ,
    Q,
    stride_h,
    stride_w,
    pad_h,
    pad_w,
    k_steps,
    per,
    num_splits,
    STREAM: gl.constexpr,
    STAGES: gl.constexpr,
    IM2COL: gl.constexpr,
    num_warps: gl.constexpr,
):
    """g_desc: tiles of grad_out [N*P*Q, Co]; x_desc: im2col over x [N, H, W, Ci]; c_desc: grad_w
    as [Co, R*S, Ci] in [BLOCK_M, 1, BLOCK_N] blocks (a launch into fp32 partials leaves it unused).
    Split-K (STREAM False): out_ptr [num_splits, Co, RS*Ci] (fp32 partials, or grad_w itself
    with one split), `per` k-steps per split; ws_ptr and flags_ptr unused.
    Stream-K: out_ptr grad_w [Co, RS*Ci], ws_ptr [CTAs, BLOCK_M, BLOCK_N] fp32, flags_ptr
    [CTAs] int32 (all zero at launch, left so), `per` iterations per CTA.

    Warp-specialized: a one-warp TMA loader and the WGMMA warps talk through ready/empty
    mbarrier rings, so no k-step waits on a CTA-wide barrier (the single-partition version
    of this loop synchronized all warps several times per k-step and ran 10-35% slower)."""
    a_bufs, b_bufs, c_smem, ready, empty = ghop.specialized_rings(g_desc, x_desc, c_desc, STAGES)
    conv = (Co, Ci, RS, S, PQ, Q, stride_h, stride_w, pad_h, pad_w, k_steps, per, num_splits)  # gluon_wgrad.WGRAD_INTS
    # fmt: off
    gl.warp_specialize(
        [
            (_mma_partition, (
                a_bufs, b_bufs, ready, empty, c_desc, c_smem, out_ptr, ws_ptr, flags_ptr, conv, STREAM, num_warps,
            )),
            (_load_partition, (g_desc, x_desc, a_bufs, b_bufs, ready, empty, conv, STREAM, IM2COL)),
        ],
        [1],
        [40],
    )
    # fmt: on
    gdev.invalidate_rings(ready, empty)


@gluon.jit
def _packed_a_load(i, n, k_from, co0, g_desc, a_bufs, ready, STAGES: gl.constexpr):
    """TMA-load the A tile (grad_out's, or x's in the few-Co kernel) of this split's i-th pixel
    step (no-op past its last)."""
    pred = i < n
    slot = i % STAGES
    mbarrier.expect(ready.index(slot), g_desc.block_type.nbytes, pred)
    tma.async_load(
        g_desc, [(k_from + i) * g_desc.block_type.shape[0], co0], ready.index(slot), a_bufs.index(slot), pred
    )


@gluon.jit
def _gathered_mainloop(
    a_desc, a_bufs, b_bufs, ready, a0, k_from, n, gather, FEW_CO: gl.constexpr, num_warps: gl.constexpr
):
    """The packed-taps and few-Co kernels' main loop: A tiles (columns a0...) by TMA through
    the ring, B gathered one pixel step ahead (gluon_wgrad.gathered_b) into a double buffer
    that is the WGMMA's B as it lies. Returns the retired accumulator."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.shape[2]
    for i in gl.static_range(STAGES - 1):
        _packed_a_load(i, n, k_from, a0, a_desc, a_bufs, ready, STAGES)

    m0 = k_from * BLOCK_K
    b = gwg.gathered_b(m0, gather, BLOCK_K, BLOCK_N, FEW_CO, num_warps)
    acc_layout: gl.constexpr = wgmma_acc_layout(BLOCK_M, BLOCK_N, num_warps)
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
    for i in range(n):
        slot = i % STAGES
        # the WGMMA that last read this B buffer (i - 2) has retired: at most one is in flight
        b_bufs.index(i % 2).store(b)
        fence_async_shared()
        m0 += BLOCK_K
        b = gwg.gathered_b(m0, gather, BLOCK_K, BLOCK_N, FEW_CO, num_warps)
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(slot).permute((1, 0)), b_bufs.index(i % 2), acc, use_acc=i > 0, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        _packed_a_load(i + STAGES - 1, n, k_from, a0, a_desc, a_bufs, ready, STAGES)
    return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))


@gluon.jit
def _gather_setup(a_desc, rows, cols, k_steps, per, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The packed-taps and few-Co kernels' set-up: the A ring and the double-buffered B tile
    (gluon_wgrad.gather_buffers) and the A ring's barriers, then this CTA's (split, tile) of the
    [rows, cols] output (gluon_wgrad.gather_unit). Returns (a_bufs, b_bufs, ready, (split, first
    row, first column, first k-step, k-steps))."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[1]
    a_bufs, b_bufs = gwg.gather_buffers(a_desc, STAGES, 2, BLOCK_N)
    ready = gdev.barrier_ring(STAGES)
    return a_bufs, b_bufs, ready, gwg.gather_unit(rows, cols, k_steps, per, BLOCK_M, BLOCK_N)


@gluon.jit(do_not_specialize=list(gwg.PACKED_WGRAD_INTS))
def conv2d_wgrad_packed_kernel(
    g_desc,
    x_ptr,
    out_ptr,
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
    NPQ,
    k_steps,
    per,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Few input channels (gluon_packed_taps.packs_taps): grad_w [Co, K = R*S*Ci packed] in
    [BLOCK_M, BLOCK_N] tiles, one (split, tile) per CTA, numbered split-major so the CTAs
    running together read the same pixels. g_desc: tiles of grad_out [N*P*Q, Co] (fed to
    WGMMA transposed) in a ring of STAGES; x_ptr: x [N, H, W, Ci], its im2col gathered one
    pixel step ahead (gluon_packed_taps.packed_gather) into a double buffer that is the WGMMA's B as
    it lies; out_ptr: grad_w [Co, K] with one split, else fp32 partials [splits, Co, K]."""
    BLOCK_M: gl.constexpr = g_desc.block_type.shape[1]
    a_bufs, b_bufs, ready, unit = _gather_setup(g_desc, Co, K, k_steps, per, BLOCK_N, STAGES)
    split, co0, n0, k_from, n = unit
    gather = (x_ptr, n0, K, SCi, Ci, H, W, NPQ, PQ, Q, stride_h, stride_w, pad_h, pad_w)
    acc = _gathered_mainloop(g_desc, a_bufs, b_bufs, ready, co0, k_from, n, gather, False, num_warps)
    acc_layout: gl.constexpr = wgmma_acc_layout(BLOCK_M, BLOCK_N, num_warps)
    rows = co0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    mask = (rows < Co)[:, None] & (cols < K)[None, :]
    base_out = (split.to(gl.int64) * Co + rows) * K
    gl.store(out_ptr + base_out[:, None] + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    gdev.invalidate_ring(ready)


@gluon.jit(do_not_specialize=list(gwg.FEW_CO_WGRAD_INTS))
def conv2d_wgrad_few_co_kernel(
    x_desc,
    g_ptr,
    out_ptr,
    Co,
    Ci,
    RS,
    S,
    HW,
    W,
    P,
    Q,
    stride_h,
    stride_w,
    pad_h,
    pad_w,
    NHW,
    k_steps,
    per,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    STRIDED: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Few output channels (gluon_wgrad.wgrad_few_co): grad_w^T [Ci, R*S*Co] in [BLOCK_M, BLOCK_N]
    tiles (BLOCK_N spans every tap), one (split, Ci block) per CTA numbered split-major so the
    CTAs running together gather the same grad_out pixels. x_desc: tiles of x [N*H*W, Ci] (fed
    to WGMMA transposed) in a ring of STAGES, each x pixel read once; g_ptr: grad_out [N, P, Q,
    Co], gathered one pixel step ahead (gluon_wgrad.few_co_gather) into a double buffer that is
    the WGMMA's B as it lies; out_ptr: grad_w [Co, R, S, Ci] with one split, else fp32 partials
    [splits, Co, R, S, Ci]. The packed-taps kernel's schedule with the operands' roles swapped."""
    # one column block: BLOCK_N spans every tap
    a_bufs, b_bufs, ready, unit = _gather_setup(x_desc, Ci, BLOCK_N, k_steps, per, BLOCK_N, STAGES)
    split, ci0, _, k_from, n = unit
    gather = (g_ptr, Co, RS, S, HW, W, P, Q, stride_h, stride_w, pad_h, pad_w, NHW, STRIDED)
    acc = _gathered_mainloop(x_desc, a_bufs, b_bufs, ready, ci0, k_from, n, gather, True, num_warps)
    gwg.few_co_store(out_ptr, split, acc, ci0, 0, Co, RS, Ci, num_warps)
    gdev.invalidate_ring(ready)


JIT_FUNCTIONS = (
    conv2d_wgrad_kernel,
    conv2d_wgrad_packed_kernel,
    conv2d_wgrad_few_co_kernel,
    sk.split_k_reduce_kernel,
)


# ---- configs -------------------------------------------------------------------------------------

STREAM_K = gwg.STREAM_K  # SPLIT_K of the stream-K schedule; 0 asks for the modeled best split count
FEW_CO_NARROWEST = min(SPACES[OP].params["BLOCK_N"])  # the few-Co kernel's B tile is at least this wide
# the packed-taps and few-Co kernels ring only the operand TMA reads, their pace set by the
# other's gather: the rings of 6-12 that feed the TMA-only kernel made an image stem's wgrad
# 20% slower where its tune could take them (H100, ResNet-50 conv1 at batch 32 and 128)
GATHER_MAX_STAGES = 5


def supports(p: dict, device) -> bool:
    return device.capability == (9, 0) and p.get("dtype") in gh.MMA_DTYPES and gh.conv_geometry_ok(p)


def config_space(p: dict, device) -> list[dict]:
    """The space, less configs that would run but cannot help on this problem (too-large
    tiles, narrow two-warpgroup tiles, splits past what fills the GPU). Resource limits are left to
    prune(), which must agree with the compiler."""
    sms = gh.sm_count_of(device)
    return [c for c in SPACES[OP] if not resources_ok(c, p, sms) or worth_trying(c, p, sms)]


def resources_ok(c: dict, p: dict | None = None, sms: int | None = None) -> bool:
    """The resource rule (prune() applies it; it must agree with the compiler): shared memory
    and the accumulator's registers."""
    packed = p is not None and _gathers(p, c)
    # a launch into fp32 split partials stores from registers: its binary has no grad_w tile
    partials = p is not None and sms is not None and not packed and gwg.WgradWork.of(p, c, sms).into_partials
    return ghop.wgmma_resources_ok(c, smem_bytes(c, packed=packed, tma_out=not partials))


def _gathers(p: dict, c: dict) -> bool:
    """Whether one operand is gathered through pointers (the packed-taps and few-Co kernels:
    an A ring, a double-buffered B, a register epilogue) rather than both read by TMA."""
    return gpt.packs_taps(p) or gwg.runs_few_co(p, c, FEW_CO_NARROWEST)


def smem_bytes(c: dict, itemsize: int = 2, packed: bool = False, tma_out: bool = True) -> int:
    """The ring of (grad_out, x) tiles and the grad_w tile TMA stores from (tma_out); the packed
    (few-Co) kernel rings grad_out (x) only, double-buffers its gathered x (grad_out) and stores
    from registers."""
    b_tiles = 2 if packed else c["num_stages"]
    ring = (c["num_stages"] * c["BLOCK_M"] + b_tiles * c["BLOCK_N"]) * c["BLOCK_K"] * itemsize
    c_tile = c["BLOCK_M"] * c["BLOCK_N"] * itemsize if tma_out and not packed else 0
    return ring + c_tile + 8 * c["num_stages"] + 1024


def worth_trying(c: dict, p: dict, sms: int) -> bool:
    """The performance rule (config_space() applies it): could this config win on this problem
    on `sms` SMs? Whether it fits the device is resources_ok()'s question."""
    # two warpgroups split a 64-row tile along N: only worth it on wide tiles
    if c["num_warps"] == 8 and c["BLOCK_M"] == 64 and c["BLOCK_N"] < 128:
        return False
    if _gathers(p, c) and c["num_stages"] > GATHER_MAX_STAGES:
        return False
    npq = p["N"] * p["P"] * p["Q"]
    if gwg.runs_few_co(p, c, FEW_CO_NARROWEST):
        # M is Ci; the B tile spans every tap's channels (BLOCK_N)
        return (
            gwg.few_co_split_worth_trying(c, p, sms)
            and c["BLOCK_M"] <= max(64, gh.pow2_at_least(p["Ci"]))
            and c["BLOCK_K"] <= max(32, gh.pow2_at_least(p["N"] * p["H"] * p["W"]))
        )
    if c["BLOCK_K"] > max(32, gh.pow2_at_least(npq)) or c["BLOCK_M"] > max(64, gh.pow2_at_least(p["Co"])):
        return False
    if gpt.packs_taps(p):
        # its split count follows from the tiles (gluon_wgrad.packed_wgrad_work); the B tile
        # spans packed taps, a whole filter at most
        return c["SPLIT_K"] == 0 and c["BLOCK_N"] <= max(16, gh.pow2_at_least(gpt.packed_k(p)))
    ci = gh.padded_channels(p["Ci"], p["dtype"])
    if c["BLOCK_N"] > max(16, gh.pow2_at_least(ci)):
        return False
    w = gwg.WgradWork.of(p, c, sms)
    if c["SPLIT_K"] > 0 and w.splits < c["SPLIT_K"]:
        return False  # the same launch as a smaller SPLIT_K
    # once the output tiles alone fill the GPU twice, splitting only adds reduction
    if c["SPLIT_K"] > 1 and w.tiles >= 2 * sms:
        return False
    return not (w.stream and w.per < c["num_stages"])  # runs too short to fill the pipeline


def prune(configs: list[dict], p: dict, device) -> list[dict]:
    """Configs that fit the device, the likeliest winners first."""
    sms = gh.sm_count_of(device)
    kept = [c for c in configs if resources_ok(c, p, sms)]
    return ghop.quick_first(OP, kept, p, sms)


def default_config(p: dict, device) -> dict:
    sms = gh.sm_count_of(device)
    ci = gh.padded_channels(p["Ci"], p["dtype"])
    bm = 128 if p["Co"] >= 128 else 64
    bn = min(128, max(16, gh.pow2_at_least(ci)))
    if gpt.packs_taps(p):
        bn = min(64, max(16, gh.pow2_at_least(gpt.packed_k(p))))
    if gwg.few_co_by_default(p):
        bm, bn = (128 if p["Ci"] >= 128 else 64), gwg.few_co_width(p, FEW_CO_NARROWEST)
    elif gwg.runs_few_co(p, {"BLOCK_N": bn}, FEW_CO_NARROWEST):
        bn //= 2  # that width would take the few-Co kernel
    warps = 8 if bm == 128 and bn >= 128 else 4
    c = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "SPLIT_K": 0, "num_warps": warps, "num_stages": 4}
    if not (resources_ok(c, p, sms) and worth_trying(c, p, sms)):
        fitting = prune(config_space(p, device), p, device)
        if fitting:
            c = max(fitting, key=lambda x: (x["BLOCK_M"] * x["BLOCK_N"], x["BLOCK_K"], -abs(x["SPLIT_K"])))
    return c


# ---- host side -----------------------------------------------------------------------------------


def _constexprs(c: dict, im2col: bool) -> dict:
    return {
        "STREAM": c["SPLIT_K"] == STREAM_K,
        "STAGES": c["num_stages"],
        "IM2COL": im2col,
        "num_warps": c["num_warps"],
    }


class _Plan:
    """One (config, x/grad_out shapes and strides, dtype, filter, stride, padding, device) launch,
    precomputed: see gluon_launch.DirectLauncher."""

    __slots__ = (
        "launcher",
        "reduce",
        "maps",
        "grid0",
        "tail",
        "g_desc",
        "x_desc",
        "c_desc",
        "ci",
        "pad_x",
        "pad_g",
        "ci_g",
        "out_shape",
        "mode",
        "ws_shape",
        "Ci0",
    )

    def run(self, x: torch.Tensor, g: torch.Tensor, stream: int) -> torch.Tensor | None:
        xp = gh.pad_last_dim(x, self.ci) if self.pad_x else x
        gp = gh.pad_last_dim(g, self.ci_g) if self.pad_g else g
        out = x.new_empty(self.out_shape)
        mode = self.mode  # "direct", "split" or "stream"
        ws = None if mode == "direct" else direct.stream_workspace(x, stream, self.ws_shape)
        po, pw = out.data_ptr(), 0 if ws is None else ws.data_ptr()  # ints to the launcher: no driver query
        if (po | pw) & 15:
            return None  # pointer arguments were specialized 16-byte aligned: the JIT path
        px, pg = xp.data_ptr(), gp.data_ptr()
        maps, ld = self.maps, self.launcher
        gm = maps.get((0, pg)) or maps.put((0, pg), ld.expand_desc(0, self.g_desc(gp)))
        xm = maps.get((1, px)) or maps.put((1, px), ld.expand_desc(1, self.x_desc(xp)))
        cm = maps.get((2, po)) or maps.put((2, po), ld.expand_desc(2, self.c_desc(out)))
        if mode == "stream":
            flags = sk.zeroed_counters(x.device, stream, self.grid0)
            ld(self.grid0, stream, [*gm, *xm, *cm, po, pw, flags.data_ptr(), *self.tail])
        elif mode == "split":
            ld(self.grid0, stream, [*gm, *xm, *cm, pw, pw, pw, *self.tail])
            self.reduce(stream, ws, out)
        else:
            ld(self.grid0, stream, [*gm, *xm, *cm, po, po, po, *self.tail])
        return out if self.ci == self.Ci0 else out[..., : self.Ci0].contiguous()


class _GatherPlan:
    """A packed-taps or few-Co launch (its kernel and, when split, the reduction), precomputed
    as _Plan: one operand (grad_out, or x with few_co) read by TMA as [rows, cols], the other
    gathered through its pointer."""

    __slots__ = ("launcher", "reduce", "maps", "grid0", "tail", "blk", "cols", "rows", "out_shape", "few_co")

    def run(self, x: torch.Tensor, g: torch.Tensor, stream: int) -> torch.Tensor | None:
        tiled, gathered = (x, g) if self.few_co else (g, x)
        tp = gh.pad_last_dim(tiled, self.cols)
        out = x.new_empty(self.out_shape)
        ws = None if self.reduce is None else self.reduce.workspace(x, stream)
        pg, po = gathered.data_ptr(), out.data_ptr() if ws is None else ws.data_ptr()  # ints: no driver query
        if (pg | po | out.data_ptr()) & 15:
            return None  # pointer arguments were specialized 16-byte aligned: the JIT path
        pt = tp.data_ptr()
        dm = self.maps.get(pt) or self.maps.put(
            pt, self.launcher.expand_desc(0, gh.tiled_desc(tp.view(self.rows, self.cols), self.blk))
        )
        self.launcher(self.grid0, stream, [*dm, pg, po, *self.tail])
        if ws is not None:
            self.reduce(stream, ws, out)
        return out


_PLANS = direct.PlanCache()


def _plan_key(dev: int, config: dict, x: torch.Tensor, g: torch.Tensor, R: int, S: int, stride=1, padding=0):
    st, pd = direct.int_pair_key(stride), direct.int_pair_key(padding)
    if st is None or pd is None or type(R) is not int or type(S) is not int:
        return None
    return (direct.config_key(config), x.shape, x.stride(), g.shape, g.stride(), x.dtype, g.dtype, R, S, st, pd, dev)


def plan_for(config: dict, *args):
    """(plan, device) of a call whose first launch made one, else None: gluon_launch.plan_for."""
    return direct.plan_for(_PLANS, _plan_key, config, args)


def launch(config: dict, x: torch.Tensor, grad_out: torch.Tensor, R: int, S: int, stride=1, padding=0) -> torch.Tensor:
    key = None
    if direct.direct_launch_enabled():
        key, plan, _, stream = direct.look_up(_PLANS, _plan_key, config, (x, grad_out, R, S, stride, padding))
        if plan is not None:
            out = plan.run(x, grad_out, stream)
            if out is not None:
                return out
    return _launch_jit(config, x, grad_out, R, S, stride, padding, key)


def _launch_jit(
    config: dict, x: torch.Tensor, grad_out: torch.Tensor, R: int, S: int, stride, padding, key
) -> torch.Tensor:
    (sh, sw), (ph, pw) = problems.stride_padding(stride, padding)
    N, H, W, Ci0 = x.shape
    _, P, Q, Co = grad_out.shape
    if gpt.packs_taps({"Ci": Ci0}):
        return _launch_gather_jit(config, x, grad_out, R, S, (sh, sw), (ph, pw), key, False)
    if gwg.runs_few_co({"Ci": Ci0, "Co": Co, "R": R, "S": S}, config, FEW_CO_NARROWEST):
        return _launch_gather_jit(config, x, grad_out, R, S, (sh, sw), (ph, pw), key, True)
    xp, gp = gh.pad_channels(x), gh.pad_channels(grad_out)
    Ci = xp.shape[-1]
    npq = N * P * Q
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    work = gwg.WgradWork(Co, Ci, R * S, npq, config, gh.num_sms(x.device))
    mode = "stream" if work.stream else ("split" if work.into_partials else "direct")
    out = torch.empty((Co, R, S, Ci), device=x.device, dtype=x.dtype)
    ws_shape = (work.ctas, bm, bn) if mode == "stream" else (work.splits, Co, R * S * Ci)
    ws = None if mode == "direct" else torch.empty(ws_shape, device=x.device, dtype=torch.float32)
    gc = gp.shape[-1]

    def g_desc_of(t):
        return gh.tiled_desc(t.view(npq, gc), [bk, bm])

    im2col, x_desc_of = gh.conv_x_desc(R, S, (sh, sw), (ph, pw), (P, Q), [bk, bn])

    def c_desc_of(t):
        return gh.tiled_desc(t.view(Co, R * S, Ci), [bm, 1, bn])

    g_desc, x_desc = g_desc_of(gp), x_desc_of(xp)
    grid = (work.ctas,)
    ce = _constexprs(config, im2col)
    geometry = (Co, Ci, R * S, S, P * Q, Q, sh, sw, ph, pw)
    if mode == "stream":
        flags = sk.zeroed_counters(x.device, torch.cuda.current_stream(x.device).cuda_stream, work.ctas)
        ptrs = (out, ws, flags)
    else:
        target = out if mode == "direct" else ws
        ptrs = (target, target, target)  # ws_ptr and flags_ptr unused
    scalars = geometry + (work.k_steps, work.per, work.splits)
    compiled = conv2d_wgrad_kernel[grid](g_desc, x_desc, c_desc_of(out), *ptrs, *scalars, **ce)
    split = (sk.split_k_reduce_jit(ws, out), ws, out) if mode == "split" else None
    aligned = not (out.data_ptr() | (0 if ws is None else ws.data_ptr())) & 15
    plan = direct.new_plan(
        _Plan, key if aligned else None, compiled, conv2d_wgrad_kernel, 6, scalars, ce, grid[0], split
    )
    if plan is not None:
        plan.g_desc, plan.x_desc, plan.c_desc = g_desc_of, x_desc_of, c_desc_of
        plan.ci, plan.ci_g, plan.pad_x, plan.pad_g = Ci, gc, xp is not x, gp is not grad_out
        plan.out_shape, plan.mode, plan.ws_shape, plan.Ci0 = (Co, R, S, Ci), mode, ws_shape, Ci0
        _PLANS.put(key, plan)
    return out if Ci == Ci0 else out[..., :Ci0].contiguous()


def _packed_constexprs(c: dict) -> dict:
    return {"BLOCK_N": c["BLOCK_N"], "STAGES": c["num_stages"], "num_warps": c["num_warps"]}


def _launch_gather_jit(config: dict, x, grad_out, R: int, S: int, stride, padding, key, few_co: bool):
    """A packed-taps or few-Co JIT launch (gluon_wgrad.gather_launch), its split reduction, and
    the launch kept as a _GatherPlan under `key` where it can be replayed (16-byte aligned
    pointers, the caller's own grad_out)."""
    if few_co:
        fn, ce = conv2d_wgrad_few_co_kernel, gwg.few_co_constexprs(_packed_constexprs(config), stride)
    else:
        fn, ce = conv2d_wgrad_packed_kernel, _packed_constexprs(config)
    g = gwg.gather_launch(config, x, grad_out, R, S, stride, padding, few_co)
    compiled = fn[(g.ctas,)](g.desc, g.gathered, g.target(), *g.ints, **ce)
    out, ws = g.out, g.ws
    split = None if ws is None else (sk.split_k_reduce_jit(ws, out), ws, out)
    aligned = not (g.gathered.data_ptr() | out.data_ptr() | (0 if ws is None else ws.data_ptr())) & 15
    if not aligned or (few_co and g.gathered is not grad_out):  # the plan launches the caller's tensor
        key = None
    plan = direct.new_plan(_GatherPlan, key, compiled, fn, 3, g.ints, ce, g.ctas, split)
    if plan is not None:
        plan.blk, plan.cols, plan.rows, plan.out_shape, plan.few_co = g.blk, g.cols, g.rows, tuple(out.shape), few_co
        _PLANS.put(key, plan)
    return out


def compile_specs(p: dict, config: dict, device) -> list[KernelSpec]:
    kernels = (conv2d_wgrad_kernel, conv2d_wgrad_packed_kernel, conv2d_wgrad_few_co_kernel)
    ce = (_constexprs, _packed_constexprs)
    return gwg.wgrad_specs(kernels, ce, p, config, device, FEW_CO_NARROWEST, c_desc=True)
