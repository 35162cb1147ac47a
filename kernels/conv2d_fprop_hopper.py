"""Hopper (sm_90a) conv2d forward in Gluon: implicit GEMM on TMA im2col and async WGMMA.

y[N*P*Q, Co] = im2col(x)[N*P*Q, R*S*Ci] @ w[Co, R*S*Ci]^T, NHWC, fp16 or bf16, per-axis
stride and padding.

The activation tile of each k-step is one TMA im2col load: BLOCK_M consecutive output pixels
(TMA wraps rows and images itself) times BLOCK_K channels of one filter tap (r, s), zeros
where the window overhangs the padding. The weight tile is a plain tiled load of
w viewed as [Co, R*S*Ci]. The pipeline is the persistent one of matmul_hopper: a ring of
`num_stages` slots running ahead across tile boundaries, one WGMMA in flight, the epilogue's
TMA store overlapped with the next tile; warp-specialized, a one-warp TMA loader feeding the
WGMMA warps through ready/empty mbarriers (H100 model suite 1.035 -> 1.047x cuDNN). Channel
counts that break TMA's 16-byte stride rule are zero-padded on the host. Where the tiles leave
SMs idle (batch 1, few output channels), SPLIT_K 0 splits each tile's k-steps the work model's
number of ways (gluon_split_k.modeled_splits) into fp32 partials summed by split_k_reduce.
"""

from __future__ import annotations

import torch
import triton
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
from .geometry import is_pointwise  # noqa: F401 (its specs pick their kernel by it: in the version)
from .gluon_hopper import wgmma_acc_layout
from .spaces.hopper import SPACES

OP, BACKEND, KERNEL, problem, inputs, reference, flops = problems.backend_names("conv2d_fprop", "hopper")


# ---- device code -------------------------------------------------------------------------------


@gluon.jit
def _unit_origin(t, walk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SPLIT: gl.constexpr):
    """This CTA's t-th work unit (a tile, or with SPLIT a (tile, split) pair, a tile's splits
    adjacent) of its walk (_grid_walk) -> (first output pixel, first output channel, the
    pixel's window corner in the input: image, row, column; the unit's k-steps, the first one's
    channel block and tap (r, s); its split). Divisions: once per unit, not per k-step."""
    pid, nprog, num_pid_m, num_pid_n, ci_blocks, k_tiles, conv = walk
    _, _, _, _, S, PQ, Q, stride_h, stride_w, pad_h, pad_w, GROUP_M, SPLITS, K_PER = conv
    u = pid + t * nprog
    if SPLIT:
        tile = u // SPLITS
        split = u % SPLITS
        lo = split * K_PER
        cnt = gl.minimum(K_PER, k_tiles - lo)
        tap = lo // ci_blocks
        c0 = (lo - tap * ci_blocks) * BLOCK_K
        r = tap // S
        s = tap - r * S
    else:
        tile = u
        split = u * 0
        cnt = k_tiles + u * 0
        c0 = split
        r = split
        s = split
    pid_m, pid_n = gdev.grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
    m0 = pid_m * BLOCK_M
    pq = m0 % PQ
    h0 = (pq // Q) * stride_h - pad_h
    return m0, pid_n * BLOCK_N, m0 // PQ, h0, (pq % Q) * stride_w - pad_w, cnt, c0, r, s, split


@gluon.jit
def _grid_walk(conv, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SPLIT: gl.constexpr):
    """The walk both partitions take, unit by unit in the same order, over the conv geometry
    `conv` = (M, Co, Ci, R, S, PQ, Q, stride_h, stride_w, pad_h, pad_w, GROUP_M, SPLITS, K_PER)
    (the kernel's integer arguments): (this CTA's units, the walk _unit_origin reads: this CTA,
    the CTAs, tile rows and columns, channel blocks, k-steps of a tile, conv)."""
    M, Co, Ci, R, S, _, _, _, _, _, _, _, SPLITS, _ = conv
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(Co, BLOCK_N)
    units = num_pid_m * num_pid_n
    if SPLIT:
        units = units * SPLITS
    my_units = gl.cdiv(units - pid, nprog)
    ci_blocks = gl.cdiv(Ci, BLOCK_K)
    return my_units, (pid, nprog, num_pid_m, num_pid_n, ci_blocks, R * S * ci_blocks, conv)


@gluon.jit
def _issue_load(
    slot, m0, n0, img, h0, w0, c0, r, s, Ci, S, x_desc, w_desc, a_bufs, b_bufs, ready, IM2COL: gl.constexpr
):
    """TMA-load one k-step (filter tap (r, s), channels c0...) of the tile at (m0, n0) into ring
    slot `slot`."""
    bar = ready.index(slot)
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
    if IM2COL:
        tma.async_load_im2col(x_desc, [img, h0, w0, c0], [r.to(gl.int16), s.to(gl.int16)], bar, a_bufs.index(slot))
    else:  # 1x1, stride 1, no padding: x is the GEMM's A as it lies, [N*H*W, Ci]
        tma.async_load(x_desc, [m0, c0], bar, a_bufs.index(slot))
    tma.async_load(w_desc, [n0, (r * S + s) * Ci + c0], bar, b_bufs.index(slot))


@gluon.jit
def _load_partition(
    x_desc,
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
    this one's tile."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    _, _, Ci, R, S, _, _, _, _, _, _, _, _, _ = conv
    my_units, walk = _grid_walk(conv, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT)
    use = 0
    for t in range(my_units):
        m0, n0, img, h0, w0, cnt, c0, r, s, split = _unit_origin(t, walk, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT)
        for _k in range(cnt):
            slot = use % STAGES
            mbarrier.wait(empty.index(slot), ((use // STAGES) & 1) ^ 1)
            _issue_load(slot, m0, n0, img, h0, w0, c0, r, s, Ci, S, x_desc, w_desc, a_bufs, b_bufs, ready, IM2COL)
            c0, r, s, wrapped = gdev.next_conv_k(c0, r, s, Ci, R, S, BLOCK_K)
            use += 1


@gluon.jit
def _mma_partition(
    a_bufs,
    b_bufs,
    c_smem,
    y_desc,
    ready,
    empty,
    ws_ptr,
    conv,
    LDW,
    SPLIT: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The WGMMA warps: one WGMMA in flight, each ring slot released once the WGMMA that read it
    has retired, then the unit's epilogue: a TMA store overlapping the next unit, or with SPLIT
    the fp32 partial."""
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.shape[1]
    dtype: gl.constexpr = a_bufs.dtype
    M = conv[0]
    my_units, walk = _grid_walk(conv, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT)
    acc_layout: gl.constexpr = wgmma_acc_layout(BLOCK_M, BLOCK_N, num_warps)
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
    use = 0
    for t in range(my_units):
        m0, n0, img, h0, w0, cnt, c0, r, s, split = _unit_origin(t, walk, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT)
        acc, use = ghop.wgmma_steps(a_bufs, b_bufs, ready, empty, acc, cnt, use, False, True)
        if SPLIT:
            rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
            cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
            offs = (split.to(gl.int64) * M + rows.to(gl.int64))[:, None] * LDW + cols[None, :]
            gl.store(ws_ptr + offs, acc, mask=(rows < M)[:, None] & (cols < LDW)[None, :])
        else:
            out = acc.to(dtype)
            tma.store_wait(pendings=0)
            c_smem.store(out)
            fence_async_shared()
            tma.async_store(y_desc, [m0, n0], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit(
    do_not_specialize=[
        *("GROUP_M", "M", "Co", "Ci", "R", "S", "PQ", "Q", "stride_h", "stride_w", "pad_h", "pad_w"),
        *("SPLITS", "K_PER", "LDW"),
    ]
)
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
    GROUP_M,
    SPLITS,
    K_PER,
    LDW,
    STAGES: gl.constexpr,
    IM2COL: gl.constexpr,
    SPLIT: gl.constexpr,
    num_warps: gl.constexpr,
):
    """x_desc: im2col over x [N, H, W, Ci] (IM2COL) or tiles of x as [N*H*W, Ci] (a 1x1, stride-1,
    unpadded conv, where TMA's plain tiled mode is the cheaper way to the same tile);
    w_desc: tiles of w [Co, R*S*Ci]; y_desc: y [M, Co]. SPLIT (the tiles leave SMs idle: batch 1,
    few output channels): ws_ptr [SPLITS, M, LDW] fp32 (LDW: y's row, Co padded) receives each split's partial
    (K_PER k-steps of the tile's), summed by split_k_reduce; the unsplit binary is the kernel
    without split-K.

    Warp-specialized (the wgrad's and the dgrad's pipeline): a one-warp TMA loader and the
    WGMMA warps talk through ready/empty mbarrier rings."""
    a_bufs, b_bufs, c_smem, ready, empty = ghop.specialized_rings(x_desc, w_desc, y_desc, STAGES)
    conv = (M, Co, Ci, R, S, PQ, Q, stride_h, stride_w, pad_h, pad_w, GROUP_M, SPLITS, K_PER)
    # fmt: off
    gl.warp_specialize(
        [
            (_mma_partition, (a_bufs, b_bufs, c_smem, y_desc, ready, empty, ws_ptr, conv, LDW, SPLIT, num_warps)),
            (_load_partition, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, conv, IM2COL, SPLIT)),
        ],
        [1])
    # fmt: on
    gdev.invalidate_rings(ready, empty)


@gluon.jit
def _packed_b_load(step, k_tiles, n0, w_desc, b_bufs, ready, STAGES: gl.constexpr):
    """TMA-load k-step `step`'s tile of the packed weights (no-op past the tile's k-loop)."""
    pred = step < k_tiles
    slot = step % STAGES
    mbarrier.expect(ready.index(slot), w_desc.block_type.nbytes, pred)
    tma.async_load(w_desc, [n0, step * w_desc.block_type.shape[1]], ready.index(slot), b_bufs.index(slot), pred)


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
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Few input channels (gluon_packed_taps.packs_taps): K = R*S*Ci packed, one output tile per CTA.
    x_ptr: x [N, H, W, Ci], gathered (gluon_packed_taps.packed_gather) one k-step ahead in registers
    and stored to shared memory for the WGMMA; w_desc: tiles of the packed weights [Co, K]
    (gluon_packed_taps.packed_weights) in a ring of STAGES; y_desc: y [M, Co]. Not persistent: the
    gather waits on memory, and several CTAs per SM hide that where one cannot."""
    BLOCK_M: gl.constexpr = y_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = y_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    dtype: gl.constexpr = y_desc.dtype
    g_layout: gl.constexpr = gpt.packed_gather_layout(BLOCK_K, num_warps)

    a_bufs, b_bufs = gpt.packed_fprop_rings(w_desc, BLOCK_M, STAGES)
    c_smem = gl.allocate_shared_memory(dtype, y_desc.block_type.shape, y_desc.layout)
    ready = gdev.barrier_ring(STAGES)

    m0, n0, k_tiles = gpt.packed_fprop_tile(M, Co, K, GROUP_M, BLOCK_M, BLOCK_N, BLOCK_K)
    for i in gl.static_range(STAGES - 1):
        _packed_b_load(i, k_tiles, n0, w_desc, b_bufs, ready, STAGES)

    base, h0, w0 = gpt.packed_rows(m0, M, PQ, Q, H, W, Ci, stride_h, stride_w, pad_h, pad_w, BLOCK_M, g_layout)
    a = gpt.packed_gather(x_ptr, base, h0, w0, 0, K, SCi, Ci, H, W, BLOCK_K, g_layout)
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=wgmma_acc_layout(BLOCK_M, BLOCK_N, num_warps))
    for kk in range(k_tiles):
        slot = kk % STAGES
        # the WGMMA that last read this slot (kk - STAGES) has retired: at most one is in flight
        a_bufs.index(slot).store(a)
        fence_async_shared()
        a = gpt.packed_gather(x_ptr, base, h0, w0, (kk + 1) * BLOCK_K, K, SCi, Ci, H, W, BLOCK_K, g_layout)
        mbarrier.wait(ready.index(slot), (kk // STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, use_acc=kk != 0, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        _packed_b_load(kk + STAGES - 1, k_tiles, n0, w_desc, b_bufs, ready, STAGES)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    c_smem.store(acc.to(dtype))
    fence_async_shared()
    tma.async_store(y_desc, [m0, n0], c_smem)
    tma.store_wait(pendings=0)
    gdev.invalidate_ring(ready)


JIT_FUNCTIONS = (conv2d_fprop_kernel, conv2d_fprop_packed_kernel)


# ---- configs -------------------------------------------------------------------------------------


def supports(p: dict, device) -> bool:
    return device.capability == (9, 0) and p.get("dtype") in gh.MMA_DTYPES and gh.conv_geometry_ok(p)


def config_space(p: dict, device) -> list[dict]:
    """The space, less configs that would run but cannot help on this problem (too-large
    tiles, narrow two-warpgroup tiles). Resource limits are left to
    prune(), which must agree with the compiler."""
    sms = gh.sm_count_of(device)
    return [c for c in SPACES[OP] if not resources_ok(c, p, sms) or worth_trying(c, p, sms)]


def resources_ok(c: dict, p: dict | None = None, sms: int | None = None) -> bool:
    """The resource rule (prune() applies it; it must agree with the compiler): shared memory
    and the accumulator's registers of the binary c launches on p (split or not)."""
    split = p is not None and sms is not None and gpt.fprop_splits(p, c, sms)[0] > 1
    return ghop.wgmma_resources_ok(c, smem_bytes(c, tma_out=not split))


def smem_bytes(c: dict, itemsize: int = 2, tma_out: bool = True) -> int:
    """The ring, its barriers and the y tile TMA stores from (tma_out; the split binary's fp32
    partials leave from registers)."""
    ring = c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * itemsize
    y_tile = c["BLOCK_M"] * c["BLOCK_N"] * itemsize if tma_out else 0
    return ring + y_tile + 16 * c["num_stages"] + 1024


def worth_trying(c: dict, p: dict, sms: int = 132) -> bool:
    """The performance rule (config_space() applies it): could this config win on this problem?
    Whether it fits the device is resources_ok()'s question."""
    # two warpgroups on a 64-row tile split N; below 128 columns each gets a sliver
    if c["num_warps"] == 8 and c["BLOCK_M"] == 64 and c["BLOCK_N"] < 128:
        return False
    if c.get("SPLIT_K", 1) == 0 and gpt.fprop_splits(p, c, sms)[0] == 1:
        return False  # the model does not split (or the packed kernel): the unsplit launch
    if gpt.packs_taps(p):
        # the packed kernel's ring holds weights only (L2-resident): depth buys nothing that the
        # occupancy its shared memory costs would not
        if c["num_stages"] > 3 or c["BLOCK_K"] > max(16, gh.pow2_at_least(gpt.packed_k(p))):
            return False
    # a k-step covers one filter tap: more channels than the tap has are zeros
    elif c["BLOCK_K"] > max(16, gh.pow2_at_least(gh.padded_channels(p["Ci"], p["dtype"]))):
        return False
    if c["BLOCK_N"] < 64 and (gpt.packs_taps(p) or gh.padded_channels(p["Co"], p["dtype"]) > c["BLOCK_N"]):
        return False  # a narrow tile is for a few output channels (image heads), all in one tile
    return c["BLOCK_N"] <= max(64, gh.pow2_at_least(p["Co"])) and c["BLOCK_M"] <= max(64, gh.pow2_at_least(p["gemm_M"]))


def prune(configs: list[dict], p: dict, device) -> list[dict]:
    """Configs that fit the device, the likeliest winners first."""
    sms = gh.sm_count_of(device)
    return ghop.quick_first(OP, [c for c in configs if resources_ok(c, p, sms)], p, sms)


def default_config(p: dict, device) -> dict:
    ci = gh.padded_channels(p["Ci"], p["dtype"])
    bk = min(64, max(16, gh.pow2_at_least(ci)))
    if gpt.packs_taps(p):
        bk = min(32, max(16, gh.pow2_at_least(gpt.packed_k(p))))
        bn = 64 if p["Co"] <= 64 else 128
        warps = 4 if bn == 64 else 8  # the gathered tile's registers beside a 128x128 accumulator spill at 4
        c = {"BLOCK_M": 128, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "SPLIT_K": 1, "num_warps": warps}
        c["num_stages"] = 2
    elif gh.padded_channels(p["Co"], p["dtype"]) <= 32:  # an image head: one narrow N tile (Co 3: 1.5x a 64-wide one)
        bn = 16 if gh.padded_channels(p["Co"], p["dtype"]) <= 16 else 32
        c = {"BLOCK_M": 256, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "SPLIT_K": 0, "num_warps": 4, "num_stages": 4}
    elif p["Co"] >= 256:
        c = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": bk, "GROUP_M": 8, "SPLIT_K": 0, "num_warps": 8, "num_stages": 3}
    elif p["Co"] >= 128:
        c = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": bk, "GROUP_M": 8, "SPLIT_K": 0, "num_warps": 8, "num_stages": 4}
    else:
        c = {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": bk, "GROUP_M": 8, "SPLIT_K": 0, "num_warps": 4, "num_stages": 4}
    if c["SPLIT_K"] == 0 and gpt.fprop_splits(p, c, gh.sm_count_of(device))[0] == 1:
        c["SPLIT_K"] = 1  # the model does not split: the unsplit config (SPLIT_K 0 is dropped as its twin)
    if not (resources_ok(c, p, gh.sm_count_of(device)) and worth_trying(c, p, gh.sm_count_of(device))):
        fitting = prune(config_space(p, device), p, device)
        if fitting:
            c = max(fitting, key=lambda x: (x["BLOCK_M"] * x["BLOCK_N"], x["BLOCK_K"], x["num_stages"]))
    return c


# ---- host side -----------------------------------------------------------------------------------


def _constexprs(c: dict, im2col: bool, split: bool) -> dict:
    return {"STAGES": c["num_stages"], "IM2COL": im2col, "SPLIT": split, "num_warps": c["num_warps"]}


class _Plan:
    """One (config, x/w shapes and strides, dtype, stride, padding, device) launch, precomputed:
    see gluon_launch.DirectLauncher."""

    __slots__ = (
        "launcher",
        "maps",
        "grid0",
        "tail",
        "x_desc",
        "w_desc",
        "y_blk",
        "ci",
        "pad_x",
        "pad_w",
        "y_shape",
        "Co",
        "co_pad",
        "out_shape",
        "reduce",
        "idle",
    )

    def run(self, x: torch.Tensor, w: torch.Tensor, stream: int) -> torch.Tensor:
        xp = gh.pad_last_dim(x, self.ci) if self.pad_x else x
        wp = gh.pad_last_dim(w, self.ci) if self.pad_w else w
        whole = self.co_pad == self.Co  # y is the output itself, made in its shape (no view per call)
        y = x.new_empty(self.out_shape if whole else self.y_shape)
        px, pw, py = xp.data_ptr(), wp.data_ptr(), y.data_ptr()
        maps, ld = self.maps, self.launcher
        xm = maps.get((0, px)) or maps.put((0, px), ld.expand_desc(0, self.x_desc(xp)))
        wm = maps.get((1, pw)) or maps.put((1, pw), ld.expand_desc(1, self.w_desc(wp)))
        ym = maps.get((2, py))
        if ym is None:
            ym = maps.put((2, py), ld.expand_desc(2, gh.tiled_desc(y.view(self.y_shape), self.y_blk)))
        if self.reduce is None:
            ld(self.grid0, stream, [*xm, *wm, *ym, self.idle, *self.tail])
        else:
            ws = self.reduce.workspace(x, stream)
            ld(self.grid0, stream, [*xm, *wm, *ym, ws.data_ptr(), *self.tail])
            self.reduce(stream, ws, y)
        return y if whole else y[:, : self.Co].contiguous().view(self.out_shape)


class _PackedPlan:
    """A packed-taps launch (conv2d_fprop_packed_kernel), precomputed as _Plan."""

    __slots__ = (
        "launcher",
        "maps",
        "grid0",
        "tail",
        "w_blk",
        "y_blk",
        "y_shape",
        "Co",
        "co_pad",
        "out_shape",
        "w_copies",
        "w_bufs",
    )

    def packed(self, w: torch.Tensor, stream: int) -> torch.Tensor:
        """w as the kernel's [Co, K] rows (gluon_packed_taps.packed_weights). Where that is a padded
        copy (an image stem's K = 7*7*3), into a buffer the plan keeps per stream, its padding
        zeroed once: one copy launch, not a fresh padded tensor each call (a batch-1 stem's host
        time). Under CUDA-graph capture, a fresh one: a graph must not share it with eager calls."""
        if not self.w_copies or torch.cuda.is_current_stream_capturing():
            return gpt.packed_weights(w)
        kept = self.w_bufs.get(stream)
        if kept is None:
            if len(self.w_bufs) >= sk.KEPT_STREAMS:
                self.w_bufs.clear()  # streams made as a program goes: keep only the recent ones
            # kept across calls: made outside a CUDA-graph pool that torch.compile's warm-up
            # would otherwise allocate it in (gluon_host.kept_buffer), then filled on this stream
            wp = gh.kept_buffer(w.device, lambda: w.new_zeros((w.shape[0], gpt.packed_width(w))))
            kept = self.w_bufs[stream] = (wp, wp[:, : w[0].numel()].unflatten(1, w.shape[1:]))
        wp, rows = kept
        rows.copy_(w)
        return wp

    def run(self, x: torch.Tensor, w: torch.Tensor, stream: int) -> torch.Tensor | None:
        px = x.data_ptr()
        if px & 15:
            return None  # x_ptr was specialized 16-byte aligned: the JIT path
        wp = self.packed(w, stream)
        whole = self.co_pad == self.Co
        y = x.new_empty(self.out_shape if whole else self.y_shape)
        pw, py = wp.data_ptr(), y.data_ptr()
        maps, ld = self.maps, self.launcher
        wm = maps.get((0, pw)) or maps.put((0, pw), ld.expand_desc(0, gh.tiled_desc(wp, self.w_blk)))
        ym = maps.get((1, py))
        if ym is None:
            ym = maps.put((1, py), ld.expand_desc(1, gh.tiled_desc(y.view(self.y_shape), self.y_blk)))
        ld(self.grid0, stream, [px, *wm, *ym, *self.tail])
        return y if whole else y[:, : self.Co].contiguous().view(self.out_shape)


_PLANS = direct.PlanCache()


def _plan_key(dev: int, config: dict, x: torch.Tensor, w: torch.Tensor, stride=1, padding=0) -> tuple | None:
    st, pd = direct.int_pair_key(stride), direct.int_pair_key(padding)
    if st is None or pd is None:
        return None
    return (direct.config_key(config), x.shape, x.stride(), w.shape, w.stride(), x.dtype, w.dtype, st, pd, dev)


def plan_for(config: dict, *args):
    """(plan, device) of a call whose first launch made one, else None: gluon_launch.plan_for."""
    return direct.plan_for(_PLANS, _plan_key, config, args)


def launch(config: dict, x: torch.Tensor, w: torch.Tensor, stride=1, padding=0) -> torch.Tensor:
    key = None
    if direct.direct_launch_enabled():
        key, plan, _, stream = direct.look_up(_PLANS, _plan_key, config, (x, w, stride, padding))
        if plan is not None:
            y = plan.run(x, w, stream)
            if y is not None:
                return y
    return _launch_jit(config, x, w, stride, padding, key)


def _launch_jit(config: dict, x: torch.Tensor, w: torch.Tensor, stride, padding, key) -> torch.Tensor:
    (sh, sw), (ph, pw) = problems.stride_padding(stride, padding)
    N, H, W, Ci = x.shape
    Co, R, S, _ = w.shape
    P, Q = problems.out_size(H, R, sh, ph), problems.out_size(W, S, sw, pw)
    if gpt.packs_taps({"Ci": Ci}):
        return _launch_packed_jit(config, x, w, (sh, sw), (ph, pw), (P, Q), key)
    xp, wp = gh.pad_channels(x), gh.pad_channels(w)
    Ci = xp.shape[-1]
    M = N * P * Q
    co_pad = gh.padded_channels(Co, x.dtype)
    y = torch.empty((M, co_pad), device=x.device, dtype=x.dtype)
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    im2col, x_desc_of = gh.conv_x_desc(R, S, (sh, sw), (ph, pw), (P, Q), [bm, bk])

    def w_desc_of(t):
        return gh.tiled_desc(t.view(Co, R * S * Ci), [bn, bk])

    x_desc, w_desc = x_desc_of(xp), w_desc_of(wp)
    y_desc = gh.tiled_desc(y, [bm, bn])
    tiles = triton.cdiv(M, bm) * triton.cdiv(Co, bn)
    sms = gh.num_sms(x.device)
    n_split, per = sk.modeled_splits(config, tiles, R * S * triton.cdiv(Ci, bk), M * co_pad, sms)
    split = n_split > 1
    grid = gh.persistent_grid(tiles * n_split, sms)
    ce = _constexprs(config, im2col, split)
    scalars = (M, Co, Ci, R, S, P * Q, Q, sh, sw, ph, pw, config["GROUP_M"], n_split, per, co_pad)
    ws = x.new_empty((n_split, M, co_pad), dtype=torch.float32) if split else sk.no_split_workspace(x.device)
    options = ghop.warp_specialized_options(config["num_warps"])
    compiled = conv2d_fprop_kernel[grid](x_desc, w_desc, y_desc, ws, *scalars, **ce, **options)
    reduce = (sk.split_k_reduce_jit(ws, y), ws, y) if split else None
    plan = direct.new_plan(_Plan, key, compiled, conv2d_fprop_kernel, 4, scalars, ce, grid[0], reduce)
    if plan is not None:
        plan.x_desc, plan.w_desc, plan.y_blk = x_desc_of, w_desc_of, [bm, bn]
        plan.ci, plan.pad_x, plan.pad_w = Ci, xp is not x, wp is not w
        plan.y_shape, plan.Co, plan.co_pad, plan.out_shape = (M, co_pad), Co, co_pad, (N, P, Q, Co)
        plan.idle = sk.no_split_workspace(x.device).data_ptr()  # the unsplit binary's workspace
        _PLANS.put(key, plan)
    y = y if co_pad == Co else y[:, :Co].contiguous()
    return y.view(N, P, Q, Co)


def _packed_constexprs(c: dict) -> dict:
    return {"STAGES": c["num_stages"], "num_warps": c["num_warps"]}


def _launch_packed_jit(config: dict, x: torch.Tensor, w: torch.Tensor, stride, padding, PQ, key) -> torch.Tensor:
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    ints = gpt.packed_fprop_ints(x.shape, w.shape, stride, padding, PQ, config["GROUP_M"])
    M, Co = ints[0], ints[1]
    co_pad = gh.padded_channels(Co, x.dtype)
    wp = gpt.packed_weights(w)
    y = torch.empty((M, co_pad), device=x.device, dtype=x.dtype)
    w_desc, y_desc = gh.tiled_desc(wp, [bn, bk]), gh.tiled_desc(y, [bm, bn])
    grid = (triton.cdiv(M, bm) * triton.cdiv(Co, bn),)
    ce = _packed_constexprs(config)
    compiled = conv2d_fprop_packed_kernel[grid](x, w_desc, y_desc, *ints, **ce)
    out_shape = (x.shape[0], *PQ, Co)
    aligned = not x.data_ptr() & 15  # plans are of 16-byte aligned x (_PackedPlan.run)
    plan = direct.new_plan(
        _PackedPlan, key if aligned else None, compiled, conv2d_fprop_packed_kernel, 3, ints, ce, grid[0]
    )
    if plan is not None:
        plan.w_blk, plan.y_blk, plan.y_shape = [bn, bk], [bm, bn], (M, co_pad)
        plan.Co, plan.co_pad, plan.out_shape = Co, co_pad, out_shape
        plan.w_copies, plan.w_bufs = wp.data_ptr() != w.data_ptr(), {}
        _PLANS.put(key, plan)
    y = y if co_pad == Co else y[:, :Co].contiguous()
    return y.view(out_shape)


def compile_specs(p: dict, config: dict, device) -> list[KernelSpec]:
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    kernels = (conv2d_fprop_kernel, conv2d_fprop_packed_kernel)
    options = ghop.warp_specialized_options(config["num_warps"])
    return gpt.fprop_specs(
        kernels, p, config, ([bm, bk], [bn, bk], [bm, bn]), (_constexprs, _packed_constexprs), device, options
    )
