"""Blackwell (sm_100a) conv2d weight gradient in Gluon: split-K GEMM on TMA im2col and tcgen05.

grad_w[Co, R*S*Ci] = grad_out^T[Co, N*P*Q] @ im2col(x)[N*P*Q, R*S*Ci], NHWC, fp16 or bf16.

An output tile is BLOCK_M output channels x BLOCK_N input channels of one filter tap (r, s);
its reduction runs over the N*P*Q output pixels, BLOCK_K at a time. The reduction is split
SPLIT_K ways so that few output tiles (small filters, few channels) still fill the GPU; each
split writes an fp32 partial into a workspace and a second kernel (gluon_split_k.split_k_reduce,
shared with the Hopper backend) sums them in split order: deterministic, the same bits on
every run, unlike atomics. With one active split the kernel writes grad_w directly.

Persistent and warp-specialized (building blocks in gluon_blackwell):
  load partition (1 warp)   grad_out rows by tiled TMA ([pixels, Co] blocks, K-outer) and x by
                            TMA im2col at tap (r, s) ([pixels, channels] blocks, already the
                            [K, N] B operand);
  MMA partition (1 warp)    tcgen05 MMAs into a double-buffered fp32 accumulator in tensor
                            memory, the grad_out tile fed through a permuted view (M-major A);
  epilogue (num_warps)      tensor memory -> registers -> masked stores of the tile's rows and
                            of the tap's real channels only (a channel block that overhangs
                            Ci must not write into the next tap's columns).
Work items are numbered split-major, so the CTAs running together read the same pixel slab
of grad_out and x, which stays in L2.

The schedules are the Hopper wgrad's (gluon_wgrad.WgradWork divides the work, wgrad_piece
walks it on the device): SPLIT_K > 0 splits that many ways, 0 takes the work model's count,
-1 is stream-K, where every CTA runs an equal share of the (tile, k-step) iterations and the
tiles CTAs share are summed in the epilogue in CTA order (for too few tiles for whole waves
and a reduction too short to split).

SPLIT_K is a runtime argument (the launch passes the K-iterations per split): configs that
differ only in it share one compiled kernel, as long as they agree on whether the kernel
writes the fp32 workspace (several splits) or grad_w itself (one); stream-K has its own.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import mbarrier, tma

from . import KernelSpec, problems
from . import gluon_blackwell as gbw
from . import gluon_device as gdev
from . import gluon_host as gh
from . import gluon_packed_taps as gpt
from . import gluon_split_k as sk
from . import gluon_wgrad as gwg
from .geometry import is_pointwise  # noqa: F401 (its specs pick their kernel by it: in the version)
from .gluon_blackwell import (
    WORKER_REGS,
    epilogue_width,
    free_stage,
    gather_rings,
    likeliest_first,
    mma_into_next_acc,
    mma_when_loaded,
    pipeline_rings,
    ring_slot,
    store_acc_masked,
    store_gathered,
    wait_acc,
)
from .gluon_wgrad import wgrad_num_pieces, wgrad_piece
from .spaces.blackwell import SPACES

OP, BACKEND, KERNEL, problem, inputs, reference, flops = problems.backend_names("conv2d_wgrad", "blackwell")


# ---- device code ---------------------------------------------------------------------------


@gluon.jit
def _load_partition(
    g_desc,
    x_desc,
    a_bufs,
    b_bufs,
    ready,
    empty,
    pieces,
    window,
    STREAM: gl.constexpr,
    IM2COL: gl.constexpr,
):
    """The loader warp: each piece's (gluon_wgrad.wgrad_piece; pieces: its walk, as the kernel
    gives it) TMA loads of grad_out rows and of x's im2col window (window = (S, PQ, Q, stride_h,
    stride_w, pad_h, pad_w)) into the ring."""
    co_blocks, ci_blocks, tiles, k_steps, per, num_splits = pieces
    S, PQ, Q, stride_h, stride_w, pad_h, pad_w = window
    BLOCK_K: gl.constexpr = g_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = g_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = x_desc.block_type.shape[1]
    nbytes: gl.constexpr = g_desc.block_type.nbytes + x_desc.block_type.nbytes
    use = 0
    for i in range(wgrad_num_pieces(tiles, k_steps, per, num_splits, STREAM)):
        _, _, co_blk, ci_blk, rs, k_from, k_to = wgrad_piece(i, co_blocks, ci_blocks, tiles, k_steps, per, STREAM)
        r = (rs // S).to(gl.int16)
        s = (rs % S).to(gl.int16)
        off_co = co_blk * BLOCK_M
        c0 = ci_blk * BLOCK_N
        for kk in range(k_from, k_to):
            # BLOCK_K output pixels from pixel m on (TMA wraps rows and images by itself)
            m = kk * BLOCK_K
            slot, bar = free_stage(use, empty, ready, nbytes)
            tma.async_load(g_desc, [m, off_co], bar, a_bufs.index(slot))
            if IM2COL:
                n = m // PQ
                pq = m % PQ
                h = (pq // Q) * stride_h - pad_h
                w = (pq % Q) * stride_w - pad_w
                tma.async_load_im2col(x_desc, [n, h, w, c0], [r, s], bar, b_bufs.index(slot))
            else:  # 1x1, stride 1, no padding: im2col(x) is x as [N*H*W, Ci]
                tma.async_load(x_desc, [m, c0], bar, b_bufs.index(slot))
            use += 1


@gluon.jit
def _mma_partition(rings, pieces, STREAM: gl.constexpr):
    """The MMA warp: each piece's k-steps into the next free accumulator (rings: pipeline_rings'),
    grad_out's tile fed through a permuted view (M-major A)."""
    co_blocks, ci_blocks, tiles, k_steps, per, num_splits = pieces
    use = 0
    acc_use = 0
    for i in range(wgrad_num_pieces(tiles, k_steps, per, num_splits, STREAM)):
        _, _, _, _, _, k_from, k_to = wgrad_piece(i, co_blocks, ci_blocks, tiles, k_steps, per, STREAM)
        use, acc_use = mma_into_next_acc(rings, k_from, k_to, use, acc_use, True, False)


@gluon.jit
def _epilogue_partition(
    out_ptr,
    ws_ptr,
    flags_ptr,
    acc_tmem,
    acc_ready,
    acc_empty,
    pieces,
    Co,
    Ci,
    RS,
    STREAM: gl.constexpr,
):
    """Masked stores of each piece, only of the tap's real channels (a channel block that
    overhangs Ci must not write into the next tap's columns).

    Split-K: into its split's slab of out[split, Co, RS * Ci] (grad_w itself with one split).
    Stream-K (the Hopper kernel's protocol): a tile this CTA ran whole goes to grad_w; the head
    of a tile later CTAs end (this CTA's first piece) goes as an fp32 partial into ws[pid]
    ([BLOCK_M, BLOCK_N]) and raises flags[pid]; the CTA holding a tile's last k-steps waits for
    the flags of the CTAs before it on that tile, adds their partials in CTA order
    (deterministic), lowers the flags and stores the sum. It only waits on lower-numbered
    CTAs, whose partial is the first thing they store."""
    NUM_ACC: gl.constexpr = acc_tmem.shape[0]
    BLOCK_M: gl.constexpr = acc_tmem.shape[1]
    BLOCK_N: gl.constexpr = acc_tmem.shape[2]
    co_blocks, ci_blocks, tiles, k_steps, per, num_splits = pieces
    pid = gl.program_id(0)
    row_stride = RS * Ci
    acc_use = 0
    for i in range(wgrad_num_pieces(tiles, k_steps, per, num_splits, STREAM)):
        split, t, co_blk, ci_blk, rs, k_from, k_to = wgrad_piece(i, co_blocks, ci_blocks, tiles, k_steps, per, STREAM)
        acc_slot, acc_phase = ring_slot(acc_use, NUM_ACC)
        mbarrier.wait(acc_ready.index(acc_slot), acc_phase)
        acc = acc_tmem.index(acc_slot)
        free = acc_empty.index(acc_slot)
        base = out_ptr + split.to(gl.int64) * Co * row_stride + rs * Ci
        if STREAM:
            if k_to < k_steps:
                slab = ws_ptr + pid.to(gl.int64) * (BLOCK_M * BLOCK_N)
                store_acc_masked(acc, free, slab, 0, BLOCK_M, BLOCK_N, 0, BLOCK_N)
                gl.barrier()
                gl.atomic_store(flags_ptr + pid, 1, sem="release", scope="gpu")
            else:
                first = t * k_steps // per  # the first CTA whose run reaches this tile: pid if none before
                for c in range(first, pid):
                    gl.atomic_poll(flags_ptr + c, 1, sem="acquire", scope="gpu")
                store_acc_masked(
                    acc, free, base, co_blk * BLOCK_M, Co, row_stride, ci_blk * BLOCK_N, Ci, ws_ptr, first, pid
                )
                for c in range(first, pid):
                    gl.atomic_store(flags_ptr + c, 0, sem="relaxed", scope="gpu")
        else:
            store_acc_masked(acc, free, base, co_blk * BLOCK_M, Co, row_stride, ci_blk * BLOCK_N, Ci)
        acc_use += 1


@gluon.jit(do_not_specialize=list(gwg.WGRAD_INTS))
def conv2d_wgrad_kernel(
    g_desc,
    x_desc,
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
    NUM_BUFFERS: gl.constexpr,
    NUM_ACC: gl.constexpr,
    IM2COL: gl.constexpr,
    STREAM: gl.constexpr,
):
    """g_desc: tiles of grad_out as [N*P*Q, Co] ([BLOCK_K, BLOCK_M] blocks); x_desc: im2col over
    x [N, H, W, Ci] (or tiles of x as [N*H*W, Ci]) in [BLOCK_K, BLOCK_N] blocks. The reduction
    is k_steps = cdiv(N*P*Q, BLOCK_K) iterations.
    Split-K (STREAM False): out_ptr grad_w [Co, R*S*Ci] (one split) or the fp32 workspace
    [num_splits, Co, R*S*Ci], `per` k-steps per split; ws_ptr and flags_ptr unused.
    Stream-K: out_ptr grad_w, ws_ptr [CTAs, BLOCK_M, BLOCK_N] fp32, flags_ptr [CTAs] int32 (all
    zero at launch, left so), `per` (tile, k-step) iterations per CTA."""
    BLOCK_M: gl.constexpr = g_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = x_desc.block_type.shape[1]
    rings = pipeline_rings(g_desc, x_desc, NUM_BUFFERS, NUM_ACC, BLOCK_M, BLOCK_N)
    a_bufs, b_bufs, ready, empty, acc_ready, acc_empty, acc_tmem = rings
    co_blocks = gl.cdiv(Co, BLOCK_M)
    ci_blocks = gl.cdiv(Ci, BLOCK_N)
    tiles = co_blocks * ci_blocks * RS
    pieces = (co_blocks, ci_blocks, tiles, k_steps, per, num_splits)
    window = (S, PQ, Q, stride_h, stride_w, pad_h, pad_w)
    # fmt: off
    gl.warp_specialize(
        [
            (_epilogue_partition, (
                out_ptr, ws_ptr, flags_ptr, acc_tmem, acc_ready, acc_empty, pieces, Co, Ci, RS, STREAM,
            )),
            (_mma_partition, (rings, pieces, STREAM)),
            (_load_partition, (g_desc, x_desc, a_bufs, b_bufs, ready, empty, pieces, window, STREAM, IM2COL)),
        ],
        [1, 1],
        [WORKER_REGS, WORKER_REGS],
    )
    # fmt: on
    gdev.invalidate_rings(ready, empty, acc_ready, acc_empty)


@gluon.jit
def _packed_a_load(use, n, k_from, co0, g_desc, a_bufs, ready, done):
    """TMA-load the A tile (grad_out's, or x's in the few-Co kernel) of this split's pixel step
    `use` once the MMA that last read its slot is done (no-op past the split's last step)."""
    NUM_BUFFERS: gl.constexpr = a_bufs.shape[0]
    slot, phase = ring_slot(use, NUM_BUFFERS)
    pred = use < n
    mbarrier.wait(done.index(slot), phase ^ 1, pred=pred)
    mbarrier.expect(ready.index(slot), g_desc.block_type.nbytes, pred)
    row = (k_from + use) * g_desc.block_type.shape[0]
    tma.async_load(g_desc, [row, co0], ready.index(slot), a_bufs.index(slot), pred)


@gluon.jit
def _gathered_mainloop(
    a_desc,
    a_bufs,
    b_bufs,
    ready,
    done,
    acc,
    acc_bar,
    a0,
    k_from,
    n,
    gather,
    FEW_CO: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The packed-taps and few-Co kernels' main loop: A tiles (columns a0...) by TMA through
    the ring, B gathered one pixel step ahead (gluon_wgrad.gathered_b) into the B ring as it
    lies; returns once every MMA into `acc` has completed."""
    NUM_BUFFERS: gl.constexpr = a_bufs.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_bufs.shape[2]
    for i in gl.static_range(NUM_BUFFERS - 1):
        _packed_a_load(i, n, k_from, a0, a_desc, a_bufs, ready, done)
    m0 = k_from * BLOCK_K
    b = gwg.gathered_b(m0, gather, BLOCK_K, BLOCK_N, FEW_CO, num_warps)
    for i in range(n):
        slot, phase = store_gathered(b, b_bufs, done, i)
        m0 += BLOCK_K
        b = gwg.gathered_b(m0, gather, BLOCK_K, BLOCK_N, FEW_CO, num_warps)
        mma_when_loaded(a_bufs, b_bufs, acc, slot, phase, ready, done, i, True, False)
        _packed_a_load(i + NUM_BUFFERS - 1, n, k_from, a0, a_desc, a_bufs, ready, done)
    wait_acc(acc_bar)


@gluon.jit
def _gather_setup(
    a_desc, rows, cols, k_steps, per, ACC_BARS: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr
):
    """The packed-taps and few-Co kernels' set-up: the operand rings (gluon_wgrad.gather_buffers),
    their barriers and the accumulator (gather_rings, ACC_BARS barriers for it), then this CTA's
    (split, tile) of the [rows, cols] output (gluon_wgrad.gather_unit). Returns (a_bufs, b_bufs,
    ready, done, acc_bar, acc, (split, first row, first column, first k-step, k-steps))."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[1]
    a_bufs, b_bufs = gwg.gather_buffers(a_desc, NUM_BUFFERS, NUM_BUFFERS, BLOCK_N)
    ready, done, acc_bar, acc = gather_rings(NUM_BUFFERS, ACC_BARS, BLOCK_M, BLOCK_N)
    return a_bufs, b_bufs, ready, done, acc_bar, acc, gwg.gather_unit(rows, cols, k_steps, per, BLOCK_M, BLOCK_N)


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
    NUM_BUFFERS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Few input channels (gluon_packed_taps.packs_taps), the Hopper packed wgrad's schedule on
    tcgen05: grad_w [Co, K = R*S*Ci packed] in [BLOCK_M, BLOCK_N] tiles, one (split, tile) per
    CTA numbered split-major; grad_out tiles by TMA (g_desc, fed transposed), x's im2col
    gathered one pixel step ahead (gluon_packed_taps.packed_gather) into the B ring as it lies, the
    fp32 accumulator in tensor memory; out_ptr: grad_w [Co, K] with one split, else fp32
    partials [splits, Co, K]."""
    a_bufs, b_bufs, ready, done, acc_bar, acc, unit = _gather_setup(
        g_desc, Co, K, k_steps, per, 2, BLOCK_N, NUM_BUFFERS
    )
    split, co0, n0, k_from, n = unit
    gather = (x_ptr, n0, K, SCi, Ci, H, W, NPQ, PQ, Q, stride_h, stride_w, pad_h, pad_w)
    _gathered_mainloop(g_desc, a_bufs, b_bufs, ready, done, acc, acc_bar, co0, k_from, n, gather, False, num_warps)
    # every split has at least one step (gluon_split_k.split_k_plan)
    store_acc_masked(acc, acc_bar.index(1), out_ptr + split.to(gl.int64) * Co * K, co0, Co, K, n0, K)
    gdev.invalidate_rings(ready, done, acc_bar)


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
    NUM_BUFFERS: gl.constexpr,
    STRIDED: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Few output channels (gluon_wgrad.wgrad_few_co), the Hopper few-Co wgrad's schedule on
    tcgen05: grad_w^T [Ci, R*S*Co] in [BLOCK_M, BLOCK_N] tiles (BLOCK_N spans every tap), one
    (split, Ci block) per CTA numbered split-major; x tiles by TMA (x_desc over [N*H*W, Ci],
    fed transposed, each pixel read once), grad_out gathered one pixel step ahead
    (gluon_wgrad.few_co_gather) into the B ring as it lies, the fp32 accumulator in tensor
    memory; out_ptr: grad_w [Co, R, S, Ci] with one split, else fp32 partials [splits, ...]."""
    # one column block: BLOCK_N spans every tap
    a_bufs, b_bufs, ready, done, acc_bar, acc, unit = _gather_setup(
        x_desc, Ci, BLOCK_N, k_steps, per, 1, BLOCK_N, NUM_BUFFERS
    )
    split, ci0, _, k_from, n = unit
    gather = (g_ptr, Co, RS, S, HW, W, P, Q, stride_h, stride_w, pad_h, pad_w, NHW, STRIDED)
    _gathered_mainloop(x_desc, a_bufs, b_bufs, ready, done, acc, acc_bar, ci0, k_from, n, gather, True, num_warps)
    EPI_N: gl.constexpr = epilogue_width(BLOCK_N)
    slice_layout: gl.constexpr = acc.slice(0, EPI_N).get_reg_layout()
    for j in gl.static_range(BLOCK_N // EPI_N):
        part = acc.slice(j * EPI_N, EPI_N).load(slice_layout)
        gwg.few_co_store(out_ptr, split, part, ci0, j * EPI_N, Co, RS, Ci, num_warps)
    gdev.invalidate_rings(ready, done, acc_bar)


JIT_FUNCTIONS = (
    conv2d_wgrad_kernel,
    conv2d_wgrad_packed_kernel,
    conv2d_wgrad_few_co_kernel,
    sk.split_k_reduce_kernel,
)


# ---- configs ---------------------------------------------------------------------------------


def supports(p: dict, device) -> bool:
    return gbw.on_blackwell(device) and p.get("dtype") in gh.MMA_DTYPES and gh.conv_geometry_ok(p)


def config_space(p: dict, device) -> list[dict]:
    return gbw.space_worth_trying(SPACES[OP], p, device, worth_trying)


def worth_trying(c: dict, p: dict, sms: int) -> bool:
    """The performance rule (config_space() applies it): no channel block wider than the tap's
    channels, no Co block beyond Co; stream-K only with runs that fill the ring; SPLIT_K=0
    only where the work model splits (else the same launch as 1); no explicit count that
    launches as fewer splits (more splits than the reduction has iterations) or as the model's
    own; and no splitting further once the output tiles alone fill every SM twice (only adds
    reduction traffic). Whether it fits the device is resources_ok()'s question."""
    if gwg.runs_few_co(p, c, FEW_CO_NARROWEST):
        # M is Ci; the B tile spans every tap's channels (BLOCK_N)
        return (
            gwg.few_co_split_worth_trying(c, p, sms)
            and c["NUM_BUFFERS"] <= GATHER_MAX_STAGES
            and c["BLOCK_M"] <= max(64, gh.pow2_at_least(p["Ci"]))
        )
    ci = gh.padded_channels(p["Ci"], p["dtype"])
    if gpt.packs_taps(p):
        # the split count follows from the tiles (gluon_wgrad.packed_wgrad_work); a B tile spans
        # packed taps, a whole filter at most
        ci = gpt.packed_k(p)
        if c["SPLIT_K"] != 0 or c["NUM_BUFFERS"] > GATHER_MAX_STAGES:
            return False
    if c["BLOCK_N"] > max(64, gh.pow2_at_least(ci)) or c["BLOCK_M"] > max(64, gh.pow2_at_least(p["Co"])):
        return False
    if gpt.packs_taps(p):
        return True
    w = gwg.WgradWork.of(p, c, sms)
    if w.stream:
        return w.per >= c["NUM_BUFFERS"]
    if c["SPLIT_K"] == 1:
        return True
    model = gwg.WgradWork.of(p, dict(c, SPLIT_K=0), sms).splits
    if c["SPLIT_K"] == 0:
        return model > 1
    if w.splits < c["SPLIT_K"] or w.splits == model:
        return False
    return w.tiles * c["SPLIT_K"] // 2 < 2 * sms


FEW_CO_NARROWEST = min(SPACES[OP].params["BLOCK_N"])  # the few-Co kernel's B tile is at least this wide
# the packed-taps and few-Co kernels ring only the operand TMA reads, paced by the other's gather:
# their rings stop at 4 (the Hopper backend's, at 5, measured)
GATHER_MAX_STAGES = 4


def resources_ok(c: dict, p: dict) -> bool:
    """gluon_blackwell.fits; the epilogue stores from registers (no staging slices)."""
    return gbw.fits(c, gbw.smem_bytes(c, p, staged=False))


def prune(configs: list[dict], p: dict, device) -> list[dict]:
    """Configs that fit the device, the likeliest winners first (gluon_blackwell.likeliest_first)."""
    return likeliest_first([c for c in configs if resources_ok(c, p)])


def default_config(p: dict, device) -> dict:
    """128 x 128 tiles, 4 stages, and the work model's split count (SPLIT_K=0) where it splits."""
    sms = gh.sm_count_of(device)
    c = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "NUM_BUFFERS": 4, "NUM_ACC": 2, "SPLIT_K": 0, "num_warps": 4}
    if gpt.packs_taps(p):
        c.update(BLOCK_M=128 if p["Co"] >= 128 else 64, BLOCK_N=64, NUM_BUFFERS=3)
    elif gwg.few_co_by_default(p):
        c.update(BLOCK_M=128 if p["Ci"] >= 128 else 64, BLOCK_N=gwg.few_co_width(p, FEW_CO_NARROWEST), NUM_BUFFERS=3)
    else:
        if gwg.runs_few_co(p, c, FEW_CO_NARROWEST):
            c["BLOCK_N"] = 64  # 128 is the few-Co kernel's width here
        if not worth_trying(c, p, sms):
            c["SPLIT_K"] = 1
    space = config_space(p, device)
    if c not in space or not resources_ok(c, p):
        fitting = prune(space, p, device)
        c = max(fitting, key=lambda x: (x["BLOCK_M"] * x["BLOCK_N"], x["NUM_BUFFERS"], x["SPLIT_K"] in (0, 1)))
    return c


# ---- host side ---------------------------------------------------------------------------------


def _constexprs(c: dict, im2col: bool) -> dict:
    return {
        "NUM_BUFFERS": c["NUM_BUFFERS"],
        "NUM_ACC": c["NUM_ACC"],
        "IM2COL": im2col,
        "STREAM": c["SPLIT_K"] == gwg.STREAM_K,
    }


def launch(config: dict, x: torch.Tensor, grad_out: torch.Tensor, R: int, S: int, stride=1, padding=0) -> torch.Tensor:
    (sh, sw), (ph, pw) = problems.stride_padding(stride, padding)
    N, H, W, Ci0 = x.shape
    _, P, Q, Co = grad_out.shape
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    few_co = gwg.runs_few_co({"Ci": Ci0, "Co": Co, "R": R, "S": S}, config, FEW_CO_NARROWEST)
    if few_co or gpt.packs_taps({"Ci": Ci0}):
        g = gwg.gather_launch(config, x, grad_out, R, S, (sh, sw), (ph, pw), few_co)
        if few_co:
            kernel, ce = conv2d_wgrad_few_co_kernel, gwg.few_co_constexprs(_packed_constexprs(config), (sh, sw))
        else:
            kernel, ce = conv2d_wgrad_packed_kernel, _packed_constexprs(config)
        kernel[(g.ctas,)](g.desc, g.gathered, g.target(), *g.ints, **ce)
        return g.out if g.ws is None else sk.split_k_reduce(g.ws, g.out)
    xp, gp = gh.pad_channels(x), gh.pad_channels(grad_out)
    Ci = xp.shape[-1]
    npq = N * P * Q
    work = gwg.WgradWork(Co, Ci, R * S, npq, config, gh.num_sms(x.device))
    out = torch.empty((Co, R, S, Ci), device=x.device, dtype=x.dtype)
    if work.stream:
        ws = torch.empty((work.ctas, bm, bn), device=x.device, dtype=torch.float32)
        flags = sk.zeroed_counters(x.device, torch.cuda.current_stream(x.device).cuda_stream, work.ctas)
        ptrs = (out, ws, flags)
    else:
        ws = out if work.splits == 1 else sk.split_k_workspace(work.splits, Co, R * S * Ci, x.device)
        ptrs = (ws, ws, ws)  # ws_ptr and flags_ptr unused
    g_desc = gh.tiled_desc(gp.view(npq, gp.shape[-1]), [bk, bm])
    im2col, x_desc_of = gh.conv_x_desc(R, S, (sh, sw), (ph, pw), (P, Q), [bk, bn])
    x_desc = x_desc_of(xp)
    conv2d_wgrad_kernel[(work.ctas,)](
        g_desc,
        x_desc,
        *ptrs,
        Co,
        Ci,
        R * S,
        S,
        P * Q,
        Q,
        sh,
        sw,
        ph,
        pw,
        work.k_steps,
        work.per,
        work.splits,
        num_warps=config["num_warps"],
        **_constexprs(config, im2col),
    )
    if work.into_partials:
        sk.split_k_reduce(ws, out)
    return out if Ci == Ci0 else out[..., :Ci0].contiguous()


def _packed_constexprs(c: dict) -> dict:
    return {"BLOCK_N": c["BLOCK_N"], "NUM_BUFFERS": c["NUM_BUFFERS"], "num_warps": c["num_warps"]}


def compile_specs(p: dict, config: dict, device) -> list[KernelSpec]:
    kernels = (conv2d_wgrad_kernel, conv2d_wgrad_packed_kernel, conv2d_wgrad_few_co_kernel)
    ce = (_constexprs, _packed_constexprs)
    return gwg.wgrad_specs(kernels, ce, p, config, device, FEW_CO_NARROWEST, c_desc=False)
