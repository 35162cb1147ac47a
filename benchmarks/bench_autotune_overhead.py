"""Per-call cost of a memo hit: `tunecache.autotune` vs `triton.autotune` vs a plain jit launch.

A tiny kernel (an add-one over 4096 floats, far shorter on the GPU than its launch) is
launched many times through each of the three, after tuning, so the wall clock per call is
the host's cost: the autotuner's key and memo lookup on top of the jit launch itself.

    python benchmarks/bench_autotune_overhead.py [--calls 20000] [--rounds 9] [--out PATH]

Prints the per-call microseconds, the ratio tunecache / triton and each one's overhead over
the plain launch; writes JSON to benchmarks/results/autotune_overhead.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000, help="launches per timed round")
    ap.add_argument("--rounds", type=int, default=9, help="timed rounds per variant (interleaved)")
    ap.add_argument("--n", type=int, default=4096, help="elements of the tensor")
    ap.add_argument("--out", type=Path, default=RESULTS / "autotune_overhead.json")
    args = ap.parse_args()

    # a throwaway store: the benchmark must not leave entries in the user's cache
    tmp = tempfile.mkdtemp(prefix="tunecache-bench-")
    os.environ.setdefault("TUNECACHE_DB_URL", f"sqlite:///{tmp}/store.sqlite")

    import torch
    import triton
    import triton.language as tl

    import tunecache

    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    device = "cpu" if interpret else "cuda"
    sync = (lambda: None) if interpret else torch.cuda.synchronize

    @triton.jit
    def add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)

    configs = [triton.Config({"BLOCK": 256}, num_warps=2), triton.Config({"BLOCK": 1024}, num_warps=4)]
    bench = {}
    if interpret:  # a smoke run: triton.autotune finds no benchmarker there, so it gets ours
        from tunecache.tuning.timing import wall_clock_bench

        bench = {"do_bench": wall_clock_bench}
    by_triton = triton.runtime.autotuner.autotune(configs=configs, key=["n"], **bench)(add_one)
    by_tunecache = tunecache.autotune(configs=configs, key=["n"], **bench)(add_one)

    n = args.n
    x = torch.randn(n, device=device)
    y = torch.empty_like(x)
    grid = lambda META: (triton.cdiv(n, META["BLOCK"]),)  # noqa: E731 - as a user writes it

    first_call_ms = {}
    for name, kernel in (("triton_autotune", by_triton), ("tunecache_autotune", by_tunecache)):
        sync()
        t0 = time.perf_counter()
        kernel[grid](x, y, n)  # tunes (and, for tunecache, stores)
        sync()
        first_call_ms[name] = (time.perf_counter() - t0) * 1e3
        assert torch.equal(y, x + 1), name
    # a second decorator over the same kernel finds the stored winner: the store-hit slow path
    from_store = tunecache.autotune(configs=configs, key=["n"], **bench)(add_one)
    t0 = time.perf_counter()
    from_store[grid](x, y, n)
    sync()
    first_call_ms["tunecache_store_hit"] = (time.perf_counter() - t0) * 1e3
    assert not hasattr(from_store, "bench_time"), "the store hit benchmarked"

    best = by_triton.best_config
    meta = best.all_kwargs()  # exactly what the autotuner passes to the launch
    variants = {
        "jit": lambda: add_one[grid](x, y, n, **meta),
        "triton_autotune": lambda: by_triton[grid](x, y, n),
        "tunecache_autotune": lambda: by_tunecache[grid](x, y, n),
    }
    for fn in variants.values():  # warm every path
        for _ in range(200):
            fn()
    sync()

    samples: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))  # no variant always goes first
        for name in order:
            fn = variants[name]
            sync()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            sync()
            samples[name].append((time.perf_counter() - t0) / args.calls * 1e6)

    us = {k: statistics.median(v) for k, v in samples.items()}
    ratio = us["tunecache_autotune"] / us["triton_autotune"]
    over = {k: us[k] - us["jit"] for k in ("triton_autotune", "tunecache_autotune")}
    result = {
        "benchmark": "autotune_overhead",
        "device": "triton-interpreter" if interpret else torch.cuda.get_device_name(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "n": n,
        "calls_per_round": args.calls,
        "rounds": args.rounds,
        "configs": [str(c) for c in configs],
        "best_config": {
            "triton_autotune": str(by_triton.best_config),
            "tunecache_autotune": str(by_tunecache.best_config),
        },
        "per_call_us": us,
        "per_call_us_min": {k: min(v) for k, v in samples.items()},
        "per_call_us_samples": samples,
        "ratio_tunecache_vs_triton": ratio,
        "overhead_over_jit_us": over,
        "first_call_ms": first_call_ms,
    }
    print(f"device: {result['device']}, triton {triton.__version__}, {args.rounds} rounds x {args.calls} calls")
    for k in variants:
        print(f"  {k:20s} {us[k]:7.2f} us/call (min {min(samples[k]):.2f})")
    print(f"  tunecache / triton: {ratio:.3f}x per call")
    print(
        f"  over a plain jit launch: triton {over['triton_autotune']:+.2f} us, "
        f"tunecache {over['tunecache_autotune']:+.2f} us"
    )
    print(
        f"  first call: triton {first_call_ms['triton_autotune']:.1f} ms (tunes), tunecache "
        f"{first_call_ms['tunecache_autotune']:.1f} ms (opens the store, then tunes and stores, or finds a "
        f"winner stored by an earlier run), a second decorator's store hit "
        f"{first_call_ms['tunecache_store_hit']:.1f} ms"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
