"""How both Gluon wgrad kernels divide their work: split-K and stream-K over the output tiles
(WgradWork on the host, wgrad_piece walking it on the device), the packed-taps wgrad's split,
and the few-output-channels kernels' rules and device pieces; for both gathering kernels
(packed taps, few Co) their buffers, gathered B tile and JIT launch set-up (gather_launch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from . import KernelSpec
from . import gluon_host as gh
from .geometry import is_pointwise
from .gluon_host import (
    cdiv,
    desc_sig,
    im2col_desc_sig,
    padded_channels,
    persistent_grid,
    pow2_at_least,
    ptr_sig,
    sm_count_of,
)
from .gluon_packed_taps import packed_gather, packed_gather_layout, packed_rows, packs_taps
from .gluon_split_k import auto_splits, split_k_plan, split_k_reduce_spec

# ---- split-K and stream-K --------------------------------------------------------------------


STREAM_K = -1  # a wgrad SPLIT_K of the stream-K schedule; 0 asks for the modeled best split count


class WgradWork:
    """How a wgrad config's launch divides the GEMM: `tiles` output tiles, each `k_steps`
    BLOCK_K steps long; split-K runs `splits` units of `per` steps per tile over `ctas`
    persistent CTAs, stream-K gives each of `ctas` CTAs `per` consecutive (tile, step)
    iterations. Both Gluon wgrad kernels divide their work so (wgrad_piece)."""

    __slots__ = ("tiles", "k_steps", "splits", "per", "ctas", "stream")

    def __init__(self, Co: int, Ci: int, RS: int, npq: int, c: dict, sms: int):
        bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
        self.tiles = cdiv(Co, bm) * RS * cdiv(Ci, bn)
        self.k_steps = max(1, cdiv(npq, bk))
        self.stream = c["SPLIT_K"] == STREAM_K
        if self.stream:
            total = self.tiles * self.k_steps
            self.splits, self.per = 1, cdiv(total, sms)
            self.ctas = cdiv(total, self.per)
        else:
            want = c["SPLIT_K"] or auto_splits(self.tiles, self.k_steps, sms, Co * RS * Ci, c)
            self.splits, self.per = split_k_plan(self.k_steps, want)
            self.ctas = persistent_grid(self.tiles * self.splits, sms)[0]

    @classmethod
    def of(cls, p: dict, c: dict, sms: int) -> "WgradWork":
        ci = padded_channels(p["Ci"], p["dtype"])
        return cls(p["Co"], ci, p["R"] * p["S"], p["N"] * p["P"] * p["Q"], c, sms)

    @property
    def into_partials(self) -> bool:
        """Whether a launch writes fp32 split partials (a second pass sums them) instead of grad_w."""
        return not self.stream and self.splits > 1


# the integer arguments of both Gluon wgrad kernels that read x and grad_out by TMA, after their
# descriptors and out_ptr, ws_ptr, flags_ptr: unspecialized i32, so one compile per config serves
# every shape
WGRAD_INTS = (
    "Co",
    "Ci",
    "RS",
    "S",
    "PQ",
    "Q",
    "stride_h",
    "stride_w",
    "pad_h",
    "pad_w",
    "k_steps",
    "per",
    "num_splits",
)


def wgrad_specs(
    kernels: tuple, constexprs: tuple, p: dict, c: dict, device, narrowest: int, c_desc: bool
) -> list[KernelSpec]:
    """Both Gluon wgrad backends' compile_specs. kernels = (the TMA kernel, the packed-taps one,
    the few-Co one), constexprs = the first two's constexpr functions ((c, im2col), (c); the
    few-Co kernel's are few_co_constexprs); narrowest: the backend's FEW_CO_NARROWEST; c_desc:
    the TMA kernel stores grad_w tiles through a descriptor (its third)."""
    fn, packed_fn, few_co_fn = kernels
    ce_of, packed_ce_of = constexprs
    if runs_few_co(p, c, narrowest):
        ce = few_co_constexprs(packed_ce_of(c), (p["stride_h"], p["stride_w"]))
        return _gather_wgrad_specs(few_co_fn, p, c, ce, device, few_co=True)
    if packs_taps(p):
        return _gather_wgrad_specs(packed_fn, p, c, packed_ce_of(c), device, few_co=False)
    dt = p["dtype"]
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    im2col = not is_pointwise(p)
    descs = {
        "g_desc": desc_sig(dt, [bk, bm]),
        "x_desc": im2col_desc_sig(dt, [bk, bn]) if im2col else desc_sig(dt, [bk, bn]),
    }
    if c_desc:
        descs["c_desc"] = desc_sig(dt, [bm, 1, bn])
    return _tma_wgrad_specs(fn, descs, p, c, ce_of(c, im2col), device)


def _tma_wgrad_specs(fn, descs: dict, p: dict, c: dict, constexprs: dict, device) -> list[KernelSpec]:
    """compile_specs of a backend's TMA wgrad kernel `fn` (its descriptors `descs`, name ->
    signature, then out_ptr, ws_ptr, flags_ptr, WGRAD_INTS and `constexprs`) and of its
    reduction where it writes partials."""
    dt, sms = p["dtype"], sm_count_of(device)
    work = WgradWork.of(p, c, sms)
    out_sig = "*fp32" if work.into_partials else ptr_sig(dt)
    sig = dict(descs, out_ptr=out_sig)
    sig["ws_ptr"] = "*fp32" if work.stream else out_sig
    sig["flags_ptr"] = "*i32" if work.stream else out_sig
    sig.update({k: "i32" for k in WGRAD_INTS})
    sig.update({k: "constexpr" for k in constexprs})
    specs = [KernelSpec(fn=fn, signature=sig, constexprs=constexprs, num_warps=c["num_warps"], name=fn.__name__)]
    return specs + ([split_k_reduce_spec(dt, wgrad_out_numel(p), sms)] if work.into_partials else [])


@gluon.jit
def _stream_k_run(tiles, k_steps, per):
    """Stream-K: this CTA's iterations [start, end) of the tile-major (tile, k-step) order."""
    start = gl.program_id(0) * per
    return start, gl.minimum(start + per, tiles * k_steps)


@gluon.jit
def wgrad_num_pieces(tiles, k_steps, per, num_splits, STREAM: gl.constexpr):
    """How many pieces of work (wgrad_piece) this CTA runs."""
    if STREAM:
        start, end = _stream_k_run(tiles, k_steps, per)
        n = (end - 1) // k_steps - start // k_steps + 1
    else:
        n = gl.cdiv(tiles * num_splits - gl.program_id(0), gl.num_programs(0))
    return n


@gluon.jit
def wgrad_piece(i, co_blocks, ci_blocks, tiles, k_steps, per, STREAM: gl.constexpr):
    """This CTA's i-th piece of work -> (split, tile, Co block, Ci block, tap index, first
    k-step, end k-step). Split-K: unit pid + i * nprog of the split-major order (the CTAs
    running together share a pixel range in L2). Stream-K: the run's tiles, last to first, so
    that the one piece a CTA leaves unfinished (the head of a tile later CTAs end) is its first:
    its partial is out before the CTA waits on anyone."""
    if STREAM:
        start, end = _stream_k_run(tiles, k_steps, per)
        t = (end - 1) // k_steps - i
        split = t * 0
        k_from = gl.maximum(start - t * k_steps, 0)
        k_to = gl.minimum(end - t * k_steps, k_steps)
    else:
        u = gl.program_id(0) + i * gl.num_programs(0)
        split = u // tiles
        t = u % tiles
        k_from = split * per
        k_to = gl.minimum(k_from + per, k_steps)
    rest = t // co_blocks
    return split, t, t % co_blocks, rest % ci_blocks, rest // ci_blocks, k_from, k_to


def wgrad_out_numel(p: dict, gathers: bool = False) -> int:
    """Elements of a wgrad launch's grad_w [Co, R, S, Ci] (its split-K reduction's outputs), Ci
    padded for TMA unless a gathering kernel (packed taps; few output channels: `gathers`) runs it."""
    ci = p["Ci"] if packs_taps(p) or gathers else padded_channels(p["Ci"], p["dtype"])
    return p["Co"] * p["R"] * p["S"] * ci


# ---- packed taps (gluon_packed_taps) ---------------------------------------------------------


@gluon.constexpr_function
def packed_b_layout(BLOCK_K, BLOCK_N, dtype):
    """Shared layout of a gathered [BLOCK_K pixels, BLOCK_N packed taps] tile that is the MMA's
    B operand as it lies (N contiguous): no descriptor carries it."""
    return gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], dtype)


PACKED_WGRAD_CTAS_PER_SM = 2


def packed_wgrad_work(Co: int, K: int, npq: int, c: dict, sms: int) -> tuple[int, int, int, int]:
    """(tiles, k_steps, splits, per) of a packed-taps wgrad: its few tiles (Co x K) leave the
    pixel reduction to fill the GPU, so it is split until every SM runs a few CTAs (their
    gathers hide each other's latency); SPLIT_K > 0 caps that."""
    tiles = cdiv(Co, c["BLOCK_M"]) * cdiv(K, c["BLOCK_N"])
    k_steps = max(1, cdiv(npq, c["BLOCK_K"]))
    want = cdiv(PACKED_WGRAD_CTAS_PER_SM * sms, tiles)
    splits, per = split_k_plan(k_steps, min(want, c["SPLIT_K"]) if c["SPLIT_K"] > 0 else want)
    return tiles, k_steps, splits, per


PACKED_WGRAD_INTS = ("Co", "Ci", "K", "SCi", "H", "W", "PQ", "Q", "stride_h", "stride_w", "pad_h", "pad_w", "NPQ")


PACKED_WGRAD_INTS += ("k_steps", "per")


def packed_wgrad_ints(x_shape, g_shape, R: int, S: int, stride, padding, c: dict, sms: int) -> tuple:
    """A packed wgrad kernel's PACKED_WGRAD_INTS, its grid and its split count."""
    N, H, W, Ci = (int(v) for v in x_shape)
    _, P, Q, Co = (int(v) for v in g_shape)
    K, npq = R * S * Ci, N * P * Q
    tiles, k_steps, splits, per = packed_wgrad_work(Co, K, npq, c, sms)
    ints = (Co, Ci, K, S * Ci, H, W, P * Q, Q, *stride, *padding, npq, k_steps, per)
    return ints, tiles * splits, splits


# ---- few output channels: a wgrad walked over x's pixels, grad_out gathered per tap ----------
# An image head's wgrad (Co = 3) fills 3 of the 64 rows of each MMA when Co is its M side, and
# reads x once per tap (9 times for a 3x3) through im2col. Transposed, grad_w^T [Ci, R*S*Co] =
# x^T [Ci, N*H*W] @ G [N*H*W, R*S*Co]: M = Ci, each x tile is read once by TMA, and the B tile
# packs every tap's few grad_out channels into one dense N (column j = tap * Co + co), gathered
# through pointers: x pixel (ih, iw) meets grad_out pixel ((ih + pad_h - r) / stride_h, ...)
# where that divides. Split over the pixels into fp32 partials (few_co_wgrad_work).


FEW_CO_MAX = 8  # Co <= 8: the narrowest WGMMA M (64) would run at most 1/8 useful rows


def wgrad_few_co(p: dict) -> bool:
    """A wgrad the few-output-channels kernels can run: Co <= FEW_CO_MAX, every tap's channels
    in one MMA N of at most 256, and enough input channels that the packed taps do not apply."""
    return not packs_taps(p) and p["Co"] <= FEW_CO_MAX and p["R"] * p["S"] * p["Co"] <= 256


def runs_few_co(p: dict, c: dict, narrowest: int) -> bool:
    """Whether config c runs the few-Co kernel on p: where it can, the configs whose BLOCK_N is
    its B tile's width (few_co_width) do, the others the im2col kernel, so the tuner times both
    (which wins depends on the shape: few_co_by_default)."""
    return wgrad_few_co(p) and c["BLOCK_N"] == few_co_width(p, narrowest)


FEW_CO_DEFAULT_PIXELS_PER_CI = 100


FEW_CO_DEFAULT_MAX_CO = 4


def few_co_by_default(p: dict) -> bool:
    """Whether an untuned call (the backends' default_config) takes the few-Co kernel: at stride
    1, Co <= 4 and past FEW_CO_DEFAULT_PIXELS_PER_CI pixels of x per input channel. H100, best of
    each kernel's candidates: it won 2.1-2.8x at Co = 3 over 65K-262K pixels of Ci = 64-128 (3x3
    and 7x7) and 1.1x on a 1x1 to Co = 1; it lost 0.5-0.7x where x is read fast enough through
    im2col and the gathers dominate: 4K-16K pixels of Ci = 256-512, Co = 8 (its B tile 128 wide)
    or stride 2 (most gathered taps miss)."""
    return (
        wgrad_few_co(p)
        and p["Co"] <= FEW_CO_DEFAULT_MAX_CO
        and (p["stride_h"], p["stride_w"]) == (1, 1)
        and p["N"] * p["H"] * p["W"] > FEW_CO_DEFAULT_PIXELS_PER_CI * p["Ci"]
    )


def few_co_width(p: dict, narrowest: int) -> int:
    """The B tile's N (BLOCK_N) of a few-Co wgrad: R*S*Co rounded up to a power of two, at least
    the backend's narrowest tile."""
    return max(narrowest, pow2_at_least(p["R"] * p["S"] * p["Co"]))


# the few-Co kernels' integer arguments, in order (both backends)
FEW_CO_WGRAD_INTS = ("Co", "Ci", "RS", "S", "HW", "W", "P", "Q", "stride_h", "stride_w", "pad_h", "pad_w", "NHW")


FEW_CO_WGRAD_INTS += ("k_steps", "per")


FEW_CO_MIN_STEPS = 8  # pixel steps per split the model keeps: a split's partial is R*S*Co*Ci fp32


def few_co_wgrad_work(Ci: int, nhw: int, c: dict, sms: int) -> tuple[int, int, int, int]:
    """(tiles, k_steps, splits, per) of a few-Co wgrad: its tiles are the Ci blocks (one N tile
    spans every tap), split over x's pixels until the SMs each run a few CTAs
    (PACKED_WGRAD_CTAS_PER_SM), but no split shorter than FEW_CO_MIN_STEPS: a partial is as large
    as a few pixel steps of x (ResNet-sized Ci over 64x64 pixels split 64 ways wrote 9 MB of
    partials for 4 MB of x). SPLIT_K > 0 asks for that many splits instead."""
    tiles = cdiv(Ci, c["BLOCK_M"])
    k_steps = max(1, cdiv(nhw, c["BLOCK_K"]))
    want = min(cdiv(PACKED_WGRAD_CTAS_PER_SM * sms, tiles), max(1, k_steps // FEW_CO_MIN_STEPS))
    splits, per = split_k_plan(k_steps, c["SPLIT_K"] if c["SPLIT_K"] > 0 else want)
    return tiles, k_steps, splits, per


def few_co_split_worth_trying(c: dict, p: dict, sms: int) -> bool:
    """A few-Co config's SPLIT_K is a distinct launch: 0 (the model's count), or a count that
    launches exactly that many splits (not fewer, the same as a smaller count) and not the
    model's own; never stream-K (-1)."""
    if c["SPLIT_K"] == 0:
        return True
    nhw = p["N"] * p["H"] * p["W"]
    splits = few_co_wgrad_work(p["Ci"], nhw, c, sms)[2]
    return (
        c["SPLIT_K"] > 0
        and splits == c["SPLIT_K"]
        and splits != few_co_wgrad_work(p["Ci"], nhw, dict(c, SPLIT_K=0), sms)[2]
    )


def few_co_wgrad_ints(x_shape, g_shape, R: int, S: int, stride, padding, c: dict, sms: int) -> tuple:
    """A few-Co wgrad kernel's FEW_CO_WGRAD_INTS, its grid and its split count."""
    N, H, W, Ci = (int(v) for v in x_shape)
    _, P, Q, Co = (int(v) for v in g_shape)
    nhw = N * H * W
    tiles, k_steps, splits, per = few_co_wgrad_work(Ci, nhw, c, sms)
    ints = (Co, Ci, R * S, S, H * W, W, P, Q, *stride, *padding, nhw, k_steps, per)
    return ints, tiles * splits, splits


def few_co_constexprs(packed: dict, stride) -> dict:
    """A few-Co kernel's constexprs: the backend's packed-taps kernel's (`packed`), and STRIDED."""
    return dict(packed, STRIDED=tuple(stride) != (1, 1))


@dataclass
class GatherLaunch:
    """A gathering wgrad's JIT launch (packed taps, or few Co) as both backends set it up
    (gather_launch): the kernel's integer arguments, grid and split count; the operand TMA
    reads (grad_out, or x with few Co: its channels padded) viewed as [rows, cols] and described
    in `blk` tiles (`desc`); the one the kernel gathers through its pointer; grad_w `out` [Co, R,
    S, Ci] and, split, the fp32 partials `ws` [splits, Co, R, S, Ci] (else None)."""

    ints: tuple
    ctas: int
    splits: int
    desc: object
    blk: list
    rows: int
    cols: int
    gathered: torch.Tensor
    out: torch.Tensor
    ws: torch.Tensor | None

    def target(self) -> torch.Tensor:
        """What the kernel writes: grad_w, or the partials where it splits."""
        return self.out if self.ws is None else self.ws


def gather_launch(config: dict, x: torch.Tensor, grad_out: torch.Tensor, R: int, S: int, stride, padding, few_co: bool):
    """The set-up of a packed-taps (few_co False) or few-Co wgrad launch, both backends'."""
    ints_of = few_co_wgrad_ints if few_co else packed_wgrad_ints
    sms = gh.num_sms(x.device)  # through gh: where a CPU-only test sets the SM count
    ints, ctas, splits = ints_of(x.shape, grad_out.shape, R, S, stride, padding, config, sms)
    tiled, gathered = (gh.pad_channels(x), grad_out.contiguous()) if few_co else (gh.pad_channels(grad_out), x)
    rows, cols, blk = ints[12], tiled.shape[-1], [config["BLOCK_K"], config["BLOCK_M"]]
    wanted = (ints[0], R, S, x.shape[-1])
    out = torch.empty(wanted, device=x.device, dtype=x.dtype)
    ws = None if splits == 1 else torch.empty((splits, *wanted), device=x.device, dtype=torch.float32)
    desc = gh.tiled_desc(tiled.view(rows, cols), blk)
    return GatherLaunch(ints, ctas, splits, desc, blk, rows, cols, gathered, out, ws)


def _gather_wgrad_specs(fn, p: dict, c: dict, constexprs: dict, device, few_co: bool) -> list[KernelSpec]:
    """compile_specs of a backend's packed-taps kernel `fn`, or with few_co its few-Co kernel
    (one operand read by TMA, the other gathered through its pointer), and of its reduction
    where it splits."""
    dt = p["dtype"]
    x_shape, g_shape = (p["N"], p["H"], p["W"], p["Ci"]), (p["N"], p["P"], p["Q"], p["Co"])
    st, pd = (p["stride_h"], p["stride_w"]), (p["pad_h"], p["pad_w"])
    sms = sm_count_of(device)
    if few_co:
        ints_of, names, tiled, gathered = few_co_wgrad_ints, FEW_CO_WGRAD_INTS, "x_desc", "g_ptr"
    else:
        ints_of, names, tiled, gathered = packed_wgrad_ints, PACKED_WGRAD_INTS, "g_desc", "x_ptr"
    _, _, splits = ints_of(x_shape, g_shape, p["R"], p["S"], st, pd, c, sms)
    sig = {tiled: desc_sig(dt, [c["BLOCK_K"], c["BLOCK_M"]]), gathered: ptr_sig(dt)}
    sig["out_ptr"] = ptr_sig(dt) if splits == 1 else "*fp32"
    sig.update({k: "i32" for k in names})
    sig.update({k: "constexpr" for k in constexprs})
    specs = [KernelSpec(fn=fn, signature=sig, constexprs=constexprs, num_warps=c["num_warps"], name=fn.__name__)]
    return specs + ([split_k_reduce_spec(dt, wgrad_out_numel(p, gathers=few_co), sms)] if splits > 1 else [])


@gluon.jit
def few_co_rows(m0, NHW, HW, W, BLOCK_K: gl.constexpr, layout: gl.constexpr):
    """x pixels m0...: (image, row, column); rows past NHW get a row no tap reaches."""
    m = m0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, layout))
    hw = m % HW
    return (m // HW).to(gl.int64), gl.where(m < NHW, hw // W, -(1 << 28)), hw % W


@gluon.jit
def few_co_gather(
    g_ptr,
    img,
    ih,
    iw,
    Co,
    RSCo,
    S,
    P,
    Q,
    stride_h,
    stride_w,
    pad_h,
    pad_w,
    BLOCK_N: gl.constexpr,
    layout: gl.constexpr,
    STRIDED: gl.constexpr,
):
    """The B tile [pixels, BLOCK_N] of x pixels (img, ih, iw): column j = tap * Co + co holds
    grad_out[img, oh, ow, co] where the tap (r, s) takes pixel (ih, iw) to output (oh, ow),
    zeros where no output does and past R*S*Co."""
    j = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    t = j // Co
    co = j - t * Co
    r = t // S
    s = t - r * S
    r = gl.where(j < RSCo, r, 1 << 28)  # past the filter: a tap no pixel reaches
    oh = ih[:, None] + (pad_h - r)[None, :]
    ow = iw[:, None] + (pad_w - s)[None, :]
    ok = (oh >= 0) & (ow >= 0)
    if STRIDED:  # two integer divisions an element: only where a stride asks for them
        oh_at, ow_at = oh, ow
        oh = oh_at // stride_h
        ow = ow_at // stride_w
        ok = ok & (oh * stride_h == oh_at) & (ow * stride_w == ow_at)
    ok = ok & (oh < P) & (ow < Q)
    off = ((img[:, None] * P + oh) * Q + ow) * Co + co[None, :]
    return gl.load(g_ptr + off, mask=ok, other=0.0)


@gluon.jit
def gather_unit(rows, cols, k_steps, per, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """This CTA's unit of both architectures' packed-taps and few-Co kernels: one (split, tile)
    of the [rows, cols] output, numbered split-major so that the CTAs running together read the
    same pixels -> (split, first row, first column, first pixel step, steps)."""
    pid = gl.program_id(0)
    row_blocks = gl.cdiv(rows, BLOCK_M)
    tiles = row_blocks * gl.cdiv(cols, BLOCK_N)
    split = pid // tiles
    row0 = (pid % row_blocks) * BLOCK_M
    col0 = (pid % tiles // row_blocks) * BLOCK_N
    k_from = split * per
    return split, row0, col0, k_from, gl.minimum(per, k_steps - k_from)


@gluon.jit
def gather_buffers(a_desc, A_STAGES: gl.constexpr, B_STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    """The operand buffers of both architectures' gathering wgrad kernels (packed taps, few
    Co), allocated in this order: A_STAGES stages of a_desc's TMA tile ([BLOCK_K, BLOCK_M]) and
    B_STAGES of the gathered B tile [BLOCK_K, BLOCK_N] as the MMA reads it (packed_b_layout).
    Returns (a_bufs, b_bufs)."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[0]
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [A_STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [B_STAGES, BLOCK_K, BLOCK_N], packed_b_layout(BLOCK_K, BLOCK_N, dtype))
    return a_bufs, b_bufs


@gluon.jit
def gathered_b(m0, gather, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, FEW_CO: gl.constexpr, num_warps: gl.constexpr):
    """The gathered B tile of pixel step m0... of both architectures' gathering wgrad kernels,
    whose main loops differ only in this: x's packed-taps im2col (gather = (x_ptr, n0, K, SCi,
    Ci, H, W, NPQ, PQ, Q, stride_h, stride_w, pad_h, pad_w)) or, FEW_CO, grad_out's taps
    (gather = (g_ptr, Co, RS, S, HW, W, P, Q, stride_h, stride_w, pad_h, pad_w, NHW, STRIDED)),
    in registers of the gather layout of num_warps (gluon_packed_taps.packed_gather_layout)."""
    layout: gl.constexpr = packed_gather_layout(BLOCK_N, num_warps)
    if FEW_CO:
        g_ptr, Co, RS, S, HW, W, P, Q, stride_h, stride_w, pad_h, pad_w, NHW, STRIDED = gather
        img, ih, iw = few_co_rows(m0, NHW, HW, W, BLOCK_K, layout)
        b = few_co_gather(
            g_ptr, img, ih, iw, Co, RS * Co, S, P, Q, stride_h, stride_w, pad_h, pad_w, BLOCK_N, layout, STRIDED
        )
    else:
        x_ptr, n0, K, SCi, Ci, H, W, NPQ, PQ, Q, stride_h, stride_w, pad_h, pad_w = gather
        base, h0, w0 = packed_rows(m0, NPQ, PQ, Q, H, W, Ci, stride_h, stride_w, pad_h, pad_w, BLOCK_K, layout)
        b = packed_gather(x_ptr, base, h0, w0, n0, K, SCi, Ci, H, W, BLOCK_N, layout)
    return b


@gluon.constexpr_function
def few_co_store_layout(BLOCK_M, num_warps):
    """Each thread 4 adjacent channels of a column (grad_w's contiguous dim), a warp's lanes
    down the Ci block."""
    tpw_m = min(32, BLOCK_M // 4)
    return gl.BlockedLayout([4, 1], [tpw_m, 32 // tpw_m], [1, num_warps], [0, 1])


@gluon.jit
def few_co_store(out_ptr, split, acc, ci0, j0, Co, RS, Ci, num_warps: gl.constexpr):
    """Columns j0... of a few-Co accumulator [Ci block, taps * Co] stored to grad_w [Co, R, S,
    Ci] (split's slab of out_ptr), through few_co_store_layout: the accumulator's own layout
    spreads a column's channels over lanes, 2-byte stores."""
    layout: gl.constexpr = few_co_store_layout(acc.shape[0], num_warps)
    vals = gl.convert_layout(acc, layout)
    ci = ci0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    j = j0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    t = j // Co
    col = ((j - t * Co) * RS + t) * Ci
    base = out_ptr + split.to(gl.int64) * Co * RS * Ci
    ok = (ci < Ci)[:, None] & (j < RS * Co)[None, :]
    gl.store(base + (col[None, :] + ci[:, None]), vals.to(out_ptr.dtype.element_ty), mask=ok)
