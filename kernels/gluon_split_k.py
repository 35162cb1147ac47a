"""Split-K as both Gluon backends run it: the plan (active splits, k-steps per split), the fp32
workspace, the work model that picks SPLIT_K=0's split count (modeled_splits: the convs' rule),
the deterministic second pass (split_k_reduce: the partials summed in a fixed order, so the
same inputs always give the same bits, unlike atomics) and the zeroed per-stream counters of
the kernels that reduce in their own epilogue.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from . import KernelSpec
from . import gluon_host as gh
from .gluon_host import cdiv, pow2_at_least, ptr_sig


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


_NO_SPLIT_WS: dict = {}


def no_split_workspace(device) -> torch.Tensor:
    """The workspace argument of an unsplit launch (never read or written): one fp32 tensor per
    device, so the unsplit binary's signature is the split one's."""
    ws = _NO_SPLIT_WS.get(device)
    if ws is None:
        ws = _NO_SPLIT_WS[device] = gh.kept_buffer(device, lambda: torch.empty(4, device=device, dtype=torch.float32))
    return ws


# ---- the second pass -------------------------------------------------------------------------


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
    block = split_k_reduce_block(numel, gh.num_sms(out.device))  # through gh: where a CPU-only test sets the SM count
    return split_k_reduce_kernel[(cdiv(numel, block),)](
        ws, out, numel, ws.shape[0], BLOCK=block, num_warps=SPLIT_K_REDUCE_WARPS
    )


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


# ---- buffers kept per stream -----------------------------------------------------------------


KEPT_STREAMS = 8  # the (device, stream) pairs a per-stream buffer is kept for


def per_stream(kept: dict, device, stream: int, numel: int, make: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """The buffer `kept` holds for (device, stream), of at least `numel` elements; `make(numel)`
    makes one where it is missing or too small. Shared by the launches on one stream (they run
    in order). At most KEPT_STREAMS streams' buffers are kept (a program making streams as it
    goes keeps only the recent ones). Made outside CUDA-graph pools (gluon_host.kept_buffer)."""
    key = (device, stream)
    buf = kept.get(key)
    if buf is None or buf.numel() < numel:
        if buf is None and len(kept) >= KEPT_STREAMS:
            kept.clear()
        buf = kept[key] = gh.kept_buffer(device, lambda: make(numel))
    return buf


_COUNTERS: dict = {}


def zeroed_counters(device, stream: int, n: int) -> torch.Tensor:
    """At least `n` zeroed int32 counters for a kernel that leaves them zeroed: the matmuls'
    per-tile split arrivals (finish_split_tile), the wgrad's stream-K flags. One buffer per
    (device, stream) serves every such launch (per_stream). Under CUDA-graph capture each
    launch gets a fresh buffer, its zeroing captured with it: a graph's replays cannot count on
    what ran outside it. `device`: a tensor's (a torch.device), called on every launch, so
    nothing here is rebuilt per call."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(max(n, 1), device=device, dtype=torch.int32)
    return per_stream(
        _COUNTERS,
        device,
        stream,
        n,
        lambda k: torch.zeros(max(1024, pow2_at_least(k)), device=device, dtype=torch.int32),
    )
