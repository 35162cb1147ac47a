"""Code shared by the Gluon backends (hopper and blackwell), mostly host-side.

TMA descriptors (tiled and im2col) and the signature strings that name them for an explicit
compile, channel padding for TMA's 16-byte stride rule, persistent grids, and split-K: its
fp32 workspace and a deterministic two-pass reduction (the partials are summed in a fixed
order, so the same inputs always give the same bits, unlike atomics), the work model that
picks a split count, the matmul's split rules, the wgrad's division of work (split-K and
stream-K: WgradWork on the host, wgrad_piece walking it on the device) and the dgrad's output
phases (dgrad_phase on the device, the shared walk and its halo on the host), so that each
architecture's kernels schedule alike.

Nothing here launches a GEMM, and nothing here serves one architecture only: what only the
Hopper backends use lives in gluon_hopper.py (device helpers, tuning rules) and gluon_launch.py
(the direct launcher), so that a kernel version hashes the code its backend runs and an edit to
Hopper code leaves Blackwell entries valid.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor, TensorDescriptorIm2Col

from . import KernelSpec
from .problems import dtype_name

# Every TMA descriptor's base address and outer strides must be multiples of 16 bytes.
TMA_ALIGN_BYTES = 16
# Dynamic shared memory a CTA may use on sm_90 and sm_100 (227 KB); a kernel's own barriers
# and the compiler's scratch come out of it too.
SMEM_LIMIT_BYTES = 227 * 1024

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
# names used in kernel signatures (`triton.compile`) and in Gluon code
SIG_DTYPE = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
GL_DTYPE = {"float16": gl.float16, "bfloat16": gl.bfloat16, "float32": gl.float32}


def gl_dtype(dtype: Any):
    return GL_DTYPE[dtype_name(dtype)]


def tma_multiple(dtype: Any) -> int:
    """How many elements make 16 bytes: a contiguous dim that strides must be a multiple of it."""
    return TMA_ALIGN_BYTES // ITEMSIZE[dtype_name(dtype)]


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_tma_compatible(t: torch.Tensor) -> bool:
    """Last dim contiguous, base and every outer stride 16-byte aligned."""
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        return False
    es = t.element_size()
    if t.data_ptr() % TMA_ALIGN_BYTES:
        return False
    return all((s * es) % TMA_ALIGN_BYTES == 0 for s in t.stride()[:-1])


def padded_channels(c: int, dtype: Any) -> int:
    """Channel count rounded up so an NHWC tensor's strides satisfy TMA."""
    return round_up(c, tma_multiple(dtype))


def pad_last_dim(t: torch.Tensor, size: int) -> torch.Tensor:
    """A contiguous zero-padded copy of `t` whose last dim is `size` (t itself if it already is
    contiguous with that size). The zeros make padded channels add nothing to a GEMM."""
    if t.shape[-1] == size and t.is_contiguous():
        return t
    if size > t.shape[-1]:  # one launch (cat), not a fill and a copy: a small layer's padding is launch-bound
        zero = _ZERO.get((t.device, t.dtype))
        if zero is None:
            zero = _ZERO[(t.device, t.dtype)] = torch.zeros((), device=t.device, dtype=t.dtype)
        return torch.cat([t, zero.expand(*t.shape[:-1], size - t.shape[-1])], dim=-1)
    out = t.new_zeros((*t.shape[:-1], size))
    out[..., : t.shape[-1]] = t
    return out


_ZERO: dict = {}


def pad_channels(t: torch.Tensor) -> torch.Tensor:
    """Pad the last (channel) dim of a contiguous NHWC/KRSC tensor for TMA; no copy if aligned."""
    return pad_last_dim(t, padded_channels(t.shape[-1], t.dtype))


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """`t` if TMA can read it as is, else a contiguous copy with its last dim padded."""
    if is_tma_compatible(t):
        return t
    out = pad_last_dim(t.contiguous(), padded_channels(t.shape[-1], t.dtype))
    if out.data_ptr() % TMA_ALIGN_BYTES:
        out = out.clone()  # a contiguous view whose base TMA cannot take: a fresh allocation can
    return out


# ---- shared-memory layouts and descriptors ---------------------------------------------------


def shared_layout(block_shape: Sequence[int], dtype: Any, transposed: bool = False) -> gl.NVMMASharedLayout:
    """The widest-swizzle NVMMA layout for a TMA block that WGMMA/tcgen05 reads directly."""
    return _shared_layout(tuple(block_shape), dtype, transposed)


@functools.lru_cache(maxsize=4096)
def _shared_layout(block_shape: tuple, dtype: Any, transposed: bool) -> gl.NVMMASharedLayout:
    # ~35 us to compute and built on every launch (three descriptors per matmul): cached,
    # it leaves the launch path; layouts are immutable values, safe to share.
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), gl_dtype(dtype), transposed=transposed)


def tiled_desc(t: torch.Tensor, block_shape: Sequence[int], layout=None) -> TensorDescriptor:
    """Tiled TMA descriptor over `t` (any rank 1-5, last dim contiguous); OOB reads give zeros,
    OOB parts of stores are dropped."""
    block_shape = list(block_shape)
    if layout is None:
        layout = shared_layout(block_shape, t.dtype)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block_shape, layout)


def im2col_pixel_box(H: int, W: int, P: int, Q: int, stride: Sequence[int], padding: Sequence[int]):
    """(lower, upper) corners of the im2col pixel box for an NHWC input.

    The box starts at -pad and is sized so that stepping it by `stride` visits exactly P x Q
    pixels per image: (P - 1) * stride_h + 1 rows, i.e. upper = that - H - pad_h. TMA then
    walks BLOCK pixels from any (n, p, q) start, wrapping rows and images by itself.
    """
    (sh, sw), (ph, pw) = stride, padding
    lower = [-ph, -pw]
    upper = [(P - 1) * sh + 1 - H - ph, (Q - 1) * sw + 1 - W - pw]
    return lower, upper


# rank-4 (NHWC) im2col corners are signed 8-bit in the descriptor
IM2COL_CORNER_RANGE = (-128, 127)


def im2col_ok(H: int, W: int, P: int, Q: int, stride, padding) -> bool:
    """Whether the TMA im2col descriptor can express this geometry (strides <= 8, corners in
    range); callers fall back to another backend when it cannot."""
    (sh, sw) = stride
    if not (1 <= sh <= 8 and 1 <= sw <= 8):
        return False
    lo, hi = IM2COL_CORNER_RANGE
    lower, upper = im2col_pixel_box(H, W, P, Q, stride, padding)
    return all(lo <= v <= hi for v in lower + upper)


def conv_geometry_ok(p: dict) -> bool:
    """im2col_ok() for a conv problem dict: can TMA im2col walk this geometry?"""
    return im2col_ok(p["H"], p["W"], p["P"], p["Q"], (p["stride_h"], p["stride_w"]), (p["pad_h"], p["pad_w"]))


def im2col_desc(
    x: torch.Tensor,
    block_shape: Sequence[int],
    *,
    stride: Sequence[int],
    padding: Sequence[int],
    out_hw: Sequence[int],
    layout=None,
) -> TensorDescriptorIm2Col:
    """TMA im2col descriptor over NHWC `x`: a load at coord [n, p*sh - ph, q*sw - pw, c] with
    offsets [r, s] fills a [pixels, channels] block with the (r, s) filter tap's inputs for
    `pixels` consecutive output positions, zeros where the window hangs over the padding."""
    N, H, W, C = x.shape
    P, Q = out_hw
    block_shape = list(block_shape)
    if layout is None:
        layout = shared_layout(block_shape, x.dtype)
    lower, upper = im2col_pixel_box(H, W, P, Q, stride, padding)
    return TensorDescriptorIm2Col(
        base=x,
        shape=list(x.shape),
        strides=list(x.stride()),
        block_shape=block_shape,
        layout=layout,
        padding="zero",
        element_strides=[1, int(stride[0]), int(stride[1]), 1],
        pixel_box_lower_corner=lower,
        pixel_box_upper_corner=upper,
    )


def desc_sig(dtype: Any, block_shape: Sequence[int], layout=None) -> str:
    """Signature string of a tiled descriptor argument, as the JIT specializes it (its text is
    part of Triton's cache key: a compile under another spelling is never reused by a launch)."""
    block_shape = list(block_shape)
    if layout is None:
        layout = shared_layout(block_shape, dtype)
    return f"tensordesc<{SIG_DTYPE[dtype_name(dtype)]}{block_shape},{layout!r}>"


def im2col_desc_sig(dtype: Any, block_shape: Sequence[int], layout=None, input_rank: int = 4) -> str:
    """Signature string of an im2col descriptor argument over a rank-`input_rank` tensor."""
    block_shape = list(block_shape)
    if layout is None:
        layout = shared_layout(block_shape, dtype)
    return f"tensordesc_im2col<{SIG_DTYPE[dtype_name(dtype)]}{block_shape},input_rank={input_rank},{layout!r}>"


def ptr_sig(dtype: Any) -> str:
    return "*" + SIG_DTYPE[dtype_name(dtype)]


# ---- persistent grids ------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: Any = None) -> int:
    """SM count of a torch device (or index, or a tunecache DeviceClass)."""
    if hasattr(device, "sm_count"):
        return int(device.sm_count)
    if isinstance(device, torch.device):
        device = device.index
    return _sm_count(torch.cuda.current_device() if device is None else int(device))


# the SM count of the usual part of each architecture (by compute capability major): H100 SXM, B200
USUAL_SM_COUNT = {9: 132, 10: 148}


def sm_count_of(device: Any) -> int:
    """The SM count a device class names, or, when it names none (0), the usual part's of its
    architecture (USUAL_SM_COUNT): what the persistent grids and split counts are sized for."""
    sms = int(getattr(device, "sm_count", 0) or 0)
    if sms > 0:
        return sms
    cap = getattr(device, "capability", None)
    return USUAL_SM_COUNT.get(cap[0] if cap else 9, USUAL_SM_COUNT[9])


def persistent_grid(num_tiles: int, sms: int, ctas_per_sm: int = 1) -> tuple[int]:
    """One CTA per SM (or per `ctas_per_sm` slot), never more CTAs than tiles."""
    return (max(1, min(num_tiles, sms * ctas_per_sm)),)


# ---- split-K -----------------------------------------------------------------------------------


def split_k_plan(k_iters: int, split_k: int) -> tuple[int, int]:
    """(active splits, k-iterations per split): every active split gets at least one iteration,
    so asking for more splits than iterations never launches empty work."""
    k_iters = max(1, k_iters)
    per = cdiv(k_iters, max(1, split_k))
    return cdiv(k_iters, per), per


def split_k_workspace(splits: int, rows: int, cols: int, device) -> torch.Tensor:
    """fp32 partials, one [rows, cols] slab per split. Every element is written by the GEMM
    kernel, so it is not zeroed."""
    return torch.empty((splits, rows, cols), device=device, dtype=torch.float32)


# the work model that picks SPLIT_K=0's split count: an SM's sustained MMA rate, the memory
# bandwidth the fp32 partials make a round trip through, the reduction launch. Measured on an
# H100; a B200's first two are each about twice as high, which leaves the model's choice nearly
# where it is (no Blackwell GPU has checked that)
_SM_FLOP_PER_US = 5.0e6
_BYTES_PER_US = 2.5e6
_REDUCE_LAUNCH_US = 4.0


def auto_splits(tiles: int, k_steps: int, sms: int, out_elems: int, c: dict) -> int:
    """SPLIT_K=0: the split count with the shortest modeled time, the slowest CTA's k-steps
    (whole waves of units over the SMs) plus the fp32 partials' round trip; the fewest splits
    within 2% of the best. A power of two is often a poor choice: 81 tiles x 2 splits = 162
    units is 1.2 waves on 132 SMs, x 8 = 648 units is 4.9."""
    step_us = 2 * c["BLOCK_M"] * c["BLOCK_N"] * c["BLOCK_K"] / _SM_FLOP_PER_US
    costs = {}
    for s in range(1, min(k_steps, 64) + 1):
        active, per = split_k_plan(k_steps, s)
        if active == s:
            t = cdiv(tiles * s, sms) * per * step_us
            costs[s] = t + (s > 1) * (s * out_elems * 8 / _BYTES_PER_US + _REDUCE_LAUNCH_US)
    best = min(costs.values())
    return min(s for s, t in costs.items() if t <= 1.02 * best)


def modeled_splits(c: dict, tiles: int, k_steps: int, out_elems: int, sms: int) -> tuple[int, int]:
    """(splits, k-steps per split) of an implicit-GEMM conv launch whose space has SPLIT_K 0 (the
    work model's count, auto_splits: where the tiles leave SMs idle) and 1 (never split)."""
    if c.get("SPLIT_K", 1) != 0:
        return 1, k_steps
    return split_k_plan(k_steps, auto_splits(tiles, k_steps, sms, out_elems, c))


def fprop_splits(p: dict, c: dict, sms: int) -> tuple[int, int]:
    """(splits, k-steps per split) of forward-conv config c on problem p, both backends' rule
    (modeled_splits); the packed-taps kernel never splits."""
    k_steps = p["R"] * p["S"] * cdiv(padded_channels(p["Ci"], p["dtype"]), c["BLOCK_K"])
    if packs_taps(p):
        return 1, k_steps
    tiles = cdiv(p["gemm_M"], c["BLOCK_M"]) * cdiv(p["Co"], c["BLOCK_N"])
    return modeled_splits(c, tiles, k_steps, p["gemm_M"] * padded_channels(p["Co"], p["dtype"]), sms)


def dgrad_splits(c: dict, stride, tiles: int, k_steps: int, out_elems: int, sms: int) -> tuple[int, int]:
    """(splits, k-steps per split) of a dgrad launch, both backends' rule (modeled_splits): only
    a stride-1 dgrad splits, its one phase's walk being grad_x's own pixels (the partials' layout)."""
    if tuple(stride) != (1, 1):
        return 1, k_steps
    return modeled_splits(c, tiles, k_steps, out_elems, sms)


def dgrad_problem_splits(p: dict, c: dict, sms: int) -> tuple[int, int]:
    """dgrad_splits of config c on problem p (a split launch has one phase: its tiles are the walk's)."""
    k_steps = p["R"] * p["S"] * cdiv(padded_channels(p["Co"], p["dtype"]), c["BLOCK_K"])
    p2, q2, _, _ = dgrad_walk(p)
    tiles = cdiv(p["N"] * p2 * q2, c["BLOCK_M"]) * cdiv(p["Ci"], c["BLOCK_N"])
    st = (p["stride_h"], p["stride_w"])
    return dgrad_splits(c, st, tiles, k_steps, p["N"] * p["H"] * p["W"] * p["Ci"], sms)


@gluon.jit
def next_conv_k(c0, r, s, Ci, R, S, BLOCK_K: gl.constexpr):
    """An implicit-GEMM conv's next k-step: (channel block, tap) advanced by one without
    dividing, channel blocks of a tap before the next tap; `done` when the tile's k-loop wraps."""
    c0 = c0 + BLOCK_K
    wrap_c = c0 >= Ci
    c0 = gl.where(wrap_c, 0, c0)
    s = gl.where(wrap_c, s + 1, s)
    wrap_s = s == S
    s = gl.where(wrap_s, 0, s)
    r = gl.where(wrap_s, r + 1, r)
    done = r == R
    r = gl.where(done, 0, r)
    return c0, r, s, done


# ---- split-K of a matmul: the rules both Gluon matmuls follow ---------------------------------


def matmul_tiles(p: dict, c: dict) -> int:
    return cdiv(p["M"], c["BLOCK_M"]) * cdiv(p["N"], c["BLOCK_N"])


def matmul_splits(p: dict, c: dict, sms: int) -> tuple[int, int]:
    """(splits, k-steps per split) of config c's launch on matmul p: SPLIT_K, or for 0 the work
    model's count (auto_splits), as split_k_plan runs it."""
    k_steps = cdiv(p["K"], c["BLOCK_K"])
    tiles = matmul_tiles(p, c)
    if c["SPLIT_K"]:
        want = c["SPLIT_K"]
    elif c.get("SWAP_AB"):
        # a swapped decode GEMM streams its weight: every SM that streams helps, and its
        # partials are a few rows, so the most splits that still run in one wave
        want = max(1, sms // tiles)
    else:
        want = auto_splits(tiles, k_steps, sms, p["M"] * p["N"], c)
    return split_k_plan(k_steps, want)


# ---- swap-AB: decode GEMMs as c^T = b^T a^T, the rule both Gluon matmuls follow ------------
#
# An MMA tile (WGMMA, tcgen05) is at least 64 rows: with M = 1 a 64-row tile computes 64 times
# the work and fills shared memory with zero rows. Swapped, the weight's N is the MMA's 64-row
# side and M its narrow side (8, 16 or 32 columns, the narrowest N the MMA takes that holds M),
# as cuBLAS runs M = 1 and 16 (64x8 tiles, H100). A config's SWAP_AB = 1 launches so; BLOCK_N
# then does not shape the launch (the narrow tile follows M), so only its 64 is tried.

SWAP_MAX_M = 32


def narrow_tile(M: int) -> int:
    """A swapped launch's tile over M: M rounded up to 8, 16 or 32."""
    return min(SWAP_MAX_M, max(8, pow2_at_least(M)))


def matmul_as_launched(c: dict, p: dict | None) -> tuple[dict, dict | None]:
    """(config, problem) as the kernel runs them: under SWAP_AB, M and N (and the operands)
    swapped and BLOCK_N the narrow tile over M (its widest, 32, without a problem)."""
    if not c.get("SWAP_AB"):
        return c, p
    flip = {"row": "col", "col": "row"}
    if p is None:
        return dict(c, BLOCK_N=SWAP_MAX_M), None
    q = dict(p, M=p["N"], N=p["M"])
    if "a_layout" in p:
        q.update(a_layout=flip[p["b_layout"]], b_layout=flip[p["a_layout"]])
    return dict(c, BLOCK_N=narrow_tile(p["M"])), q


def matmul_operands(a: torch.Tensor, b: torch.Tensor, swap: bool) -> tuple[bool, bool, bool, bool]:
    """(x_t, y_t, trans_a, trans_b) of a matmul launch: the kernel's operands are x, y = (b, a)
    swapped (its a is b^T, its b a^T), else (a, b); TMA tiles the row-major storage of each,
    x.t() if x_t else x (a transposed view, layout "col", is described as its transpose), and
    trans_a / trans_b say whether that storage holds the kernel's operand transposed."""
    from .problems import matrix_layout

    a_t = matrix_layout(a, "a") == "col" and a.shape[0] > 1
    b_t = matrix_layout(b, "b") == "col" and b.shape[1] > 1
    if swap:
        return b_t, a_t, not b_t, not a_t
    return a_t, b_t, a_t, b_t


def matmul_views(
    a: torch.Tensor, b: torch.Tensor, swap: bool, x_t: bool, y_t: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The row-major storages the kernel's a and b descriptors tile (matmul_operands' x_t, y_t)."""
    x, y = (b, a) if swap else (a, b)
    return (x.t() if x_t else x), (y.t() if y_t else y)


def matmul_swap_worth_trying(c: dict, p: dict) -> bool:
    """The swap-AB half of a matmul's worth_trying: swapped only for decode-sized M, and once
    per narrow tile (BLOCK_N 64 stands for it)."""
    return not c.get("SWAP_AB") or (p["M"] <= SWAP_MAX_M and c["BLOCK_N"] == 64)


def matmul_split_worth_trying(c: dict, p: dict, sms: int) -> bool:
    """The split-K half of a matmul's worth_trying: no split of a GEMM whose tiles fill the GPU,
    no SPLIT_K=0 where the model does not split (the same launch as 1), no explicit count that
    launches as a smaller one (fewer k-steps than splits) or as the model's own."""
    if c["SPLIT_K"] == 1:
        return True
    if matmul_tiles(p, c) >= sms:
        return False  # the tiles fill the GPU: splitting only adds the partials' round trip
    model = matmul_splits(p, dict(c, SPLIT_K=0), sms)[0]
    if c["SPLIT_K"] == 0:
        return model > 1
    return matmul_splits(p, c, sms)[0] == c["SPLIT_K"] != model


def split_binary(c: dict, splits: int) -> bool:
    """Whether a matmul launch runs its split binary: always for SPLIT_K >= 2 (so the config
    alone decides its binary and its shared memory), for 0 where the model splits."""
    return c["SPLIT_K"] >= 2 or splits > 1


_NO_SPLIT_WS: dict = {}


def no_split_workspace(device) -> torch.Tensor:
    """The workspace argument of an unsplit launch (never read or written): one fp32 tensor per
    device, so the unsplit binary's signature is the split one's."""
    ws = _NO_SPLIT_WS.get(device)
    if ws is None:
        ws = _NO_SPLIT_WS[device] = torch.empty(4, device=device, dtype=torch.float32)
    return ws


KEPT_STREAMS = 8  # the (device, stream) pairs a per-stream buffer is kept for


def _per_stream(kept: dict, device, stream: int, numel: int, make: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """The buffer `kept` holds for (device, stream), of at least `numel` elements; `make(numel)`
    makes one where it is missing or too small. Shared by the launches on one stream (they run
    in order). At most KEPT_STREAMS streams' buffers are kept (a program making streams as it
    goes keeps only the recent ones)."""
    key = (device, stream)
    buf = kept.get(key)
    if buf is None or buf.numel() < numel:
        if buf is None and len(kept) >= KEPT_STREAMS:
            kept.clear()
        buf = kept[key] = make(numel)
    return buf


_WORKSPACES: dict = {}

# a planned split launch's fp32 partials up to this many bytes come from a buffer kept per
# stream (stream_workspace); larger ones are allocated per call (their kernels are long enough
# that the allocation's host time is hidden, and a kept one would pin that memory)
KEPT_WORKSPACE_BYTES = 16 << 20


def stream_workspace(like: torch.Tensor, stream: int, shape: tuple) -> torch.Tensor:
    """Room for fp32 split-K partials of `shape`, for a planned launch on `stream` (which takes
    its address: the tensor may be larger, and is not shaped). Up to KEPT_WORKSPACE_BYTES, one
    buffer per (device, stream), grown as needed: safe to share, as the split kernel writes
    every element its reduction reads (split_k_workspace) and launches on one stream run in
    order; it saves an allocation's host time, which is a batch-1 layer's. Larger, and under
    CUDA-graph capture (a graph's replays must not share one with work outside it), a fresh one."""
    numel = math.prod(shape)
    if numel * 4 > KEPT_WORKSPACE_BYTES or torch.cuda.is_current_stream_capturing():
        return like.new_empty(shape, dtype=torch.float32)
    return _per_stream(
        _WORKSPACES, like.device, stream, numel, lambda n: like.new_empty(max(n, 1 << 16), dtype=torch.float32)
    )


_COUNTERS: dict = {}


def zeroed_counters(device, stream: int, n: int) -> torch.Tensor:
    """At least `n` zeroed int32 counters for a kernel that leaves them zeroed: the matmuls'
    per-tile split arrivals (finish_split_tile), the wgrad's stream-K flags. One buffer per
    (device, stream) serves every such launch (_per_stream). Under CUDA-graph capture each
    launch gets a fresh buffer, its zeroing captured with it: a graph's replays cannot count on
    what ran outside it. `device`: a tensor's (a torch.device), called on every launch, so
    nothing here is rebuilt per call."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(max(n, 1), device=device, dtype=torch.int32)
    return _per_stream(
        _COUNTERS,
        device,
        stream,
        n,
        lambda k: torch.zeros(max(1024, pow2_at_least(k)), device=device, dtype=torch.int32),
    )


@gluon.jit
def init_ring(bars, count: gl.constexpr = 1):
    """Initialize a ring of mbarriers ([NUM, 1] in shared memory), each expecting `count` arrivals."""
    NUM: gl.constexpr = bars.shape[0]
    for i in gl.static_range(NUM):
        mbarrier.init(bars.index(i), count=count)


@gluon.jit
def invalidate_ring(bars):
    NUM: gl.constexpr = bars.shape[0]
    for i in gl.static_range(NUM):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def finish_split_tile(
    ws_tile,
    c_tile,
    counter,
    rows_left,
    cols_left,
    LDW,
    split_stride,
    SPLITS,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
):
    """Once this CTA's fp32 partial of a tile is in the workspace (at ws_tile, split s at
    s * split_stride): count in on the tile's counter (zeroed_counters); the split that arrives
    last sums the SPLITS partials in split order (deterministic) into c (at c_tile, c's dtype)
    and zeroes the counter for the next launch. The matmul kernels' split epilogue: one
    launch, where a second reduction kernel cost a decode GEMM of 20 us another 3-4 (H100)."""
    # every warp's partial is out before the CTA counts itself in (release, GPU scope); the
    # last split sees them all (acquire) and reads them past L1 (.cg): other SMs wrote them
    gl.barrier()
    arrived = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLITS - 1:
        # a few rows at a time, coalesced: beside the accumulator, a whole tile's sum, loads
        # and offsets would spill
        # rows a pass: 16 values a thread at 4 warps, no more than the tile's rows
        CHUNK: gl.constexpr = 2048 // BLOCK_N if 2048 // BLOCK_N < BLOCK_M else BLOCK_M
        TN: gl.constexpr = 32 if BLOCK_N >= 128 else BLOCK_N // 4
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TN, TN], [gl.num_warps(), 1], [1, 0])
        rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        col_ok = cols[None, :] < cols_left
        for r0 in range(0, gl.minimum(rows_left, BLOCK_M), CHUNK):
            offs = (r0 + rows)[:, None] * LDW + cols[None, :]
            mask = ((r0 + rows)[:, None] < rows_left) & col_ok
            total = gl.zeros([CHUNK, BLOCK_N], gl.float32, layout)
            for s in range(SPLITS):
                total += gl.load(ws_tile + s * split_stride + offs, mask=mask, other=0.0, cache_modifier=".cg")
            gl.store(c_tile + offs, total.to(c_tile.dtype.element_ty), mask=mask)
        gl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@gluon.jit(do_not_specialize=["numel", "splits"])  # one binary for every split count and size
def split_k_reduce_kernel(ws_ptr, out_ptr, numel, splits, BLOCK: gl.constexpr, num_warps: gl.constexpr):
    """out[i] = sum_s ws[s, i] in a fixed order (deterministic), cast to out's dtype. Each pass
    loads SPLITS_AT_ONCE splits of the CTA's BLOCK outputs and the passes are summed at the end:
    a small output split many ways (the packed-taps wgrad, a 1x1 wgrad over 100k pixels) would
    otherwise wait out one load per split. The warps that BLOCK (split_k_reduce_block) does not
    spread over the outputs go over the splits: a deep pass where outputs are few."""
    PER_THREAD: gl.constexpr = 8
    WARPS_N: gl.constexpr = min(num_warps, BLOCK // 128)
    WARPS_S: gl.constexpr = num_warps // WARPS_N
    SPLITS_AT_ONCE: gl.constexpr = PER_THREAD * WARPS_S
    layout: gl.constexpr = gl.BlockedLayout([PER_THREAD, 4], [1, 32], [WARPS_S, WARPS_N], [1, 0])
    pid = gl.program_id(0)
    offs = pid.to(gl.int64) * BLOCK + gl.arange(0, BLOCK, gl.SliceLayout(0, layout)).to(gl.int64)
    rows = gl.arange(0, SPLITS_AT_ONCE, gl.SliceLayout(1, layout))
    mask = offs < numel
    acc = gl.zeros([SPLITS_AT_ONCE, BLOCK], gl.float32, layout)
    for s0 in range(0, splits, SPLITS_AT_ONCE):
        s = s0 + rows
        ok = (s < splits)[:, None] & mask[None, :]
        acc += gl.load(ws_ptr + s.to(gl.int64)[:, None] * numel + offs[None, :], mask=ok, other=0.0)
    gl.store(out_ptr + offs, gl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=mask)


SPLIT_K_REDUCE_WARPS = 4


def split_k_reduce_block(numel: int, sms: int) -> int:
    """The reduction's outputs per CTA: 1024 (its warps side by side over the outputs, 8 splits
    a pass) while that still gives every SM a CTA, else 128 (the warps over the splits, 32 a
    pass). H100, 4096 outputs: 132 splits 20.2 -> 3.3 us, 32 splits 5.9 -> 1.6; 3.2M outputs x 2
    splits stay wide (18 us; the deep pass would take 45)."""
    return 1024 if cdiv(numel, 1024) >= sms else 128


def split_k_reduce(ws: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Sum the [splits, ...] fp32 workspace into contiguous `out` (same element count per split)."""
    split_k_reduce_jit(ws, out)
    return out


def split_k_reduce_jit(ws: torch.Tensor, out: torch.Tensor):
    """split_k_reduce through JITFunction.run; returns the CompiledKernel it launched, which a
    DirectLauncher can launch again for the same (dtype, numel, splits)."""
    assert out.is_contiguous() and ws.is_contiguous()
    numel = out.numel()
    assert ws.numel() == ws.shape[0] * numel
    block = split_k_reduce_block(numel, num_sms(out.device))
    return split_k_reduce_kernel[(cdiv(numel, block),)](
        ws, out, numel, ws.shape[0], BLOCK=block, num_warps=SPLIT_K_REDUCE_WARPS
    )


class SplitReduce:
    """A planned split-K launch's second pass (the plans of gluon_launch): the fp32 workspace
    [splits, ...] the kernel fills and the split_k_reduce launch that sums it into the output."""

    __slots__ = ("launcher", "ws_shape", "grid0", "tail")

    @classmethod
    def of(cls, compiled, ws: torch.Tensor, out: torch.Tensor) -> "SplitReduce | None":
        """From the reduction's first (JIT) launch over ws into out; None where Triton's
        launcher cannot take it directly (the plan is then not made)."""
        from .gluon_launch import DirectLauncher

        launcher = DirectLauncher.of(compiled)
        if launcher is None:
            return None
        r = cls()
        r.launcher, r.ws_shape = launcher, tuple(ws.shape)
        block = split_k_reduce_block(out.numel(), num_sms(out.device))
        r.grid0 = cdiv(out.numel(), block)
        r.tail = (out.numel(), ws.shape[0], block, SPLIT_K_REDUCE_WARPS)  # the constexprs last, in order
        return r

    def workspace(self, like: torch.Tensor, stream: int) -> torch.Tensor:
        """The split kernel's partials (stream_workspace: launches take its address)."""
        return stream_workspace(like, stream, self.ws_shape)

    def __call__(self, stream: int, ws: torch.Tensor, out: torch.Tensor) -> None:
        self.launcher(self.grid0, stream, (ws.data_ptr(), out.data_ptr(), *self.tail))  # ints: no driver query


def wgrad_out_numel(p: dict, gathers: bool = False) -> int:
    """Elements of a wgrad launch's grad_w [Co, R, S, Ci] (its split-K reduction's outputs), Ci
    padded for TMA unless a gathering kernel (packed taps; few output channels: `gathers`) runs it."""
    ci = p["Ci"] if packs_taps(p) or gathers else padded_channels(p["Ci"], p["dtype"])
    return p["Co"] * p["R"] * p["S"] * ci


def split_k_reduce_spec(out_dtype: Any, numel: int, sms: int) -> KernelSpec:
    """The reduction's compile for `numel` outputs on `sms` SMs (split_k_reduce_block), for
    CPU-only checks of a backend's compile_specs."""
    return KernelSpec(
        fn=split_k_reduce_kernel,
        signature={
            "ws_ptr": "*fp32",
            "out_ptr": ptr_sig(out_dtype),
            "numel": "i32",
            "splits": "i32",
            "BLOCK": "constexpr",
            "num_warps": "constexpr",
        },
        constexprs={"BLOCK": split_k_reduce_block(numel, sms), "num_warps": SPLIT_K_REDUCE_WARPS},
        num_warps=SPLIT_K_REDUCE_WARPS,
        name="split_k_reduce",
    )


# ---- the wgrad kernels' division of work: split-K and stream-K ------------------------------

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


# ---- conv dgrad by output phase: the geometry both dgrad kernels walk ----------------------------
# At stride sh x sw, grad_x's rows a::sh, columns b::sw (one output phase) are reached only by
# the filter taps r0::sh, s0::sw; a phase is named by its first taps (kr0, ks0), kr0 < min(R, sh).


@gluon.jit
def dgrad_phase(phase, PS, R, S, H, W, stride_h, stride_w, pad_h, pad_w):
    """Phase `phase` (its first taps (kr0, ks0) = divmod(phase, PS)) -> (kr0, ks0, the grad_x row
    and column it starts at (a, b), its taps (kr, ks), the grad_out row and column its first tap
    reads for output (0, 0) (ca, cb), its rows and columns of grad_x)."""
    kr0 = phase // PS
    ks0 = phase % PS
    a = ((kr0 - pad_h) % stride_h + stride_h) % stride_h
    b = ((ks0 - pad_w) % stride_w + stride_w) % stride_w
    kr = (R - kr0 + stride_h - 1) // stride_h
    ks = (S - ks0 + stride_w - 1) // stride_w
    ca = (a + pad_h - kr0) // stride_h
    cb = (b + pad_w - ks0) // stride_w
    rows = (H - a + stride_h - 1) // stride_h
    cols = (W - b + stride_w - 1) // stride_w
    return kr0, ks0, a, b, kr, ks, ca, cb, rows, cols


def dgrad_halo(taps: int, stride: int, pad: int) -> int:
    """Rows (or columns) of grad_out the shared im2col walk must start before output row 0 so
    that every phase's first tap is a non-negative offset from it."""
    need = 0
    for kr0 in range(min(taps, stride)):
        a = (kr0 - pad) % stride
        kr = -(-(taps - kr0) // stride)
        need = max(need, kr - 1 - (a + pad - kr0) // stride)
    return need


def dgrad_walk(p: dict) -> tuple[int, int, int, int]:
    """(rows, columns) of the walk every phase shares (the largest phase's), and its halo."""
    sh, sw = p["stride_h"], p["stride_w"]
    return -(-p["H"] // sh), -(-p["W"] // sw), dgrad_halo(p["R"], sh, p["pad_h"]), dgrad_halo(p["S"], sw, p["pad_w"])


def dgrad_phases(p: dict, zero_phases: bool = False) -> int:
    """Phases a dgrad kernel walks: those some tap reaches (the others, where a filter is smaller
    than its stride, are zeros the host writes), or with zero_phases every one of the stride's
    (the kernel stores those zeros itself)."""
    sh, sw = p["stride_h"], p["stride_w"]
    return sh * sw if zero_phases else min(p["R"], sh) * min(p["S"], sw)


def dgrad_store_vec(ci: int, dtype) -> int:
    """Channels a thread stores at once in the pointer epilogue: up to 16 bytes, as many as
    divide a pixel's row (Ci = 4: 8-byte stores; Ci = 3: 2-byte ones)."""
    v = tma_multiple(dtype)
    while ci % v:
        v //= 2
    return v


def dgrad_tma_store_ok(p: dict) -> bool:
    """Stride 1: one phase, whose walk is grad_x's own pixels, so the epilogue is a TMA store of
    grad_x viewed [N*H*W, Ci] (its rows 16-byte aligned)."""
    return (p["stride_h"], p["stride_w"]) == (1, 1) and p["Ci"] % tma_multiple(p["dtype"]) == 0


# the dgrad kernels' integer arguments, in order (each backend adds its GROUP_M after them)
DGRAD_INT_ARGS = ("M2", "Ci", "Co", "Ciw", "R", "S", "H", "W", "PQ2", "Q2", "stride_h", "stride_w")
DGRAD_INT_ARGS += ("pad_h", "pad_w", "PH", "PW", "PS", "n_phases")


class DgradGeometry:
    """What a dgrad kernel's host derives from grad_out [N, P, Q, Co], w [Co, R, S, Ci] and the
    forward call's H, W, stride and padding, the same for both Gluon backends: the channel
    counts TMA reads (grad_out's Co padded to 16 bytes; w's Ci padded where its rows [R*S*Ci]
    break the 16-byte rule: those extra columns are output channels past Ci, never stored),
    the phases' shared walk, which epilogue and A operand apply, and the kernel's integers."""

    def __init__(self, g_shape, w_shape, H: int, W: int, stride, padding, dtype, zero_phases: bool = False) -> None:
        N, P, Q, Co = (int(v) for v in g_shape)
        _, R, S, Ci = (int(v) for v in w_shape)
        (sh, sw), (ph, pw) = stride, padding
        p = {"H": H, "W": W, "R": R, "S": S, "Ci": Ci, "dtype": dtype_name(dtype)}
        p.update({"stride_h": sh, "stride_w": sw, "pad_h": ph, "pad_w": pw})
        self.N, self.P, self.Q, self.Co, self.R, self.S, self.Ci, self.H, self.W = N, P, Q, Co, R, S, Ci, H, W
        self.stride = (sh, sw)
        self.co = padded_channels(Co, dtype)
        self.ciw = Ci if (R * S * Ci) % tma_multiple(dtype) == 0 else padded_channels(Ci, dtype)
        self.p2, self.q2, self.halo_h, self.halo_w = dgrad_walk(p)
        self.im2col = (R, S, sh, sw, ph, pw) != (1, 1, 1, 1, 0, 0)
        self.tma_store = dgrad_tma_store_ok(p)
        self.vec = dgrad_store_vec(Ci, dtype)
        # phases no tap reaches (a filter smaller than its stride) are zeros: written by the host
        # before the launch, or with zero_phases by the kernel, which then walks every phase
        self.zeros = (R < sh or S < sw) and not zero_phases
        self.phases, ps = dgrad_phases(p, zero_phases), sw if zero_phases else min(S, sw)
        self.m2 = N * self.p2 * self.q2
        self.ints = (self.m2, Ci, self.co, self.ciw, R, S, H, W, self.p2 * self.q2, self.q2, sh, sw, ph, pw)
        self.ints += (self.halo_h, self.halo_w, ps, self.phases)

    def g_desc(self, g: torch.Tensor, block: Sequence[int]):
        """grad_out (channels padded) as the A operand: the phases' im2col walk, or the plain
        [N*P*Q, Co] matrix of a pointwise 1x1."""
        if not self.im2col:
            return tiled_desc(g.view(self.N * self.P * self.Q, self.co), block)
        return im2col_desc(g, block, stride=(1, 1), padding=(self.halo_h, self.halo_w), out_hw=(self.p2, self.q2))

    def w_desc(self, w: torch.Tensor, block: Sequence[int]):
        """w (Ci padded) as [Co, R*S*Ciw], read in [BLOCK_K (Co), BLOCK_N (Ci)] tiles."""
        return tiled_desc(w.view(self.Co, self.R * self.S * self.ciw), block)

    def new_grad_x(self, like: torch.Tensor) -> torch.Tensor:
        shape = (self.N, self.H, self.W, self.Ci)
        return (torch.zeros if self.zeros else torch.empty)(shape, device=like.device, dtype=like.dtype)

    def tiles(self, block_m: int, block_n: int) -> int:
        return self.phases * -(-self.m2 // block_m) * -(-self.Ci // block_n)

    def splits(self, c: dict, sms: int) -> tuple[int, int]:
        """(splits, k-steps per split) of config c's launch (dgrad_splits); unsplit, the k-steps
        cover every phase's."""
        k_steps = self.R * self.S * cdiv(self.co, c["BLOCK_K"])
        out_elems = self.N * self.H * self.W * self.Ci  # grad_x
        return dgrad_splits(c, self.stride, self.tiles(c["BLOCK_M"], c["BLOCK_N"]), k_steps, out_elems, sms)


# ---- packed taps: the im2col of a conv with few input channels ----------------------------------
# With Ci <= 8 a tap's channels fill at most half of WGMMA's and tcgen05's smallest k-step (16),
# so a k-loop over taps multiplies mostly zeros (the 7x7 stem, Ci = 3 padded to 8 and walked at
# BLOCK_K = 16, does 5.3x the work). Packing the taps makes K = R*S*Ci one dense dimension,
# k = (r*S + s)*Ci + c; TMA cannot gather such a tile, so it is loaded through pointers (for a
# given r, the (s, c) run is contiguous in x) and stored to shared memory for the MMA.

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
    k = w[0].numel()
    return pad_last_dim(w.reshape(co, k), round_up(k, tma_multiple(w.dtype)))


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


# the packed kernels' integer arguments, in order (both backends)
PACKED_FPROP_INTS = ("M", "Co", "Ci", "K", "SCi", "H", "W", "PQ", "Q", "stride_h", "stride_w", "pad_h", "pad_w")
PACKED_FPROP_INTS += ("GROUP_M",)
PACKED_WGRAD_INTS = ("Co", "Ci", "K", "SCi", "H", "W", "PQ", "Q", "stride_h", "stride_w", "pad_h", "pad_w", "NPQ")
PACKED_WGRAD_INTS += ("k_steps", "per")


def packed_fprop_ints(x_shape, w_shape, stride, padding, PQ: tuple[int, int], group_m: int) -> tuple:
    """A packed fprop kernel's PACKED_FPROP_INTS."""
    N, H, W, Ci = (int(v) for v in x_shape)
    Co, R, S, _ = (int(v) for v in w_shape)
    P, Q = PQ
    return (N * P * Q, Co, Ci, R * S * Ci, S * Ci, H, W, P * Q, Q, *stride, *padding, group_m)


def packed_wgrad_ints(x_shape, g_shape, R: int, S: int, stride, padding, c: dict, sms: int) -> tuple:
    """A packed wgrad kernel's PACKED_WGRAD_INTS, its grid and its split count."""
    N, H, W, Ci = (int(v) for v in x_shape)
    _, P, Q, Co = (int(v) for v in g_shape)
    K, npq = R * S * Ci, N * P * Q
    tiles, k_steps, splits, per = packed_wgrad_work(Co, K, npq, c, sms)
    ints = (Co, Ci, K, S * Ci, H, W, P * Q, Q, *stride, *padding, npq, k_steps, per)
    return ints, tiles * splits, splits


@gluon.constexpr_function
def packed_gather_layout(BLOCK_K, num_warps):
    """Threads along k in runs of 8 (one 16-byte shared-memory store each), warps along rows."""
    tpw_k = max(1, min(32, BLOCK_K // 8))
    return gl.BlockedLayout([1, BLOCK_K // tpw_k], [32 // tpw_k, tpw_k], [num_warps, 1], [1, 0])


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


def few_co_wgrad_specs(fn, p: dict, c: dict, constexprs: dict, device) -> list[KernelSpec]:
    """compile_specs of a backend's few-Co kernel `fn` (and its reduction where it splits)."""
    dt = p["dtype"]
    x_shape, g_shape = (p["N"], p["H"], p["W"], p["Ci"]), (p["N"], p["P"], p["Q"], p["Co"])
    st, pd = (p["stride_h"], p["stride_w"]), (p["pad_h"], p["pad_w"])
    sms = sm_count_of(device)
    _, _, splits = few_co_wgrad_ints(x_shape, g_shape, p["R"], p["S"], st, pd, c, sms)
    sig = {"x_desc": desc_sig(dt, [c["BLOCK_K"], c["BLOCK_M"]]), "g_ptr": ptr_sig(dt)}
    sig["out_ptr"] = ptr_sig(dt) if splits == 1 else "*fp32"
    sig.update({k: "i32" for k in FEW_CO_WGRAD_INTS})
    sig.update({k: "constexpr" for k in constexprs})
    specs = [KernelSpec(fn=fn, signature=sig, constexprs=constexprs, num_warps=c["num_warps"], name=fn.__name__)]
    return specs + ([split_k_reduce_spec(dt, wgrad_out_numel(p, gathers=True), sms)] if splits > 1 else [])


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


# ---- candidate order ------------------------------------------------------------------------


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tap_k_step(channels: int) -> int:
    """The K step a conv's candidate order leads with: 64, or 32 where a filter tap's channels
    are a multiple of 32 but not of 64. Inception's 160 channels in steps of 64 pad each tap to
    192, a sixth of every MMA on zeros: on an H100 all 15 fastest configs of its 7x1 dgrad stepped
    32 (256x64x32 16.1 us, every 64-step config over 18.8), the best past the capped tune's 48."""
    return 32 if channels > 64 and channels % 64 == 32 else 64


def ring_shortfall(configs: list[dict], ring: str) -> Callable[[dict], int]:
    """c -> how many stages c's ring (the parameter `ring`) is short of the deepest ring among
    `configs` that agree with c on everything else: 0 for each tile's deepest fitting ring,
    which the backends' candidate orders time first."""

    def rest(c: dict) -> tuple:
        return tuple(sorted((k, v) for k, v in c.items() if k != ring))

    deepest: dict[tuple, int] = {}
    for c in configs:
        deepest[rest(c)] = max(deepest.get(rest(c), 0), c[ring])
    return lambda c: deepest[rest(c)] - c[ring]
