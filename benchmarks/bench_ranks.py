"""Jobs of many ranks (issue 38): R plain-script processes (a rank each, ranks spread over the
host's GPUs as torchrun would) meet the same new shapes at the same moment, on one fresh store.

For R in 1, 2, 4 (by default), each rank calls `tunecache.ops.matmul` on the same new shapes at
default settings and reports, per shape, the config it runs and how long its first call took.
Then, from the store and the trial runners' timing trace (TUNECACHE_TIMING_TRACE):

  trials_per_key  trials stored per key, divided by one tune's (R = 1): 1.0 is one tune per key
  first_call_s    per rank count, the slowest rank's first call of each shape (median over shapes)
  ranks_agree     every rank runs the same config for each shape
  timing_overlaps windows in which two processes held one GPU's timer at once (0 is the goal)

  tune_all        with --tune-all MANIFEST: `tunecache.tune_all(MANIFEST)` run by 1 rank, then by
                  one rank per GPU, each on a fresh store with Triton's cache equally warm (a first
                  pass warms it): the seconds of each and the speed-up

    python benchmarks/bench_ranks.py [--ranks 1,2,4] [--shapes 3] [--tune-all llama_layer,resnet50]

Writes benchmarks/results/ranks-<device>.json with a `summary`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import write_results  # noqa: E402

RANK = r"""
import json, sys, time, torch
from tunecache import ops
shapes = json.loads(sys.argv[1])
dev = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if dev == "cuda" else torch.float32
out = []
for M, N, K in shapes:
    a = torch.randn(M, K, device=dev, dtype=dtype)
    b = torch.randn(K, N, device=dev, dtype=dtype)
    t0 = time.perf_counter()
    ops.matmul(a, b)
    if dev == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    entry = next(e for raw, e in ops.OP_LAUNCHERS["matmul"].memo.items() if raw[0] == a.shape and raw[4] == b.shape)
    out.append({"shape": [M, N, K], "config": entry.config, "kernel": entry.kernel, "first_call_s": seconds})
print(json.dumps(out))
"""

# new to any store: odd sizes no suite uses (small ones on the CPU interpreter)
SHAPES = [(1000 + 8 * i, 2048 + 64 * i, 1536 + 64 * i) for i in range(8)]
CPU_SHAPES = [(40 + 8 * i, 36 + 4 * i, 24 + 8 * i) for i in range(8)]


def gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def start_ranks(ranks: int, argv: list[str], env: dict) -> list[subprocess.Popen]:
    """`ranks` Python processes, spread over the host's GPUs as torchrun would (one GPU each, and
    torchrun's variables: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE)."""
    n_gpus = gpus()
    procs = []
    for r in range(ranks):
        e = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks))
        if n_gpus:
            e["CUDA_VISIBLE_DEVICES"] = str(r % n_gpus)
        procs.append(
            subprocess.Popen([sys.executable, *argv], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    return procs


def run(ranks: int, shapes: list, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    trace = work / "timing.jsonl"
    script = work / "rank.py"
    script.write_text(RANK)
    n_gpus = gpus()
    env = {
        **os.environ,
        "TUNECACHE_DB_URL": f"sqlite:///{work / 'store.sqlite'}",
        "TUNECACHE_LOCK_DIR": str(work.parent / "locks"),
        "TUNECACHE_TIMING_TRACE": str(trace),
        "PYTHONUNBUFFERED": "1",
    }
    t0 = time.perf_counter()
    procs = start_ranks(ranks, [str(script), json.dumps(shapes)], env)
    results, waited, estimates = [], 0, []
    for p in procs:
        stdout, stderr = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"a rank failed ({p.returncode}):\n{stderr[-3000:]}")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
        waited += stderr.count("is being tuned by process")
        estimates.append(said_estimates(stderr))
    wall = time.perf_counter() - t0

    from tunecache.store import Store

    store = Store(env["TUNECACHE_DB_URL"])
    trials = store.counts()["trials"]
    store.close()
    windows = [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else []
    overlaps = 0
    for i, w in enumerate(windows):
        for v in windows[i + 1 :]:
            if v["device"] == w["device"] and v["pid"] != w["pid"] and v["start"] < w["end"] and w["start"] < v["end"]:
                overlaps += 1
    agree = all(len({json.dumps(r[i]["config"], sort_keys=True) for r in results}) == 1 for i in range(len(shapes)))
    first = [max(r[i]["first_call_s"] for r in results) for i in range(len(shapes))]
    # one rank: each shape's first call is its tune, announced with an estimate (issue 42's "within 2x")
    estimate_ratio = (
        [r["first_call_s"] / e for r, e in zip(results[0], estimates[0])]
        if ranks == 1 and len(estimates[0]) == len(shapes)
        else None
    )
    return {
        "ranks": ranks,
        "gpus": n_gpus,
        "tune_measured_over_estimate": estimate_ratio,
        "trials": trials,
        "waited_messages": waited,
        "ranks_agree": agree,
        "timing_windows": len(windows),
        "timing_overlaps": overlaps,
        "first_call_s": first,
        "first_call_s_median": statistics.median(first),
        "wall_s": wall,
        "configs": [[r[i]["config"] for r in results] for i in range(len(shapes))],
    }


def said_estimates(stderr: str) -> list[float]:
    """The seconds each tune's announcement estimated ('..., roughly 18 s (from 2 past tunes here)')."""
    import re

    unit = {"s": 1.0, "min": 60.0}
    return [float(v) * unit[u] for v, u in re.findall(r"roughly ([0-9.]+) (s|min) \(", stderr)]


TUNE_ALL = r"""
import json, sys, time
import tunecache
t0 = time.perf_counter()
r = tunecache.tune_all(sys.argv[1])
print(json.dumps({"seconds": time.perf_counter() - t0, "tuned": r.tuned, "by_others": r.by_others,
                  "failed": r.failed, "total": r.total}))
"""


def tune_all(manifest: str, ranks: int, work: Path) -> dict:
    """`ranks` processes (one per GPU, round robin) run tune_all(manifest) on one fresh store."""
    work.mkdir(parents=True, exist_ok=True)
    script = work / "tune_all.py"
    script.write_text(TUNE_ALL)
    env = {
        **os.environ,
        "TUNECACHE_DB_URL": f"sqlite:///{work / 'store.sqlite'}",
        "TUNECACHE_LOCK_DIR": str(work / "locks"),
    }
    t0 = time.perf_counter()
    procs = start_ranks(ranks, [str(script), manifest], env)
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise SystemExit(f"tune_all failed ({p.returncode}):\n{stderr[-3000:]}")
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return {"manifest": manifest, "ranks": ranks, "wall_s": time.perf_counter() - t0, "processes": outs}


def pretune(manifest: str, gpu_list: str, work: Path) -> dict:
    """`tunecache pretune MANIFEST --gpus GPU_LIST` on a fresh store: its wall time."""
    work.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "TUNECACHE_DB_URL": f"sqlite:///{work / 'store.sqlite'}",
        "TUNECACHE_LOCK_DIR": str(work / "locks"),
    }
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "tunecache.cli", "pretune", manifest, "--gpus", gpu_list],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode != 0:
        raise SystemExit(f"pretune failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"manifest": manifest, "gpus": gpu_list, "wall_s": time.perf_counter() - t0}


def speedup(what: str, manifest: str, run_one, run_every, tmp: Path) -> tuple[float, list]:
    """One GPU's run over every GPU's, Triton's cache warmed by a run before both."""
    run_one(Path(tmp) / f"{what}-{manifest}-warm")
    one, every = run_one(Path(tmp) / f"{what}-{manifest}-1"), run_every(Path(tmp) / f"{what}-{manifest}-all")
    ratio = one["wall_s"] / every["wall_s"]
    print(
        f"{what}({manifest}): 1 GPU {one['wall_s']:.1f} s, every GPU {every['wall_s']:.1f} s: {ratio:.2f}x", flush=True
    )
    return ratio, [one, every]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,2,4", help="rank counts to run, comma-separated (1 first: the baseline)")
    ap.add_argument("--shapes", type=int, default=3, help="new matmul shapes every rank calls")
    ap.add_argument("--out", default=None, help="results file name (default ranks-<device>)")
    ap.add_argument(
        "--tune-all", default="", help="manifests to tune with tunecache.tune_all on 1 rank and on every GPU"
    )
    ap.add_argument(
        "--pretune", default="", help="manifests to tune with `tunecache pretune` on 1 GPU and on every GPU"
    )
    args = ap.parse_args()
    counts = [int(r) for r in args.ranks.split(",")]
    shapes = (SHAPES if gpus() else CPU_SHAPES)[: args.shapes]
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as tmp:
        for r in counts:
            res = run(r, shapes, Path(tmp) / f"r{r}")
            runs.append(res)
            print(
                f"{r} rank(s) on {res['gpus']} GPU(s): {res['trials']} trials, first call (slowest rank, median "
                f"over shapes) {res['first_call_s_median']:.1f} s, ranks agree: {res['ranks_agree']}, "
                f"timing overlaps: {res['timing_overlaps']}, waits announced: {res['waited_messages']}",
                flush=True,
            )
    speedups, tune_all_runs, pretune_speedups, pretune_runs = {}, [], {}, []
    every_gpu = ",".join(str(g) for g in range(max(1, gpus())))
    with tempfile.TemporaryDirectory(prefix="bench-tune-all-") as tmp:
        for manifest in [m for m in args.tune_all.split(",") if m]:
            speedups[manifest], got = speedup(
                "tune_all",
                manifest,
                lambda w, m=manifest: tune_all(m, 1, w),
                lambda w, m=manifest: tune_all(m, max(1, gpus()), w),
                Path(tmp),
            )
            tune_all_runs += got
        for manifest in [m for m in args.pretune.split(",") if m]:
            pretune_speedups[manifest], got = speedup(
                "pretune",
                manifest,
                lambda w, m=manifest: pretune(m, "0", w),
                lambda w, m=manifest: pretune(m, every_gpu, w),
                Path(tmp),
            )
            pretune_runs += got
    base = next((r for r in runs if r["ranks"] == 1), None)
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    summary = {
        "device": device,
        "gpus": runs[0]["gpus"],
        "shapes": len(shapes),
        "trials_per_key": {
            str(r["ranks"]): (r["trials"] / base["trials"] if base and base["trials"] else None) for r in runs
        },
        "first_call_s": {str(r["ranks"]): round(r["first_call_s_median"], 2) for r in runs},
        "ranks_agree": all(r["ranks_agree"] for r in runs),
        "timing_overlaps": sum(r["timing_overlaps"] for r in runs),
        # a tune's wall time over the estimate its announcement said (1 rank; issue 42: within 2x)
        "tune_measured_over_estimate": base["tune_measured_over_estimate"] if base else None,
        "tune_all_speedup": speedups or None,  # one rank per GPU over one rank, Triton's cache warm for both
        "pretune_speedup": pretune_speedups or None,  # every GPU over one GPU, Triton's cache warm for both
    }
    print(json.dumps(summary, indent=1))
    slug = device.lower().replace("nvidia ", "").split()[0] if device != "cpu" else "cpu"
    payload = {
        "summary": summary,
        "runs": runs,
        "tune_all": tune_all_runs,
        "pretune": pretune_runs,
        "command": " ".join(sys.argv),
    }
    path = write_results(args.out or f"ranks-{slug}", payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
