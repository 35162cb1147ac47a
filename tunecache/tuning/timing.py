"""Timing a launch: CUDA events with an L2 flush on a GPU, the wall clock on the interpreter.

`time_ms` times the ops' candidates (in the isolated trial runner) and the benchmarks;
`wall_clock_bench` is `@tunecache.autotune`'s `do_bench` on the interpreter.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Hashable, Mapping, Sequence

# How candidates are timed when a tuning run chooses (the ops' tuner and the drop-in alike):
# each in a quick round (short warm-up and repetition, enough to rank), then the leaders (within
# LEADER_FACTOR of the quick best, at most MAX_LEADERS) again with a longer warm-up and repetition (SETTLE_*).
QUICK_WARMUP_MS, QUICK_REP_MS = 2, 10
SETTLE_WARMUP_MS, SETTLE_REP_MS = 10, 50
LEADER_FACTOR = 1.10
MAX_LEADERS = 8
MAX_SETTLED = 2 * MAX_LEADERS
# where the tune's best kernel or the vendor's op takes less GPU time than HOST_BOUND_MS, both
# are timed again as LOOP_CALLS calls back to back (`loop_ms`): a call that short runs at the
# host's pace, and a loop of layers waits on each call's launch, which do_bench does not see
HOST_BOUND_MS = 0.05
LOOP_CALLS = 100


def leaders(quick_ms: Mapping[Hashable, float]) -> list:
    """The candidates worth a full timing, fastest first, from their quick-round times."""
    finite = {c: ms for c, ms in quick_ms.items() if math.isfinite(ms)}
    if not finite:
        return []
    best = min(finite.values())
    return sorted((c for c, ms in finite.items() if ms <= LEADER_FACTOR * best), key=finite.get)[:MAX_LEADERS]


def settle(
    quick_ms: Mapping[Hashable, float], time_fn: Callable[[Hashable], float | None], also: Sequence[Hashable] = ()
) -> dict:
    """Time the quick round's leaders (and `also`) again with `time_fn` (None: it failed);
    then every candidate whose quick time lies within LEADER_FACTOR of the settled best, until
    none is left or MAX_SETTLED were timed: a quick time can be low by luck (a cool GPU's boost
    clock at the start of a round) and keep the real leaders out. Returns candidate -> time."""
    done: dict = {}
    todo = [*leaders(quick_ms), *also]
    while todo:
        for c in todo:
            if c not in done:
                done[c] = time_fn(c)
        times = [ms for ms in done.values() if ms is not None and math.isfinite(ms)]
        if not times or len(done) >= MAX_SETTLED:
            break
        best = min(times)
        near = [c for c, ms in quick_ms.items() if c not in done and ms <= LEADER_FACTOR * best]
        todo = sorted(near, key=quick_ms.get)[: MAX_SETTLED - len(done)]
    return done


def time_ms(
    fn: Callable[[], object],
    on_gpu: bool,
    *,
    warmup_ms: float = 25,
    rep_ms: float = 100,
    cpu_reps: int = 3,
    loop_calls: int = 0,
) -> float:
    """Median milliseconds of one call of `fn` (with `loop_calls` on a GPU: `loop_ms`)."""
    if on_gpu and loop_calls:
        return loop_ms(fn, loop_calls)
    if on_gpu:
        from triton.testing import do_bench

        # do_bench times with CUDA events, clears L2 between runs, returns the median
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    return statistics.median(wall_clock_ms(fn, cpu_reps))


def loop_ms(fn: Callable[[], object], calls: int = LOOP_CALLS, batches: int = 5) -> float:
    """Milliseconds per call of `calls` calls of `fn` back to back, synchronized only at the
    end (the median of `batches`): the GPU's time or the host's, whichever is longer, as a
    training or inference loop sees it."""
    import torch

    fn()
    out = []
    for _ in range(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(out)


def wall_clock_ms(fn: Callable[[], object], reps: int) -> list[float]:
    """Milliseconds of each of `reps` calls of `fn`, by the wall clock."""
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def wall_clock_bench(fn: Callable[[], Any], quantiles: Sequence[float] | None = None, reps: int = 3) -> Any:
    """`triton.testing.do_bench` for the interpreter: one untimed call, then the wall clock over
    `reps` calls; the median, or the `quantiles` Triton asks for."""
    fn()
    samples = wall_clock_ms(fn, reps)
    if quantiles is None:
        return statistics.median(samples)
    samples.sort()
    return [_quantile(samples, q) for q in quantiles]


def _quantile(sorted_samples: list[float], q: float) -> float:
    pos = q * (len(sorted_samples) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_samples) - 1)
    return sorted_samples[lo] + (sorted_samples[hi] - sorted_samples[lo]) * (pos - lo)
