"""What isolating candidates costs: the trial runner's start, its per-candidate round trip,
and one candidate's check + quick timing in it, beside the same launch + check + timing run in
this process (the peer: how tuning ran before isolation), for a Hopper matmul on this GPU.

    python benchmarks/bench_isolation.py [--out DIR]

Prints the ratios and writes benchmarks/results/isolation.json (`summary`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--rounds", type=int, default=200, help="round trips to time")
    args = ap.parse_args()

    import torch

    from tunecache import backends
    from tunecache.key import cuda_device, interpreter_device
    from tunecache.tuning.accuracy import relative_error, tolerance
    from tunecache.tuning.isolated import Worker
    from tunecache.tuning.timing import time_ms
    from tunecache.tuning.tuner import QUICK_TIMING, Trials, make_key

    on_gpu = torch.cuda.is_available()
    device = cuda_device(0) if on_gpu else interpreter_device()
    torch_device = "cuda:0" if on_gpu else "cpu"
    op_problem = {"M": 2048, "N": 2048, "K": 2048} if on_gpu else {"M": 64, "N": 64, "K": 64}
    a = torch.randn(
        op_problem["M"], op_problem["K"], device=torch_device, dtype=torch.bfloat16 if on_gpu else torch.float32
    )
    b = torch.randn(op_problem["K"], op_problem["N"], device=torch_device, dtype=a.dtype)
    mod = backends.backend_for("matmul", device, backends.backend_module("matmul", "portable").problem(a, b))
    problem = mod.problem(a, b)
    config = mod.default_config(problem, device)
    key = make_key(mod, problem, device)
    timing = QUICK_TIMING if on_gpu else {"cpu_reps": 1}

    # the runner's start: a new process importing torch, Triton and the backend, and CUDA init
    w = Worker(f"trial runner for {torch_device}")
    t0 = time.perf_counter()
    w.call({"cmd": "hello", "sys_path": list(sys.path)}, 600)
    start_s = time.perf_counter() - t0
    w.close()

    trials = Trials(mod, problem, key, torch_device, tolerance(problem))
    t0 = time.perf_counter()
    trials.run(config, timing)  # set-up (inputs + reference) and the first launch (JIT load)
    first_s = time.perf_counter() - t0
    rt = []
    for _ in range(args.rounds):  # the bare round trip: no launch, no check, no timing
        t0 = time.perf_counter()
        trials.run(config, timing, check=False, time_it=False)
        rt.append(time.perf_counter() - t0)
    isolated = []
    for _ in range(10):  # one candidate: launch, check against the reference, quick timing
        t0 = time.perf_counter()
        trials.run(config, timing)
        isolated.append(time.perf_counter() - t0)

    # the same candidate in this process, as tuning ran before isolation
    torch.manual_seed(0)
    args_ = mod.inputs(problem, torch_device)
    ref = mod.reference(*args_)
    mod.launch(config, *args_)
    inproc = []
    for _ in range(10):
        t0 = time.perf_counter()
        out = mod.launch(config, *args_)
        if on_gpu:
            torch.cuda.synchronize()
        assert relative_error(out, ref) <= tolerance(problem)
        time_ms(lambda: mod.launch(config, *args_), on_gpu, **timing)
        inproc.append(time.perf_counter() - t0)

    med_rt_ms = statistics.median(rt) * 1e3
    med_iso, med_in = statistics.median(isolated) * 1e3, statistics.median(inproc) * 1e3
    summary = {
        "kernel": mod.KERNEL,
        "problem": problem,
        "device": str(device),
        "runner_start_s": round(start_s, 3),
        "first_candidate_s": round(first_s, 3),
        "round_trip_ms": round(med_rt_ms, 4),
        "candidate_isolated_ms": round(med_iso, 3),
        "candidate_in_process_ms": round(med_in, 3),
        "isolated_vs_in_process": round(med_iso / med_in, 4),
    }
    print(f"{mod.KERNEL} {op_problem} on {device}")
    print(f"  trial runner start (once per process): {start_s:.2f} s; set-up + first candidate {first_s:.2f} s")
    print(f"  round trip per candidate: {med_rt_ms:.3f} ms (median of {args.rounds})")
    print(
        f"  one candidate (launch, check, quick timing): isolated {med_iso:.1f} ms, in process {med_in:.1f} ms "
        f"-> {med_iso / med_in:.3f}x"
    )
    path = write_results(
        "isolation",
        {
            "summary": summary,
            "round_trips_ms": [x * 1e3 for x in rt],
            "isolated_ms": [x * 1e3 for x in isolated],
            "in_process_ms": [x * 1e3 for x in inproc],
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
