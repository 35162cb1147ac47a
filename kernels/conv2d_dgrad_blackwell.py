"""Blackwell (sm_100a) conv2d dgrad in Gluon: grad_x of a convolution in one launch on tcgen05,
every output phase of a strided one included, reading grad_out and w where they lie.

The Hopper dgrad kernel's schedule (conv2d_dgrad_hopper: the phases, the shared im2col walk of
grad_out, w read in place as an N-major operand; geometry in gluon_host) on the persistent,
warp-specialized pipeline of conv2d_fprop_blackwell:
  load partition (1 warp)   per k-step one TMA im2col load of grad_out (a tiled one for a
                            pointwise 1x1) at the phase's tap offset, and one tile
                            [BLOCK_K (Co), BLOCK_N (Ci)] of w viewed [Co, R*S*Ci] at the tap's
                            columns;
  MMA partition (1 warp)    tcgen05 MMAs into a double-buffered fp32 accumulator in tensor
                            memory, as many k-steps as the tile's phase has taps;
  epilogue (num_warps)      stride 1: tensor memory -> shared -> TMA store of grad_x [N*H*W, Ci];
                            otherwise masked stores from registers into the phase's positions
                            of grad_x, each thread's channels one store of up to 16 bytes.
Phases no tap reaches (a filter smaller than its stride) are zeroed by the host.
A stride-1 dgrad whose tiles leave SMs idle splits its k-steps (SPLIT_K 0, the work model's
count: gluon_dgrad.dgrad_splits, the Hopper dgrad's rule) into fp32 partials written from
tensor memory (gluon_blackwell.partial_epilogue) and summed in split order by split_k_reduce.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import mbarrier, tma

from . import KernelSpec, problems
from . import dgrad_phases as dph
from . import gluon_blackwell as gbw
from . import gluon_device as gdev
from . import gluon_dgrad as gdg
from . import gluon_host as gh
from . import gluon_split_k as sk
from .gluon_blackwell import (
    WORKER_REGS,
    epilogue_width,
    free_stage,
    likeliest_first,
    mma_into_next_acc,
    partial_epilogue,
    pipeline_rings,
    ring_slot,
    tma_store_epilogue,
)
from .spaces.blackwell import SPACES

OP, BACKEND, KERNEL, problem, inputs, reference, flops = problems.backend_names("conv2d_dgrad", "blackwell")


# ---- device code ---------------------------------------------------------------------------


@gluon.jit
def _tile(tile_id, tiles_per_phase, num_pid_m, num_pid_n, group_m, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Tile id (phase-major) -> (its phase, first pixel of the phase's walk, first channel)."""
    pid_m, pid_n = gdev.grouped_tile(tile_id % tiles_per_phase, num_pid_m, num_pid_n, group_m)
    return tile_id // tiles_per_phase, pid_m * BLOCK_M, pid_n * BLOCK_N


@gluon.jit
def _work(work_id, tiles, n_phases, PS, R, S, Co, stride_h, stride_w, K_PER, BLOCK_K: gl.constexpr):
    """Work item -> (tile id, phase-major; its first k-step and k-step count). A tile's k-steps
    are its phase's taps times Co's blocks; in the split binary (a stride-1 dgrad: one phase)
    work items are (split, tile) pairs numbered split-major, K_PER k-steps of the tile's each
    (the unsplit binary's K_PER covers every phase's k-steps: one item a tile)."""
    split = work_id // (n_phases * tiles)
    tile_id = work_id - split * (n_phases * tiles)
    phase = tile_id // tiles
    kr0 = phase // PS
    ks0 = phase % PS
    k_total = ((R - kr0 + stride_h - 1) // stride_h) * ((S - ks0 + stride_w - 1) // stride_w) * gl.cdiv(Co, BLOCK_K)
    k_start = split * K_PER
    return tile_id, k_start, gl.minimum(K_PER, k_total - k_start)


@gluon.jit
def _load_partition(
    g_desc,
    w_desc,
    a_bufs,
    b_bufs,
    ready,
    empty,
    walk,
    conv,
    IM2COL: gl.constexpr,
):
    """The loader warp: each work item's (walk = (tile rows, tile columns, work items)) TMA
    loads of grad_out by im2col and w's tiles into the ring; conv: the kernel's integer
    arguments."""
    num_pid_m, num_pid_n, num_work = walk
    _, _, Co, Ciw, R, S, H, W, PQ2, Q2, stride_h, stride_w, pad_h, pad_w, PH, PW, PS, n_phases, group_m, _, K_PER = conv
    BLOCK_M: gl.constexpr = g_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = g_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
    nbytes: gl.constexpr = g_desc.block_type.nbytes + w_desc.block_type.nbytes
    c_blocks = gl.cdiv(Co, BLOCK_K)
    tiles_per_phase = num_pid_m * num_pid_n
    use = 0
    for work_id in range(gl.program_id(0), num_work, gl.num_programs(0)):
        tile_id, k_start, k_count = _work(
            work_id, tiles_per_phase, n_phases, PS, R, S, Co, stride_h, stride_w, K_PER, BLOCK_K
        )
        phase, m0, n0 = _tile(tile_id, tiles_per_phase, num_pid_m, num_pid_n, group_m, BLOCK_M, BLOCK_N)
        kr0, ks0, a, b, kr, ks, ca, cb, rows, cols = dph.gl_dgrad_phase(
            phase, PS, R, S, H, W, stride_h, stride_w, pad_h, pad_w
        )
        img = m0 // PQ2
        pq = m0 % PQ2
        p0 = pq // Q2
        q0 = pq % Q2
        # the first k-step -> its tap (t, u) of the phase and Co block; then stepped, not divided
        tap = k_start // c_blocks
        c0 = (k_start - tap * c_blocks) * BLOCK_K
        t = tap // ks
        u = tap - t * ks
        for _k in range(k_count):
            col = ((kr0 + stride_h * t) * S + ks0 + stride_w * u) * Ciw + n0
            slot, bar = free_stage(use, empty, ready, nbytes)
            if IM2COL:
                offs = [(ca - t + PH).to(gl.int16), (cb - u + PW).to(gl.int16)]
                tma.async_load_im2col(g_desc, [img, p0 - PH, q0 - PW, c0], offs, bar, a_bufs.index(slot))
            else:  # 1x1, stride 1, no padding: grad_out is the GEMM's A as it lies
                tma.async_load(g_desc, [m0, c0], bar, a_bufs.index(slot))
            tma.async_load(w_desc, [c0, col], bar, b_bufs.index(slot))
            c0, t, u, wrapped = gdev.next_conv_k(c0, t, u, Co, kr, ks, BLOCK_K)
            use += 1


@gluon.jit
def _mma_partition(rings, walk, conv):
    """The MMA warp: each work item's k-steps (its phase's taps times Co's blocks, or its split's
    share of them) into the next free accumulator; B is w's own [BLOCK_K, BLOCK_N] tile,
    N-major, fed as it lies. rings: pipeline_rings'; walk, conv: the loader's."""
    num_pid_m, num_pid_n, num_work = walk
    _, _, Co, _, R, S, _, _, _, _, stride_h, stride_w, _, _, _, _, PS, n_phases, _, _, K_PER = conv
    BLOCK_K: gl.constexpr = rings[0].shape[2]
    tiles_per_phase = num_pid_m * num_pid_n
    use = 0
    acc_use = 0
    for work_id in range(gl.program_id(0), num_work, gl.num_programs(0)):
        _, _, k_count = _work(work_id, tiles_per_phase, n_phases, PS, R, S, Co, stride_h, stride_w, K_PER, BLOCK_K)
        use, acc_use = mma_into_next_acc(rings, 0, k_count, use, acc_use, False, False)


@gluon.jit
def _phase_store_epilogue(gx_ptr, acc_tmem, acc_ready, acc_empty, walk, conv, VEC: gl.constexpr):
    """Each tile's accumulator, one slice at a time, from registers to grad_x[img, a + sh * i,
    b + sw * j] for pixel (img, i, j) of the phase's walk. Ci as a multiple of VEC the compiler
    can see (Ci is not specialized): each thread's run of a pixel's channels starts 16-byte
    aligned and its mask is constant over each VEC, so it is one wide store, not one per channel.
    walk, conv: the loader's."""
    num_pid_m, num_pid_n, _ = walk
    M2, Ci, _, _, R, S, H, W, PQ2, Q2, stride_h, stride_w, pad_h, pad_w, _, _, PS, n_phases, group_m, _, _ = conv
    NUM_ACC: gl.constexpr = acc_tmem.shape[0]
    BLOCK_M: gl.constexpr = acc_tmem.shape[1]
    BLOCK_N: gl.constexpr = acc_tmem.shape[2]
    EPI_N: gl.constexpr = epilogue_width(BLOCK_N)
    SLICES: gl.constexpr = BLOCK_N // EPI_N
    slice_layout: gl.constexpr = acc_tmem.index(0).slice(0, EPI_N).get_reg_layout()
    r = gl.arange(0, BLOCK_M, gl.SliceLayout(1, slice_layout))
    c = gl.arange(0, EPI_N, gl.SliceLayout(0, slice_layout))
    ci_vec = (Ci // VEC) * VEC
    tiles_per_phase = num_pid_m * num_pid_n
    acc_use = 0
    for tile_id in range(gl.program_id(0), n_phases * tiles_per_phase, gl.num_programs(0)):
        phase, m0, n0 = _tile(tile_id, tiles_per_phase, num_pid_m, num_pid_n, group_m, BLOCK_M, BLOCK_N)
        _, _, a, b, _, _, _, _, rows, cols = dph.gl_dgrad_phase(phase, PS, R, S, H, W, stride_h, stride_w, pad_h, pad_w)
        m = m0 + r
        img = m // PQ2
        i = (m % PQ2) // Q2
        j = m % Q2
        row_ok = ((m < M2) & (i < rows) & (j < cols))[:, None]
        row_ptrs = gx_ptr + (((img.to(gl.int64) * H + a + stride_h * i) * W + b + stride_w * j) * ci_vec)[:, None]
        acc_slot, acc_phase = ring_slot(acc_use, NUM_ACC)
        mbarrier.wait(acc_ready.index(acc_slot), acc_phase)
        acc = acc_tmem.index(acc_slot)
        for sl in gl.static_range(SLICES):
            part = acc.slice(sl * EPI_N, EPI_N).load(slice_layout)
            if sl == SLICES - 1:
                mbarrier.arrive(acc_empty.index(acc_slot))  # the MMA warp may start the next tile in it
            ci = (n0 + sl * EPI_N + c)[None, :]
            gl.store(row_ptrs + ci, part.to(gx_ptr.dtype.element_ty), mask=row_ok & (ci < ci_vec))
        acc_use += 1


@gluon.jit
def _epilogue(
    y_desc, c_smem, gx_ptr, ws_ptr, acc_tmem, acc_ready, acc_empty, walk, conv,
    VEC: gl.constexpr, TMA_STORE: gl.constexpr, SPLIT: gl.constexpr,
):  # fmt: skip
    """The binary's epilogue: a stride-1 split's fp32 partials into ws, a stride-1 tile by TMA
    store, else each phase's pixels from registers (walk, conv: the loader's)."""
    num_pid_m, num_pid_n, num_work = walk
    M2, Ci, group_m = conv[0], conv[1], conv[18]
    if SPLIT:
        partial_epilogue(ws_ptr, acc_tmem, acc_ready, acc_empty, num_pid_m, num_pid_n, group_m, num_work, M2, Ci)
    elif TMA_STORE:
        tma_store_epilogue(y_desc, c_smem, acc_tmem, acc_ready, acc_empty, num_pid_m, num_pid_n, group_m)
    else:
        _phase_store_epilogue(gx_ptr, acc_tmem, acc_ready, acc_empty, walk, conv, VEC)


@gluon.jit(do_not_specialize=[*gdg.DGRAD_INT_ARGS, "group_m", "SPLITS", "K_PER"])  # one binary for every shape
def conv2d_dgrad_kernel(
    g_desc,
    w_desc,
    y_desc,
    gx_ptr,
    ws_ptr,
    M2,
    Ci,
    Co,
    Ciw,
    R,
    S,
    H,
    W,
    PQ2,
    Q2,
    stride_h,
    stride_w,
    pad_h,
    pad_w,
    PH,
    PW,
    PS,
    n_phases,
    group_m,
    SPLITS,
    K_PER,
    NUM_BUFFERS: gl.constexpr,
    NUM_ACC: gl.constexpr,
    IM2COL: gl.constexpr,
    TMA_STORE: gl.constexpr,
    VEC: gl.constexpr,
    SPLIT: gl.constexpr,
):
    """g_desc: im2col over grad_out [N, P, Q, Co] (the phases' shared stride-1 walk of M2 pixels,
    halo PH x PW) or its tiles as [N*P*Q, Co]; w_desc: tiles of w [Co, R*S*Ciw]; y_desc: grad_x
    as [N*H*W, Ci] in [BLOCK_M, epilogue slice] blocks (TMA_STORE: stride 1), gx_ptr grad_x.
    K_PER: k-steps a work item (at least every phase's, unsplit). SPLIT (a stride-1 dgrad whose
    tiles leave SMs idle): SPLITS work items a tile, whose fp32 partials go to ws_ptr
    [SPLITS, M2, Ci] for split_k_reduce."""
    BLOCK_M: gl.constexpr = g_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
    rings = pipeline_rings(g_desc, w_desc, NUM_BUFFERS, NUM_ACC, BLOCK_M, BLOCK_N)
    a_bufs, b_bufs, ready, empty, acc_ready, acc_empty, acc_tmem = rings
    num_pid_m = gl.cdiv(M2, BLOCK_M)
    num_pid_n = gl.cdiv(Ci, BLOCK_N)
    num_work = n_phases * num_pid_m * num_pid_n
    if SPLIT:
        num_work = num_work * SPLITS
    if TMA_STORE and not SPLIT:  # one phase, whose walk is grad_x's own pixels
        c_smem = gl.allocate_shared_memory(y_desc.dtype, [2] + y_desc.block_type.shape, y_desc.layout)
    else:
        c_smem = a_bufs  # unused: these epilogues store from registers
    walk = (num_pid_m, num_pid_n, num_work)
    # the partitions' arguments written out: Gluon takes each partition's function and arguments
    # as written in the call (a tuple kept in a variable loses its constexpr members); their
    # integers as two values, the walk and the kernel's own (conv)
    # fmt: off
    conv = (
        M2, Ci, Co, Ciw, R, S, H, W, PQ2, Q2, stride_h, stride_w, pad_h, pad_w, PH, PW, PS, n_phases,
        group_m, SPLITS, K_PER,
    )
    gl.warp_specialize(
        [
            (_epilogue, (
                y_desc, c_smem, gx_ptr, ws_ptr, acc_tmem, acc_ready, acc_empty, walk, conv, VEC, TMA_STORE, SPLIT,
            )),
            (_mma_partition, (rings, walk, conv)),
            (_load_partition, (g_desc, w_desc, a_bufs, b_bufs, ready, empty, walk, conv, IM2COL)),
        ],
        [1, 1],
        [WORKER_REGS, WORKER_REGS],
    )
    # fmt: on
    gdev.invalidate_rings(ready, empty, acc_ready, acc_empty)


JIT_FUNCTIONS = (conv2d_dgrad_kernel,)


# ---- configs ---------------------------------------------------------------------------------


def supports(p: dict, device) -> bool:
    return gbw.on_blackwell(device) and p.get("dtype") in gh.MMA_DTYPES and gdg.dgrad_geometry_ok(p)


def config_space(p: dict, device) -> list[dict]:
    return gbw.space_worth_trying(SPACES[OP], p, device, worth_trying)


def worth_trying(c: dict, p: dict, sms: int = 148) -> bool:
    """The performance rule: no tile far larger than the problem. A k-step covers one tap's
    Co channels (grad_out's, padded); N is Ci; M a phase's walk. SPLIT_K 0 only where the work
    model splits (else the same launch as 1)."""
    if c["SPLIT_K"] == 0 and gdg.dgrad_problem_splits(p, c, sms)[0] == 1:
        return False
    co = gh.padded_channels(p["Co"], p["dtype"])
    p2, q2, _, _ = gdg.dgrad_walk(p)
    return (
        c["BLOCK_K"] <= max(32, gh.pow2_at_least(co))
        and c["BLOCK_N"] <= max(32, gh.pow2_at_least(p["Ci"]))
        and c["BLOCK_M"] <= max(64, gh.pow2_at_least(p["N"] * p2 * q2))
    )


def resources_ok(c: dict, p: dict, sms: int = 148) -> bool:
    """gluon_blackwell.fits, of the binary c launches on p: staging slices where the epilogue is
    a TMA store, not in the split binary, whose partials leave from registers."""
    split = gdg.dgrad_problem_splits(p, c, sms)[0] > 1
    return gbw.fits(c, gbw.smem_bytes(c, p, staged=gdg.dgrad_tma_store_ok(p) and not split))


def prune(configs: list[dict], p: dict, device) -> list[dict]:
    """Configs that fit the device, the likeliest winners first (gluon_blackwell.likeliest_first)."""
    sms = gh.sm_count_of(device)
    return likeliest_first([c for c in configs if resources_ok(c, p, sms)], gh.tap_k_step(p["Co"]))


def default_config(p: dict, device) -> dict:
    """128-row tiles (64 for a walk of 64 pixels or fewer) as wide as Ci allows, and the work
    model's split (SPLIT_K 0) where a
    stride-1 dgrad's tiles leave SMs idle (the Hopper dgrad's choice)."""
    sms = gh.sm_count_of(device)
    co = gh.padded_channels(p["Co"], p["dtype"])
    bk = min(64, max(32, gh.pow2_at_least(co)))
    bn = 256 if p["Ci"] >= 256 else 128 if p["Ci"] >= 128 else 64
    p2, q2, _, _ = gdg.dgrad_walk(p)
    bm = 128 if p["N"] * p2 * q2 > 64 else 64
    c = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "NUM_BUFFERS": 4, "NUM_ACC": 2, "GROUP_M": 8, "SPLIT_K": 0}
    c["num_warps"] = 4
    if gdg.dgrad_problem_splits(p, c, sms)[0] == 1:
        c["SPLIT_K"] = 1  # the model does not split: the unsplit config (SPLIT_K 0 is dropped as its twin)
    space = config_space(p, device)
    if c not in space or not resources_ok(c, p, sms):
        fitting = prune(space, p, device)
        c = max(fitting, key=lambda x: (x["BLOCK_M"] * x["BLOCK_N"], x["BLOCK_K"], x["NUM_BUFFERS"]))
    return c


# ---- host side ---------------------------------------------------------------------------------


def _constexprs(c: dict, im2col: bool, tma_store: bool, vec: int, split: bool) -> dict:
    ce = {"NUM_BUFFERS": c["NUM_BUFFERS"], "NUM_ACC": c["NUM_ACC"], "IM2COL": im2col}
    return {**ce, "TMA_STORE": tma_store, "VEC": vec, "SPLIT": split}


def _blocks(c: dict):
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    return [bm, bk], [bk, bn], [bm, gbw.epilogue_n(c)]


def launch(config: dict, grad_out: torch.Tensor, w: torch.Tensor, H: int, W: int, stride=1, padding=0):
    st, pd = problems.stride_padding(stride, padding)
    geo = gdg.DgradGeometry(grad_out.shape, w.shape, H, W, st, pd, w.dtype)
    g, wp = gh.pad_last_dim(grad_out, geo.co), gh.pad_last_dim(w, geo.ciw)
    g_blk, w_blk, y_blk = _blocks(config)
    gx = geo.new_grad_x(g)
    # the pointer epilogue's stand-in keeps the descriptor's type
    y = gx.view(-1, geo.Ci) if geo.tma_store else torch.empty(y_blk, device=g.device, dtype=g.dtype)
    sms = gh.num_sms(g.device)
    tiles = geo.tiles(config["BLOCK_M"], config["BLOCK_N"])
    n_split, per = geo.splits(config, sms)
    split = n_split > 1
    ws = sk.split_k_workspace(n_split, geo.m2, geo.Ci, g.device) if split else sk.no_split_workspace(g.device)
    grid = gh.persistent_grid(tiles * n_split, sms)
    conv2d_dgrad_kernel[grid](
        geo.g_desc(g, g_blk),
        geo.w_desc(wp, w_blk),
        gh.tiled_desc(y, y_blk),
        gx,
        ws,
        *geo.ints,
        config["GROUP_M"],
        n_split,
        per,
        num_warps=config["num_warps"],
        **_constexprs(config, geo.im2col, geo.tma_store, geo.vec, split),
    )
    if split:
        sk.split_k_reduce(ws, gx)
    return gx


def compile_specs(p: dict, config: dict, device) -> list[KernelSpec]:
    return gdg.dgrad_specs(conv2d_dgrad_kernel, p, config, _blocks(config), _constexprs, device)
