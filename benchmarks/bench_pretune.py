"""`tunecache pretune` on every local GPU against one GPU (issue 14, item 6), in the same run.

A warm-up pretune fills Triton's cache (so the runs measure tuning, not compiling, which
shares the host's CPU cores whatever the GPU count); then the manifest is pretuned twice
from an empty store, on GPU 0 alone and on every GPU, each at default settings, each with
a fresh runner server (tunecache.tuning.forkserver) as a host that never ran tunecache has.

    python benchmarks/bench_pretune.py [--manifest resnet50] [--gpus 0,1]

Prints both wall times and the ratio; writes JSON with a `summary` to
benchmarks/results/pretune-<device>.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_tuning import stop_runner_servers  # noqa: E402
from common import RESULTS, device_info, write_results  # noqa: E402


def pretune(manifest: str, gpus: str, tmp: Path, name: str) -> float:
    """Wall seconds of `tunecache pretune MANIFEST --gpus GPUS` on an empty store of its own."""
    runtime = tmp / f"runtime-{name}"
    env = {
        **os.environ,
        "TRITON_CACHE_DIR": str(tmp / "triton"),
        "TUNECACHE_DB_URL": f"sqlite:///{tmp / f'store-{name}.sqlite'}",
        "TUNECACHE_RUNTIME_DIR": str(runtime),
    }
    for k in ("TUNECACHE_SERVER_URL", "TUNECACHE_TOKEN", "TUNECACHE_MAX_CANDIDATES"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "tunecache.cli", "pretune", manifest, "--gpus", gpus, "--log-dir", str(tmp / name)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - t0
    stop_runner_servers(runtime)
    if proc.returncode != 0:
        raise RuntimeError(f"pretune on GPUs {gpus} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    print(f"  {name:10s} GPUs {gpus:8s} {seconds:7.1f} s   {proc.stdout.strip().splitlines()[-1]}")
    return seconds


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", default="resnet50", help="a shipped manifest or a TOML file")
    ap.add_argument("--gpus", default="", help="GPU indices of the many-GPU run (default: every local GPU)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    gpus = args.gpus or ",".join(str(i) for i in range(torch.cuda.device_count()))
    if len(gpus.split(",")) < 2:
        sys.exit("bench_pretune needs two GPUs or more (--gpus 0,1)")
    tmp = Path(tempfile.mkdtemp(prefix="tunecache-pretune-"))
    print(f"pretune {args.manifest}: warm-up (fills Triton's cache), then 1 GPU and {gpus}")
    warm = pretune(args.manifest, gpus, tmp, "warm-up")
    one = pretune(args.manifest, gpus.split(",")[0], tmp, "one")
    many = pretune(args.manifest, gpus, tmp, "many")
    speedup = one / many
    n = len(gpus.split(","))
    print(f"pretune {args.manifest} on {n} GPUs: {speedup:.2f}x one GPU (goal 1.9x)")
    summary = {
        "device": device_info().get("device"),
        "gpus": n,
        "manifest": args.manifest,
        "speedup_vs_one_gpu": speedup,
        "seconds": {"one_gpu": one, f"{n}_gpus": many, "warm_up": warm},
        "goal": 1.9,
        "command": "python benchmarks/bench_pretune.py " + " ".join(sys.argv[1:]),
    }
    name = args.out.stem if args.out else f"pretune-{(summary['device'] or 'cpu').replace(' ', '_')}"
    path = write_results(name, {"summary": summary}, args.out.parent if args.out else RESULTS)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
