"""Hopper (sm_90a) conv2d dgrad in Gluon: grad_x of a convolution in one launch, reading grad_out
and w where they lie and writing grad_x in place.

At stride sh x sw, grad_x's rows a::sh, columns b::sw (one output phase) are reached only by
the filter taps r0::sh, s0::sw: each phase is a stride-1 correlation of grad_out with those
taps, flipped, and channels swapped. The kernel is the persistent implicit GEMM of
conv2d_fprop_hopper over the tiles of every phase at once (phase-major, tiles of a phase in
grouped order), so no multiply-add falls on the zeros a dilated gradient would hold, and:

- A, grad_out: one TMA im2col load per k-step, the same descriptor for every phase (a
  stride-1 walk of ceil(H/sh) x ceil(W/sw) pixels with a halo of PH x PW); a phase's tap
  shifts the load by its own offset, zeros where the window leaves grad_out.
- B, w [Co, R, S, Ci]: tiles [BLOCK_K (Co), BLOCK_N (Ci)] of w viewed [Co, R*S*Ci] at the tap's
  columns, given to WGMMA as an N-major operand: the flip and the transpose are addressing,
  not copies.
- the output, written in place: at stride 1 the walk is grad_x's own pixels, so a TMA store of
  grad_x viewed [N*H*W, Ci] (overlapping the next tile, as conv2d_fprop_hopper's); otherwise
  masked stores through shared memory into the phase's positions, each thread's 8 channels one
  16-byte store (VEC). Phases no tap reaches (a filter smaller than its stride: a strided
  1x1's three of four) are tiles with no k-steps whose epilogue stores zeros (no fill first).
- warp-specialized: a one-warp TMA loader runs ahead of the WGMMA warps through a ring of
  ready/empty mbarriers, into the next tile while they store this one's.
- two CTAs per SM (CTAS_PER_SM 2) where their tiles fit twice: a CTA's epilogue still stalls
  its own WGMMAs; a second CTA's run beside it (a strided layer's tiles have 1-4 taps'
  k-steps, its epilogues ~30% of the time).
- split-K (SPLIT_K 0, the work model's count) where a stride-1 dgrad's tiles leave SMs idle:
  fp32 partials of each split's k-steps, summed by split_k_reduce.
A pointwise 1x1 reads grad_out as the plain [N*P*Q, Co] matrix it is (tiled TMA); tunecache.ops
runs that one as a matmul (geometry.runs_as_matmul), this kernel serves direct calls.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
)

from . import KernelSpec, problems
from . import dgrad_phases as dph
from . import gluon_device as gdev
from . import gluon_dgrad as gdg
from . import gluon_hopper as ghop
from . import gluon_host as gh
from . import gluon_launch as direct
from . import gluon_split_k as sk
from .gluon_hopper import wgmma_acc_layout
from .hardware import HOPPER
from .spaces.hopper import SPACES

OP, BACKEND, KERNEL, problem, inputs, reference, flops = problems.backend_names("conv2d_dgrad", "hopper")
ZERO_PHASES = True  # the epilogue stores the zeros of phases no tap reaches (gluon_dgrad.DgradGeometry)


# ---- device code -------------------------------------------------------------------------------


@gluon.constexpr_function
def store_layout(BLOCK_N, num_warps):
    """Registers for the epilogue's stores: 8 channels (16 bytes) a thread, a warp across as
    much of a pixel's row of channels as the tile has, so each pixel's channels are one
    contiguous write (the WGMMA layout holds 2 channels a thread)."""
    tpw_n = min(32, BLOCK_N // 8)
    return gl.BlockedLayout([1, 8], [32 // tpw_n, tpw_n], [num_warps, 1], [1, 0])


@gluon.jit
def _unit(t, walk, BLOCK_M, BLOCK_N, SPLIT: gl.constexpr):
    """This CTA's t-th work unit of its walk (_grid_walk) -> (its phase, first output pixel of
    the phase's walk, first channel, split): a tile, or with SPLIT a (tile, split) pair, the
    splits of a tile adjacent. Phase-major: phase-minor order gave each CTA a single phase (132
    CTAs, 4 phases), the CTAs of a 4-tap phase four times the work of a 1-tap one's (1.4x
    slower on an H200)."""
    pid, nprog, tiles_per_phase, num_pid_m, num_pid_n, _, conv = walk
    GROUP_M, SPLITS = conv[18], conv[19]
    u = pid + t * nprog
    if SPLIT:
        tile = u // SPLITS
        split = u % SPLITS
    else:
        tile = u
        split = u * 0
    pid_m, pid_n = gdev.grouped_tile(tile % tiles_per_phase, num_pid_m, num_pid_n, GROUP_M)
    return tile // tiles_per_phase, pid_m * BLOCK_M, pid_n * BLOCK_N, split


@gluon.jit
def _k_range(split, kr, ks, c_blocks, K_PER, BLOCK_K: gl.constexpr, SPLIT: gl.constexpr):
    """A unit's k-steps: (count, and the first one's channel block, tap row, tap column). A
    split runs K_PER k-steps of its tile's kr * ks * c_blocks (the last one what is left)."""
    total = kr * ks * c_blocks
    if SPLIT:
        lo = split * K_PER
        cnt = gl.minimum(K_PER, total - lo)
        tap = lo // c_blocks
        c0 = (lo - tap * c_blocks) * BLOCK_K
        t = tap // ks
        return cnt, c0, t, tap - t * ks
    else:
        return total, total * 0, total * 0, total * 0


@gluon.jit
def _unit_phase(t, walk, BLOCK_M, BLOCK_N, BLOCK_K: gl.constexpr, SPLIT: gl.constexpr):
    """This CTA's t-th unit (_unit) with its phase's taps (dgrad_phases.gl_dgrad_phase: first
    taps, tap offsets, tap counts, grad_out corner, rows and columns) and its k-steps (_k_range):
    (phase, m0, n0, split, the phase's 10 values, cnt, c0, tap row, tap column)."""
    _, _, _, _, _, c_blocks, conv = walk
    _, _, _, _, R, S, H, W, _, _, sh, sw, pad_h, pad_w, _, _, PS, _, _, _, K_PER = conv
    phase, m0, n0, split = _unit(t, walk, BLOCK_M, BLOCK_N, SPLIT)
    kr0, ks0, a, b, kr, ks, ca, cb, rows, cols = dph.gl_dgrad_phase(phase, PS, R, S, H, W, sh, sw, pad_h, pad_w)
    cnt, c0, tap, u = _k_range(split, kr, ks, c_blocks, K_PER, BLOCK_K, SPLIT)
    return phase, m0, n0, split, kr0, ks0, a, b, kr, ks, ca, cb, rows, cols, cnt, c0, tap, u


@gluon.jit
def _producer_at(t, walk, BLOCK_M, BLOCK_N, BLOCK_K: gl.constexpr, SPLIT: gl.constexpr):
    """What the loads of this CTA's t-th unit need: (its origin for _issue_load: image, row and
    column of its first pixel, its channel, its phase's first taps and first grad_out offsets;
    the phase's tap counts, its k-steps and the first one's channel block and tap)."""
    PQ2, Q2 = walk[6][8], walk[6][9]
    _, m0, n0, _, kr0, ks0, _, _, kr, ks, ca, cb, _, _, cnt, c0, tap, u = _unit_phase(
        t, walk, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT
    )
    pq = m0 % PQ2
    return (m0 // PQ2, pq // Q2, pq % Q2, n0, kr0, ks0, ca, cb), kr, ks, cnt, c0, tap, u


@gluon.jit
def _grid_walk(conv, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SPLIT: gl.constexpr):
    """The walk both partitions take, unit by unit in the same order, over the conv geometry
    `conv` (the kernel's integer arguments, gluon_dgrad.DGRAD_INT_ARGS, GROUP_M, SPLITS, K_PER):
    (this CTA's units, the walk _unit reads: this CTA, the CTAs, tiles per phase, a phase's tile
    rows and columns, Co's channel blocks, conv)."""
    M2, Ci, Co = conv[0], conv[1], conv[2]
    n_phases, SPLITS = conv[17], conv[19]
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_pid_m = gl.cdiv(M2, BLOCK_M)
    num_pid_n = gl.cdiv(Ci, BLOCK_N)
    tiles_per_phase = num_pid_m * num_pid_n
    units = n_phases * tiles_per_phase
    if SPLIT:
        units = units * SPLITS
    my_units = gl.cdiv(units - pid, nprog)
    return my_units, (pid, nprog, tiles_per_phase, num_pid_m, num_pid_n, gl.cdiv(Co, BLOCK_K), conv)


@gluon.jit
def _issue_load(slot, origin, c0, t, u, conv, g_desc, w_desc, a_bufs, b_bufs, ready, IM2COL: gl.constexpr):
    """TMA-load one k-step (the phase's tap (t, u), Co channels c0...) of the unit at `origin`
    (_producer_at: output pixel (img, p0, q0), grad_x channels n0...) into ring slot `slot`."""
    img, p0, q0, n0, kr0, ks0, ca, cb = origin
    _, _, _, Ciw, _, S, _, _, PQ2, Q2, stride_h, stride_w, _, _, PH, PW, _, _, _, _, _ = conv
    bar = ready.index(slot)
    mbarrier.expect(bar, g_desc.block_type.nbytes + w_desc.block_type.nbytes)
    if IM2COL:
        offs = [(ca - t + PH).to(gl.int16), (cb - u + PW).to(gl.int16)]
        tma.async_load_im2col(g_desc, [img, p0 - PH, q0 - PW, c0], offs, bar, a_bufs.index(slot))
    else:  # 1x1, stride 1, no padding: grad_out is the GEMM's A as it lies, [N*P*Q, Co]
        tma.async_load(g_desc, [(img * PQ2 + p0 * Q2 + q0), c0], bar, a_bufs.index(slot))
    col = ((kr0 + stride_h * t) * S + ks0 + stride_w * u) * Ciw + n0
    tma.async_load(w_desc, [c0, col], bar, b_bufs.index(slot))


@gluon.jit
def _load_partition(
    g_desc,
    w_desc,
    a_bufs,
    b_bufs,
    ready,
    empty,
    conv,
    IM2COL: gl.constexpr,
    SPLIT: gl.constexpr,
):
    """The loader warp: TMA loads of every k-step of this CTA's units into the ring, each slot
    as soon as the WGMMA warps release it; it runs ahead into the next unit while they store
    this one's tile. A unit of a phase no tap reaches loads nothing."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_M: gl.constexpr = g_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = g_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
    Co = conv[2]
    my_tiles, walk = _grid_walk(conv, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT)
    use = 0
    for t in range(my_tiles):
        origin, kr, ks, cnt, c0, tap, u = _producer_at(t, walk, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT)
        for _k in range(cnt):
            slot = use % STAGES
            mbarrier.wait(empty.index(slot), ((use // STAGES) & 1) ^ 1)
            _issue_load(slot, origin, c0, tap, u, conv, g_desc, w_desc, a_bufs, b_bufs, ready, IM2COL)
            c0, tap, u, wrapped = gdev.next_conv_k(c0, tap, u, Co, kr, ks, BLOCK_K)
            use += 1


@gluon.jit
def _mma_partition(
    a_bufs,
    b_bufs,
    c_smem,
    y_desc,
    ready,
    empty,
    gx_ptr,
    ws_ptr,
    conv,
    TMA_STORE: gl.constexpr,
    VEC: gl.constexpr,
    SPLIT: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The WGMMA warps: one WGMMA in flight, each ring slot released once the WGMMA that read it
    has retired, then the unit's epilogue (see conv2d_dgrad_kernel)."""
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.shape[2]
    dtype: gl.constexpr = a_bufs.dtype
    M2, Ci, _, _, _, _, H, W, PQ2, Q2, stride_h, stride_w, _, _, _, _, _, _, _, _, _ = conv
    my_tiles, walk = _grid_walk(conv, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT)

    acc_layout: gl.constexpr = wgmma_acc_layout(BLOCK_M, BLOCK_N, num_warps)
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
    out_layout: gl.constexpr = store_layout(BLOCK_N, num_warps)
    rows0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out_layout))
    cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out_layout))

    use = 0
    for t in range(my_tiles):
        _, m0, n0, split, _, _, a, b, _, _, _, _, rows, cols, cnt, _, _, _ = _unit_phase(
            t, walk, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT
        )
        acc, use = ghop.wgmma_steps(a_bufs, b_bufs, ready, empty, acc, cnt, use, False, False)
        # pixel m of the phase's walk -> grad_x[img, a + sh * pi, b + sw * pj]
        m = m0 + rows0
        img = m // PQ2
        pi = (m % PQ2) // Q2
        pj = m % Q2
        row_ok = (m < M2) & (pi < rows) & (pj < cols)
        # Ci as a multiple of VEC the compiler can see (Ci is not specialized): pixel rows start
        # 16-byte aligned and the channel mask is constant over each VEC, so a thread's 8
        # channels are one 16-byte store, not 8 of 2 bytes
        ci_vec = (Ci // VEC) * VEC
        base = ((img.to(gl.int64) * H + a + stride_h * pi) * W + b + stride_w * pj) * ci_vec
        ci = n0 + cols0
        mask = row_ok[:, None] & (ci < ci_vec)[None, :]
        if SPLIT:  # stride 1: the walk is grad_x's pixels; the partial goes to ws[split] [M2, Ci]
            pr = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
            pc = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
            offs = (split.to(gl.int64) * M2 + pr.to(gl.int64))[:, None] * Ci + pc[None, :]
            gl.store(ws_ptr + offs, acc, mask=(pr < M2)[:, None] & (pc < Ci)[None, :])
        elif TMA_STORE:  # one phase whose walk is grad_x's own pixels: y_desc tiles grad_x [M2, Ci]
            tma.store_wait(pendings=0)
            c_smem.store(acc.to(dtype))
            fence_async_shared()
            tma.async_store(y_desc, [m0, n0], c_smem)
        elif cnt == 0:  # a phase no tap reaches (a filter smaller than its stride): zeros
            gl.store(gx_ptr + base[:, None] + ci[None, :], gl.zeros([BLOCK_M, BLOCK_N], dtype, out_layout), mask=mask)
        else:
            gl.barrier()  # every thread is done reading the last tile's
            c_smem.store(acc.to(dtype))
            gl.barrier()
            gl.store(gx_ptr + base[:, None] + ci[None, :], c_smem.load(out_layout), mask=mask)
    tma.store_wait(pendings=0)


@gluon.jit(do_not_specialize=[*gdg.DGRAD_INT_ARGS, "GROUP_M", "SPLITS", "K_PER"])  # one binary for every shape
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
    GROUP_M,
    SPLITS,
    K_PER,
    STAGES: gl.constexpr,
    IM2COL: gl.constexpr,
    TMA_STORE: gl.constexpr,
    VEC: gl.constexpr,
    SPLIT: gl.constexpr,
    num_warps: gl.constexpr,
):
    """g_desc: im2col over grad_out [N, P, Q, Co] (a stride-1 walk of M2 = N * PQ2 pixels, PQ2 =
    ceil(H/sh) * Q2, halo PH x PW); w_desc: tiles of w [Co, R*S*Ciw]; gx_ptr: grad_x [N, H, W, Ci].
    SPLIT (stride 1, one phase, whose walk is grad_x's pixels): ws_ptr [SPLITS, M2, Ci] fp32
    receives each split's partial (K_PER k-steps of the tile's), summed by split_k_reduce; the
    unsplit binary is the kernel without split-K.

    Warp-specialized: a one-warp TMA loader and the WGMMA warps talk through ready/empty
    mbarrier rings, so the loader fills the next unit's slots while the WGMMA warps run this
    one's epilogue (a strided layer's tiles have 1-4 taps' k-steps: its epilogues are a large
    share of the time)."""
    a_bufs, b_bufs, c_smem, ready, empty = ghop.specialized_rings(g_desc, w_desc, y_desc, STAGES)
    # fmt: off
    conv = (
        M2, Ci, Co, Ciw, R, S, H, W, PQ2, Q2, stride_h, stride_w, pad_h, pad_w, PH, PW, PS, n_phases,
        GROUP_M, SPLITS, K_PER,
    )
    gl.warp_specialize(
        [
            (_mma_partition, (
                a_bufs, b_bufs, c_smem, y_desc, ready, empty, gx_ptr, ws_ptr, conv, TMA_STORE, VEC, SPLIT, num_warps,
            )),
            (_load_partition, (g_desc, w_desc, a_bufs, b_bufs, ready, empty, conv, IM2COL, SPLIT)),
        ],
        [1])
    # fmt: on
    gdev.invalidate_rings(ready, empty)


JIT_FUNCTIONS = (conv2d_dgrad_kernel, sk.split_k_reduce_kernel)


# ---- configs -------------------------------------------------------------------------------------


def supports(p: dict, device) -> bool:
    return device.capability == (9, 0) and p.get("dtype") in gh.MMA_DTYPES and gdg.dgrad_geometry_ok(p)


def config_space(p: dict, device) -> list[dict]:
    """The space, less configs that would run but cannot help on this problem. Resource limits
    are left to prune(), which must agree with the compiler."""
    sms = gh.sm_count_of(device)
    return [c for c in SPACES[OP] if not resources_ok(c, p, sms) or worth_trying(c, p, sms)]


def resources_ok(c: dict, p: dict | None = None, sms: int | None = None) -> bool:
    """The resource rule (prune() applies it; it must agree with the compiler) for the binary c
    launches on p (split or not)."""
    split = p is not None and sms is not None and gdg.dgrad_problem_splits(p, c, sms)[0] > 1
    return ghop.wgmma_resources_ok(c, smem_bytes(c, tile=not split))


def smem_bytes(c: dict, itemsize: int = 2, tile: bool = True) -> int:
    """The ring, its barriers and the epilogue's tile (`tile`; the split binary's fp32 partials
    leave from registers)."""
    ring = c["num_stages"] * ((c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * itemsize + 16)
    return ring + c["BLOCK_M"] * c["BLOCK_N"] * itemsize * tile


def _as_fprop(p: dict) -> dict:
    """The problem as the GEMM each phase is: Co channels reduced, Ci produced."""
    p2, q2, _, _ = gdg.dgrad_walk(p)
    return {**p, "Ci": p["Co"], "Co": p["Ci"], "gemm_M": p["N"] * p2 * q2}


def ctas_per_sm(c: dict) -> int:
    return c.get("CTAS_PER_SM", 1)


def _two_fit(c: dict) -> bool:
    """Two CTAs fit one SM: twice the shared memory (and the 1 KB each CTA reserves) within an
    SM's 228 KB, and registers for twice the threads: a warp-specialized CTA is its WGMMA warps
    and a loader warpgroup, 256 threads at num_warps 4, 128 registers each (launch_options),
    which hold an accumulator of up to 64 values a thread; at num_warps 8 (384 threads) two
    CTAs would leave 85 registers a thread."""
    acc = ghop.accumulator_per_thread(c)
    return (
        2 * (smem_bytes(c) + HOPPER.smem_reserved_per_block) <= HOPPER.smem_per_sm and c["num_warps"] == 4 and acc <= 64
    )


def launch_options(c: dict) -> dict:
    """Triton launch options of config c (gluon_hopper.warp_specialized_options): where two CTAs
    fit an SM (_two_fit), 128 registers a thread (ptxas took 149 for a 128x64 tile: one CTA's
    worth); a CTAS_PER_SM 2 config that does not fit (worth_trying never proposes one) launches
    as compiled for one CTA."""
    return ghop.warp_specialized_options(c["num_warps"], 2 if ctas_per_sm(c) == 2 and _two_fit(c) else 1)


def worth_trying(c: dict, p: dict, sms: int = 132) -> bool:
    """The performance rule (config_space() applies it): could this config win on this problem?"""
    if c["num_warps"] == 8 and c["BLOCK_M"] == 64 and c["BLOCK_N"] < 128:
        return False  # two warpgroups on a 64-row tile split N: below 128 columns each gets a sliver
    if ctas_per_sm(c) == 2 and not (_two_fit(c) and _tiles(p, c) > sms):
        return False  # the second CTA would wait for the first, or the grid is the one-CTA launch
    if c.get("SPLIT_K", 1) == 0 and gdg.dgrad_problem_splits(p, c, sms)[0] == 1:
        return False  # the model does not split: the unsplit launch
    g = _as_fprop(p)
    if c["BLOCK_K"] > max(16, gh.pow2_at_least(gh.padded_channels(g["Ci"], p["dtype"]))):
        return False  # a k-step covers one tap: more channels than grad_out has are zeros
    if c["BLOCK_N"] == 32 and p["Ci"] > 32 and p["Ci"] % 64 == 0:
        return False  # 64 columns divide Ci: the narrow tile only halves each MMA
    return c["BLOCK_N"] <= max(64, gh.pow2_at_least(g["Co"])) and c["BLOCK_M"] <= max(64, gh.pow2_at_least(g["gemm_M"]))


def _tiles(p: dict, c: dict) -> int:
    p2, q2, _, _ = gdg.dgrad_walk(p)
    phases = gdg.dgrad_phases(p, ZERO_PHASES)  # the tiles the launch's grid walks (DgradGeometry.tiles)
    return phases * gh.cdiv(p["N"] * p2 * q2, c["BLOCK_M"]) * gh.cdiv(p["Ci"], c["BLOCK_N"])


def prune(configs: list[dict], p: dict, device) -> list[dict]:
    """Configs that fit the device, the likeliest winners first (the forward conv's order)."""
    kept = [c for c in configs if resources_ok(c, p, gh.sm_count_of(device))]
    return ghop.quick_first("conv2d_fprop", kept, _as_fprop(p), gh.sm_count_of(device))


def default_config(p: dict, device) -> dict:
    bk = min(64, max(16, gh.pow2_at_least(gh.padded_channels(p["Co"], p["dtype"]))))
    one = {"GROUP_M": 8, "CTAS_PER_SM": 1, "SPLIT_K": 0}
    if p["Ci"] >= 256:
        c = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": bk, **one, "num_warps": 8, "num_stages": 3}
    elif p["Ci"] >= 128:
        c = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": bk, **one, "num_warps": 8, "num_stages": 4}
    else:
        c = {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": bk, **one, "num_warps": 4, "num_stages": 4}
    if not (resources_ok(c, p, gh.sm_count_of(device)) and worth_trying(c, p, gh.sm_count_of(device))):
        fitting = prune(config_space(p, device), p, device)
        if fitting:
            c = max(fitting, key=lambda x: (x["BLOCK_M"] * x["BLOCK_N"], x["BLOCK_K"], x["num_stages"]))
    return c


# ---- host side -----------------------------------------------------------------------------------


def _constexprs(c: dict, im2col: bool, tma_store: bool, vec: int, split: bool) -> dict:
    return {
        "STAGES": c["num_stages"],
        "IM2COL": im2col,
        "TMA_STORE": tma_store,
        "VEC": vec,
        "SPLIT": split,
        "num_warps": c["num_warps"],
    }


class _Plan:
    """One (config, shapes, strides, dtype, stride, padding, device) launch, precomputed: see
    gluon_launch.DirectLauncher."""

    __slots__ = ("launcher", "maps", "grid0", "tail", "g_desc", "w_desc", "y_desc", "geo", "reduce", "idle")

    def run(self, grad_out: torch.Tensor, w: torch.Tensor, stream: int) -> torch.Tensor:
        geo = self.geo
        g, wp = gh.pad_last_dim(grad_out, geo.co), gh.pad_last_dim(w, geo.ciw)
        gx = geo.new_grad_x(g)
        pg, pw = g.data_ptr(), wp.data_ptr()
        maps, ld = self.maps, self.launcher
        gm = maps.get((0, pg)) or maps.put((0, pg), ld.expand_desc(0, self.g_desc(g)))
        wm = maps.get((1, pw)) or maps.put((1, pw), ld.expand_desc(1, self.w_desc(wp)))
        py = gx.data_ptr()
        ym = maps.get((2, py)) or maps.put((2, py), ld.expand_desc(2, self.y_desc(gx)))
        if self.reduce is None:
            ld(self.grid0, stream, [*gm, *wm, *ym, py, self.idle, *self.tail])
        else:
            ws = self.reduce.workspace(g, stream)
            ld(self.grid0, stream, [*gm, *wm, *ym, py, ws.data_ptr(), *self.tail])
            self.reduce(stream, ws, gx)
        return gx


_PLANS = direct.PlanCache()


def _plan_key(dev: int, config: dict, g: torch.Tensor, w: torch.Tensor, H: int, W: int, stride=1, padding=0):
    st, pd = direct.int_pair_key(stride), direct.int_pair_key(padding)
    if st is None or pd is None:
        return None
    return (direct.config_key(config), g.shape, g.stride(), w.shape, w.stride(), g.dtype, w.dtype, H, W, st, pd, dev)


def plan_for(config: dict, *args):
    """(plan, device) of a call whose first launch made one, else None: gluon_launch.plan_for."""
    return direct.plan_for(_PLANS, _plan_key, config, args)


def launch(config: dict, grad_out: torch.Tensor, w: torch.Tensor, H: int, W: int, stride=1, padding=0):
    key = None
    if direct.direct_launch_enabled():
        key, plan, _, stream = direct.look_up(_PLANS, _plan_key, config, (grad_out, w, H, W, stride, padding))
        if plan is not None:
            return plan.run(grad_out, w, stream)
    return _launch_jit(config, grad_out, w, H, W, stride, padding, key)


def _launch_jit(config: dict, grad_out: torch.Tensor, w: torch.Tensor, H: int, W: int, stride, padding, key):
    st, pd = problems.stride_padding(stride, padding)
    geo = gdg.DgradGeometry(grad_out.shape, w.shape, H, W, st, pd, w.dtype, zero_phases=ZERO_PHASES)
    g, wp = gh.pad_last_dim(grad_out, geo.co), gh.pad_last_dim(w, geo.ciw)
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    dummy = None if geo.tma_store else torch.empty((bm, bn), device=w.device, dtype=w.dtype)

    def g_desc_of(t):
        return geo.g_desc(t, [bm, bk])

    def w_desc_of(t):
        return geo.w_desc(t, [bk, bn])

    def y_desc_of(t):  # the pointer epilogue's stand-in keeps the descriptor's type
        return gh.tiled_desc(t.view(-1, geo.Ci) if geo.tma_store else dummy, [bm, bn])

    gx = geo.new_grad_x(g)
    sms = gh.num_sms(g.device)
    tiles = geo.tiles(bm, bn)
    n_split, per = geo.splits(config, sms)
    split = n_split > 1
    grid = gh.persistent_grid(tiles * n_split, sms, ctas_per_sm(config))
    ce = _constexprs(config, geo.im2col, geo.tma_store, geo.vec, split)
    scalars = geo.ints + (config["GROUP_M"], n_split, per)
    ws = g.new_empty((n_split, geo.m2, geo.Ci), dtype=torch.float32) if split else sk.no_split_workspace(g.device)
    args = (g_desc_of(g), w_desc_of(wp), y_desc_of(gx), gx, ws, *scalars)
    compiled = conv2d_dgrad_kernel[grid](*args, **ce, **launch_options(config))
    reduce = (sk.split_k_reduce_jit(ws, gx), ws, gx) if split else None
    plan = direct.new_plan(_Plan, key, compiled, conv2d_dgrad_kernel, 5, scalars, ce, grid[0], reduce)
    if plan is not None:
        plan.g_desc, plan.w_desc, plan.y_desc, plan.geo = g_desc_of, w_desc_of, y_desc_of, geo
        plan.idle = sk.no_split_workspace(grad_out.device).data_ptr()  # the unsplit binary's workspace
        _PLANS.put(key, plan)
    return gx


def compile_specs(p: dict, config: dict, device) -> list[KernelSpec]:
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    blocks = [bm, bk], [bk, bn], [bm, bn]
    return gdg.dgrad_specs(conv2d_dgrad_kernel, p, config, blocks, _constexprs, device, launch_options(config))
