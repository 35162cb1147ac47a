"""Timing a launch: CUDA events with an L2 flush on a GPU, the wall clock on the interpreter."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def time_ms(fn: Callable[[], object], on_gpu: bool, *, warmup_ms: float = 25, rep_ms: float = 100,
            cpu_reps: int = 3) -> float:
    """Median milliseconds of one call of `fn`."""
    if on_gpu:
        from triton.testing import do_bench

        # do_bench times with CUDA events, clears L2 between runs, returns the median
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    samples = []
    for _ in range(cpu_reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)
