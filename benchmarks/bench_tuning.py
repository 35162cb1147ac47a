"""What a miss costs (issue 14, items 1 and 2), every column in the same run.

drop-in: Triton's tutorial matmul with 48 configs, first call under `tunecache.autotune` and
under `triton.autotune`, each in a fresh process with an empty Triton cache and an empty
store; then both winners timed side by side in one process (do_bench, median).

ops (--ops): the first call of `tunecache.ops` on shapes of the kernel benchmark's set, cold
(empty store, empty Triton cache, fresh process) at default settings: seconds, candidates
compiled and timed; then the same with the whole pruned space (TUNECACHE_MAX_CANDIDATES=0),
and both winners timed side by side in one process.

    python benchmarks/bench_tuning.py [--size 4096] [--ops matmul:M=4096,N=4096,K=4096,dtype=bfloat16;...]

Prints the ratios and writes JSON with a `summary` to benchmarks/results/tuning-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import RESULTS, device_info, write_results  # noqa: E402


def first_call(variant: str, size: int, tmp: Path) -> dict:
    env = {
        **os.environ,
        "TRITON_CACHE_DIR": str(tmp / f"triton-{variant}"),
        "TUNECACHE_DB_URL": f"sqlite:///{tmp / f'store-{variant}.sqlite'}",
        "PYTHONUNBUFFERED": "1",
    }
    for k in ("TUNECACHE_SERVER_URL", "TUNECACHE_TOKEN"):
        env.pop(k, None)
    proc = subprocess.run(
        [sys.executable, str(HERE / "tutorial_matmul.py"), "--variant", variant, "--size", str(size)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def time_winners(configs: dict[str, dict], size: int, tmp: Path) -> dict[str, float]:
    """Both winners' milliseconds, measured in one process, interleaved over rounds."""
    code = f"""
import json, statistics, sys
sys.path.insert(0, {str(HERE)!r})
import torch, triton
from triton.testing import do_bench
import tutorial_matmul as tm
configs = json.loads({json.dumps(json.dumps(configs))})
a = torch.randn({size}, {size}, device="cuda", dtype=torch.float16)
b = torch.randn({size}, {size}, device="cuda", dtype=torch.float16)
kernels = {{name: tm.autotuned("triton", [triton.Config(c["kwargs"], num_warps=c["num_warps"],
                                                         num_stages=c["num_stages"])])
           for name, c in configs.items()}}
ms = {{name: [] for name in kernels}}
for _ in range(5):
    for name, k in kernels.items():
        ms[name].append(do_bench(lambda: tm.launch(k, a, b), warmup=25, rep=200, return_mode="median"))
print(json.dumps({{name: statistics.median(v) for name, v in ms.items()}}))
"""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp / "triton-winners")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"timing the winners failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


OPS_CHILD = """
import json, sys, time, torch
from tunecache.shapes import canonical_problem
import tunecache.ops as ops
from tunecache import registry
from tunecache.config_cache import CACHE
from tunecache.key import device_of
from tunecache.tuner import make_key
op, shape = sys.argv[1], json.loads(sys.argv[2])
p = canonical_problem(op, shape)
mod = registry.backends_for(op, device_of(torch.empty(1, device="cuda")), p)[0]
args = mod.inputs(p, "cuda")
torch.cuda.synchronize()
t0 = time.perf_counter()
getattr(ops, op)(*args)
torch.cuda.synchronize()
seconds = time.perf_counter() - t0
key = make_key(mod, p, device_of(args[0]))
rec = CACHE.read_config(key.digest)
trials = CACHE.read_trials(key.digest)
print(json.dumps({"seconds": seconds, "kernel": mod.KERNEL, "config": rec.config, "median_ms": rec.median_ms,
                  "default_ms": rec.default_ms, "vendor_ms": rec.vendor_ms, "candidates": rec.candidates,
                  "compiled": sum(1 for t in trials if not (t.error or "").startswith("compile:")),
                  "timed": sum(1 for t in trials if t.status == "ok")}))
"""

SIDE_BY_SIDE = """
import json, sys, statistics, torch
from tunecache import registry
from tunecache.shapes import canonical_problem
from tunecache.timing import time_ms
op, shape, kernel, configs = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
p = canonical_problem(op, shape)
mod = registry.module_for_kernel(kernel)
args = mod.inputs(p, "cuda")
ms = {n: [] for n in configs}
for _ in range(5):
    for n, c in configs.items():
        ms[n].append(time_ms(lambda: mod.launch(c, *args), True))
print(json.dumps({n: statistics.median(v) for n, v in ms.items()}))
"""


def ops_case(op: str, shape: dict, tmp: Path) -> dict:
    out = {}
    for name, cap in (("default", None), ("exhaustive", "0")):
        env = {
            **os.environ,
            "TRITON_CACHE_DIR": str(tmp / f"triton-{op}-{name}"),
            "TUNECACHE_DB_URL": f"sqlite:///{tmp / f'store-{op}-{name}.sqlite'}",
            "PYTHONUNBUFFERED": "1",
        }
        for k in ("TUNECACHE_SERVER_URL", "TUNECACHE_TOKEN", "TUNECACHE_MISS_POLICY", "TUNECACHE_MAX_CANDIDATES"):
            env.pop(k, None)
        if cap is not None:
            env["TUNECACHE_MAX_CANDIDATES"] = cap
        proc = subprocess.run(
            [sys.executable, "-c", OPS_CHILD, op, json.dumps(shape)],
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{op} {shape} ({name}) failed:\n{proc.stderr[-4000:]}")
        out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    configs = {n: r["config"] for n, r in out.items()}
    proc = subprocess.run(
        [sys.executable, "-c", SIDE_BY_SIDE, op, json.dumps(shape), out["default"]["kernel"], json.dumps(configs)],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "TRITON_CACHE_DIR": str(tmp / f"triton-{op}-exhaustive")},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"timing the winners of {op} {shape} failed:\n{proc.stderr[-4000:]}")
    ms = json.loads(proc.stdout.strip().splitlines()[-1])
    out["winner_vs_exhaustive"] = ms["exhaustive"] / ms["default"]
    out["side_by_side_ms"] = ms
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=4096, help="M = N = K of the tutorial matmul (fp16)")
    ap.add_argument("--ops", default="", help="op:KEY=VALUE,...;... shapes for the ops' cold tuning")
    ap.add_argument("--no-dropin", action="store_true", help="skip the drop-in comparison")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tunecache-tuning-"))
    summary: dict = {"device": device_info().get("device")}
    payload: dict = {}
    if args.ops:
        rows = []
        for item in args.ops.split(";"):
            op, _, text = item.partition(":")
            shape = dict(kv.split("=", 1) for kv in text.split(","))
            r = ops_case(op, shape, tmp)
            rows.append({"op": op, "shape": shape, **r})
            d, e = r["default"], r["exhaustive"]
            vendor = f"; {d['vendor_ms'] / d['median_ms']:.3f}x the vendor" if d.get("vendor_ms") else ""
            print(
                f"{op} {text}: {d['seconds']:.1f} s cold ({d['candidates']} candidates, {d['timed']} timed); "
                f"whole space {e['seconds']:.1f} s ({e['candidates']}); winner {r['winner_vs_exhaustive']:.3f}x "
                f"the exhaustive best{vendor}"
            )
        secs = sorted(r["default"]["seconds"] for r in rows)
        summary["ops"] = {
            "median_seconds": secs[len(secs) // 2],
            "max_seconds": secs[-1],
            "min_winner_vs_exhaustive": min(r["winner_vs_exhaustive"] for r in rows),
            "shapes": len(rows),
            "goal": {"median_seconds": 6, "max_seconds": 15, "winner": 0.98},
        }
        payload["ops"] = rows
    if args.no_dropin:
        name = args.out.stem if args.out else f"tuning-ops-{(summary['device'] or 'cpu').replace(' ', '_')}"
        path = write_results(name, {"summary": summary, **payload}, args.out.parent if args.out else RESULTS)
        print(f"wrote {path}")
        return

    runs = {v: first_call(v, args.size, tmp) for v in ("triton", "tunecache")}
    ms = time_winners({v: r["config"] for v, r in runs.items()}, args.size, tmp)
    speedup = runs["triton"]["seconds"] / runs["tunecache"]["seconds"]
    quality = ms["triton"] / ms["tunecache"]  # > 1: our winner is faster
    print(f"drop-in, tutorial matmul {args.size}^3 fp16, 48 configs, cold Triton cache:")
    for v, r in runs.items():
        print(f"  {v:10s} first call {r['seconds']:7.2f} s  winner {ms[v]:.4f} ms  {r['config']}")
    print(f"  tunecache tunes {speedup:.2f}x faster than triton.autotune; its winner runs at {quality:.3f}x")
    summary.update(
        {
            "dropin_speedup_vs_triton_autotune": speedup,
            "dropin_winner_vs_triton_winner": quality,
            "seconds": {v: r["seconds"] for v, r in runs.items()},
            "winner_ms": ms,
            "goal": {"speedup": 5.0, "winner": 0.98},
        }
    )
    name = args.out.stem if args.out else f"tuning-{(summary['device'] or 'cpu').replace(' ', '_')}"
    path = write_results(name, {"summary": summary, "runs": runs, **payload}, args.out.parent if args.out else RESULTS)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
