"""Does a backend's whole config space hold a winner the default tune misses (issue 15)?

For each layer (bench_models' suite, by name) and op: the op is called as a user calls it
(`tunecache.ops`, so a pointwise conv sweeps the matmul it runs as) but its tune times every
config of the pruned space (TUNECACHE_MAX_CANDIDATES lifted, or --cap), then prints the
fastest configs of the quick round with their times, the vendor's time from the same run,
and where each sits in the tuner's order (`prune`): a rank past 48 is a winner the default cap
cuts, a slow best is a kernel that needs work, not a tuner.

    python benchmarks/sweep_space.py --op conv2d_wgrad --layers resnet50-b32/layer4.conv2

Writes JSON with a `summary` to benchmarks/results/sweep-<op>-<device>.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_models import layers_named, op_cases  # noqa: E402
from common import device_info, geomean, write_results  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", required=True, help="comma-separated model/name of the suite (bench_models --list)")
    ap.add_argument("--op", default="conv2d_wgrad", help="the op whose tune is swept (matmul, conv2d_fprop, ...)")
    ap.add_argument("--cap", type=int, default=100_000, help="at most this many candidates per tune")
    ap.add_argument("--top", type=int, default=12, help="configs printed per layer")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/sweep-...)")
    args = ap.parse_args(argv)
    layers = layers_named(args.layers, ap)
    import torch

    if not torch.cuda.is_available():
        print("sweep_space: needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ["TUNECACHE_MAX_CANDIDATES"] = str(args.cap)
    os.environ.setdefault(
        "TUNECACHE_DB_URL", f"sqlite:///{Path(tempfile.mkdtemp(prefix='tunecache-sweep-')) / 's.sqlite'}"
    )
    from tunecache.ops import launcher

    results = []
    real_tune = launcher.tune

    def recording_tune(mod, problem, device, **kw):
        res = real_tune(mod, problem, device, **kw)
        results.append((mod, problem, device, res))
        return res

    launcher.tune = recording_tune
    rows = []
    op = args.op
    for name, ours, _vendor in op_cases(layers, op):
        del results[:]
        ours()
        torch.cuda.synchronize()
        if not results:
            print(f"{name}: found in the store, nothing tuned (use a fresh TUNECACHE_DB_URL)")
            continue
        mod, problem, device, res = results[-1]
        order = mod.prune(mod.config_space(problem, device), problem, device)
        ok = sorted((t for t in res.trials if t.status == "ok"), key=lambda t: t.median_ms)
        default = mod.default_config(problem, device)
        default_ms = next((t.median_ms for t in ok if t.config == default), None)
        top = []
        for t in ok[: args.top]:
            rank = order.index(t.config) if t.config in order else None
            top.append({"config": t.config, "ms": t.median_ms, "rank": rank})
        by_tile: dict[tuple, dict] = {}
        for t in ok:  # fastest first: the first of each tile shape is its best
            tile = tuple(t.config.get(k) for k in ("BLOCK_M", "BLOCK_N", "num_warps"))
            by_tile.setdefault(tile, {"config": t.config, "ms": t.median_ms})
        row = {
            "layer": name,
            "op": op,
            "kernel": mod.KERNEL,
            "problem": problem,
            "space": len(order),
            "timed": len(ok),
            "failed": len(res.trials) - len(ok),
            "vendor_ms": res.vendor_ms,
            "best_ms": res.median_ms,
            "best": res.config,
            "default_ms": default_ms,
            "ratio": (res.vendor_ms / res.median_ms) if res.vendor_ms else None,
            "top": top,
            "best_per_tile": list(by_tile.values()),
        }
        rows.append(row)
        print(
            f"{name} {op} ({mod.KERNEL}): {row['timed']} timed of {row['space']}, "
            f"best {res.median_ms * 1e3:.1f} us, vendor {res.vendor_ms * 1e3:.1f} us -> {row['ratio']:.3f}x; "
            f"default {default_ms} ms",
            flush=True,
        )
        for t in top:
            print(f"    {t['ms'] * 1e3:8.1f} us  rank {t['rank']}  {t['config']}")
        print("    best per tile shape (BLOCK_M, BLOCK_N, num_warps):")
        for t in row["best_per_tile"]:
            print(f"    {t['ms'] * 1e3:8.1f} us  {t['config']}")
    info = device_info()
    ratios = [r["ratio"] for r in rows if r["ratio"]]
    summary = {
        "device": info.get("device"),
        args.op: {"geomean": geomean(ratios), "min": min(ratios), "layers": len(ratios)} if ratios else None,
        "what": "the whole pruned space tuned per layer: the best config's time against the vendor's",
        "command": "python benchmarks/sweep_space.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    name = args.out.stem if args.out else f"sweep-{args.op}-{(info.get('device') or 'gpu').replace(' ', '_')}"
    path = write_results(name, {"summary": summary, "rows": rows}, args.out.parent if args.out else None)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
