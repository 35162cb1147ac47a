"""Library calls that miss: a matmul of a shape no call saw before, and its key (the breaker's and
the stuck neighbour's tests time them)."""

from __future__ import annotations

import time

import torch


def timed_miss(i: int) -> float:
    """One library call on a shape not seen before (a miss past the memo), checked; its seconds."""
    from tunecache import ops

    a, b = torch.randn(8 + i, 8), torch.randn(8, 8)
    t0 = time.perf_counter()
    out = ops.matmul(a, b)
    elapsed = time.perf_counter() - t0
    torch.testing.assert_close(out, a @ b)
    return elapsed


def miss_key(i: int):
    """The key of `timed_miss(i)` on the portable backend and the CPU interpreter."""
    from tunecache import backends
    from tunecache.key import interpreter_device
    from tunecache.tuning.tuner import make_key
    from tunecache_kernels import problems

    p = problems.matmul_problem(torch.empty(8 + i, 8, device="meta"), torch.empty(8, 8, device="meta"))
    return make_key(backends.backend_module("matmul", "portable"), p, interpreter_device())
