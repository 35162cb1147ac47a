"""What a host's first call costs when the config is already known (issue 14, items 3 and 4).

Every case runs in a fresh process: `import torch`, CUDA initialised and the inputs made
first (not counted), then the clock runs from `import tunecache` through the first call to
its synchronised result. The store and Triton's cache were filled beforehand by a setup
process (tuning with a few candidates), so the call finds its config and its binary: nothing
should compile. The peer is `triton.autotune(cache_results=True)` on Triton's tutorial matmul,
also warm, in the same run.

    python benchmarks/bench_coldstart.py [--repeats 3] [--profile] [--fleet]

--fleet adds a host that never tuned (item 4): a `tunecache serve` on loopback over SQLite
holds the winners, published by the setup processes with a worker token (with their compiled
kernels, as any tuning host publishes them); each fleet case is a fresh process with an empty
store and an empty Triton cache whose first call finds its config at the fleet. Two kinds of
fresh host are measured: one that never ran Triton (its first launch also builds Triton's C
launcher, once per host), and one that ran `tunecache sync` first (which builds it).

Prints seconds per case and the ratio to the peer; writes JSON with a `summary` to
benchmarks/results/coldstart-<device>.json. --profile adds each case's top functions by
cumulative time (cProfile) to the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import RESULTS, device_info, serve, write_results  # noqa: E402

PRELUDE = """
import sys, time, json
sys.path.insert(0, {here!r})
import torch
torch.cuda.init()
torch.manual_seed(0)
"""

# case -> (inputs, timed body); the body's last value is `out`
CASES = {
    "ops.matmul": (
        "a = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16)\n"
        "b = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16)",
        "import tunecache.ops\nout = tunecache.ops.matmul(a, b)",
    ),
    "ops.conv2d_fprop": (
        "x = torch.randn(32, 56, 56, 64, device='cuda', dtype=torch.bfloat16)\n"
        "w = torch.randn(64, 3, 3, 64, device='cuda', dtype=torch.bfloat16)",
        "import tunecache.ops\nout = tunecache.ops.conv2d_fprop(x, w, 1, 1)",
    ),
    "ops.conv2d_wgrad": (
        "x = torch.randn(32, 56, 56, 64, device='cuda', dtype=torch.bfloat16)\n"
        "g = torch.randn(32, 56, 56, 64, device='cuda', dtype=torch.bfloat16)",
        "import tunecache.ops\nout = tunecache.ops.conv2d_wgrad(x, g, 3, 3, 1, 1)",
    ),
    "tunecache.autotune": (
        "a = torch.randn(2048, 2048, device='cuda', dtype=torch.float16)\n"
        "b = torch.randn(2048, 2048, device='cuda', dtype=torch.float16)",
        "import tutorial_matmul as tm\nout = tm.launch(tm.autotuned('tunecache', tm.CONFIGS[:{n}]), a, b)",
    ),
    "triton.autotune(cache_results=True)": (
        "a = torch.randn(2048, 2048, device='cuda', dtype=torch.float16)\n"
        "b = torch.randn(2048, 2048, device='cuda', dtype=torch.float16)",
        "import tutorial_matmul as tm\nout = tm.launch(tm.autotuned('triton-cached', tm.CONFIGS[:{n}]), a, b)",
    ),
}
PEER = "triton.autotune(cache_results=True)"

# --timeline: when each of these functions ran, and on which thread (a profile hook that looks at
# these names only: cheaper than cProfile, and it shows what overlaps what)
STEPS = {
    "tunecache": (
        "resolve",
        "backends_for",
        "start",
        "_make_driver",
        "ready",
        "_look_up_first",
        "fetch",
        "binaries",
        "install",
        "_decide",
        "trusted",
        "_runner_ahead",
        "first_run",
    ),
    "triton": (
        "libcuda_dirs",
        "_cuda_driver_is_active",
        "platform_key",
        "_build",
        "_load_module_from_path",
        "_compile_so",
        "load_binary",
        "_init_handles",
        "compile",
    ),
}
TIMELINE = """
import threading
_steps = {steps!r}
_open, _done = {{}}, []
def _hook(frame, event, arg):
    code = frame.f_code
    if event not in ("call", "return"):
        return
    for pkg, names in _steps.items():
        if code.co_name in names and ("/" + pkg + "/") in code.co_filename:
            k = (threading.current_thread().name, code.co_name, id(frame))
            if event == "call":
                _open[k] = time.perf_counter() - t0
            elif k in _open:
                start = round(_open.pop(k), 4)
                _done.append((start, round(time.perf_counter() - t0, 4), k[0], pkg + ":" + code.co_name))
t0 = time.perf_counter()
threading.setprofile(_hook)
sys.setprofile(_hook)
"""


def child_code(case: str, n_configs: int, profile: bool, timeline: bool = False) -> str:
    inputs, body = CASES[case]
    body = body.format(n=n_configs)
    timed = textwrap.indent(body, "    ")
    if timeline:
        return (
            PRELUDE.format(here=str(HERE))
            + inputs
            + "\ntorch.cuda.synchronize()\n"
            + TIMELINE.format(steps=STEPS)
            + body
            + "\ntorch.cuda.synchronize()\nend = time.perf_counter() - t0\n"
            "sys.setprofile(None)\nthreading.setprofile(None)\n"
            "print(json.dumps({'seconds': end, 'timeline': sorted(_done)}))"
        )
    if profile:
        run = (
            "import cProfile, pstats, io\npr = cProfile.Profile()\npr.enable()\n"
            + body
            + "\ntorch.cuda.synchronize()\npr.disable()\n"
            "s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats('cumulative').print_stats(30)\n"
            "print(json.dumps({'profile': s.getvalue()[-6000:]}))"
        )
        return PRELUDE.format(here=str(HERE)) + inputs + "\ntorch.cuda.synchronize()\n" + run
    return (
        PRELUDE.format(here=str(HERE)) + inputs + "\ntorch.cuda.synchronize()\n"
        "t0 = time.perf_counter()\nif True:\n" + timed + "\ntorch.cuda.synchronize()\n"
        "print(json.dumps({'seconds': time.perf_counter() - t0}))"
    )


def run_child(code: str, env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


OPS = [c for c in CASES if c.startswith("ops.")]


def _compiled_kernels(triton_cache: Path) -> int:
    """Entries of Triton's cache that were compiled here (a kernel installed from the fleet
    holds only its metadata and cubin; a compile leaves its IRs too)."""
    if not triton_cache.is_dir():
        return 0
    return sum(
        1 for d in triton_cache.iterdir() if d.is_dir() and any(f.suffix in (".ptx", ".ttgir") for f in d.iterdir())
    )


class Fleet:
    """`tunecache serve` over a SQLite file on a free loopback port, with a worker and a read token."""

    def __init__(self, tmp: Path) -> None:
        from tunecache.store import Store

        url = f"sqlite:///{tmp / 'fleet.sqlite'}"
        store = Store(url)
        self.worker, _ = store.create_token("bench-worker", ["worker"])
        self.read, _ = store.create_token("bench-read", ["read"])
        store.close()
        self.proc, self.url = serve(url, log=open(tmp / "fleet.log", "ab"))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def fresh_host_env(env: dict, fleet: Fleet, host: Path) -> dict:
    """A host that never tuned: its own empty store and Triton cache, the fleet's read token."""
    return {
        **env,
        "TUNECACHE_DB_URL": f"sqlite:///{host / 'store.sqlite'}",
        "TRITON_CACHE_DIR": str(host / "triton-cache"),
        "TUNECACHE_SERVER_URL": fleet.url,
        "TUNECACHE_TOKEN": fleet.read,
    }


def fleet_cases(args, env: dict, fleet: Fleet, tmp: Path) -> dict:
    """Each op's first call on fresh hosts: (a) nothing but the fleet; (b) after `tunecache sync`."""
    rows = {}
    for mode in ("fresh", "after sync"):
        for case in [c for c in args.cases.split(",") if c in OPS]:
            times, compiled, sync_s = [], [], []
            for i in range(args.repeats):
                host = tmp / f"host-{mode.replace(' ', '-')}-{case}-{i}"
                host_env = fresh_host_env(env, fleet, host)
                if mode == "after sync":
                    t0 = time.perf_counter()
                    subprocess.run([sys.executable, "-m", "tunecache.cli", "sync"], env=host_env, check=True)
                    sync_s.append(time.perf_counter() - t0)
                times.append(run_child(child_code(case, args.configs, False), host_env)["seconds"])
                compiled.append(_compiled_kernels(host / "triton-cache"))
            rows[f"{case} ({mode})"] = {
                "seconds": statistics.median(times),
                "runs": times,
                "kernels_compiled": compiled,
                **({"sync_seconds": sync_s} if sync_s else {}),
            }
            if args.timeline and mode == "fresh":  # one more fresh host, its steps' start and end
                host = tmp / f"host-timeline-{case}"
                host_env = fresh_host_env(env, fleet, host)
                got = run_child(child_code(case, args.configs, False, timeline=True), host_env)
                rows[f"{case} ({mode})"]["timeline"] = got
                print(f"{case} on a fresh host, {got['seconds']:.3f} s under the timeline's hook:")
                for start, end, thread, step in got["timeline"]:
                    print(f"  {start:7.3f} {end:7.3f}  {thread[:24]:24s} {step}")
            if args.profile and mode == "fresh":  # one more fresh host, its first call under cProfile
                host = tmp / f"host-profile-{case}"
                host_env = fresh_host_env(env, fleet, host)
                rows[f"{case} ({mode})"]["profile"] = run_child(child_code(case, args.configs, True), host_env)[
                    "profile"
                ]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per case (the median is reported)")
    ap.add_argument("--configs", type=int, default=8, help="configs of the tutorial kernel in both autotuners")
    ap.add_argument("--setup-candidates", type=int, default=4, help="TUNECACHE_MAX_CANDIDATES when filling the store")
    ap.add_argument("--profile", action="store_true", help="add a cProfile of each case to the JSON")
    ap.add_argument(
        "--timeline", action="store_true", help="with --fleet: print and keep when each first-call step ran, per thread"
    )
    ap.add_argument("--skip-warm", action="store_true", help="with --fleet: measure only the fleet's fresh hosts")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset")
    ap.add_argument("--fleet", action="store_true", help="also: first calls on fresh hosts with a fleet hit")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="tunecache-coldstart-"))
    env = {
        **os.environ,
        "TUNECACHE_DB_URL": f"sqlite:///{tmp / 'store.sqlite'}",
        "TRITON_CACHE_DIR": str(tmp / "triton-cache"),
        "PYTHONUNBUFFERED": "1",
    }
    for k in ("TUNECACHE_SERVER_URL", "TUNECACHE_TOKEN", "TUNECACHE_MISS_POLICY"):
        env.pop(k, None)
    cases = [c for c in args.cases.split(",") if c]
    setup_env = {**env, "TUNECACHE_MAX_CANDIDATES": str(args.setup_candidates)}
    fleet = Fleet(tmp) if args.fleet else None
    if fleet is not None:  # the setup processes are the fleet's tuning hosts
        setup_env.update(TUNECACHE_SERVER_URL=fleet.url, TUNECACHE_TOKEN=fleet.worker)
    for case in cases:  # fill the store and Triton's cache (tuning happens here, not timed)
        print(f"setup: {case} ...", flush=True)
        run_child(child_code(case, args.configs, False), setup_env)

    rows = {}
    for case in [] if args.skip_warm else cases:
        times = [run_child(child_code(case, args.configs, False), env)["seconds"] for _ in range(args.repeats)]
        rows[case] = {"seconds": statistics.median(times), "runs": times}
        if args.profile:
            rows[case]["profile"] = run_child(child_code(case, args.configs, True), env)["profile"]
    fleet_rows = {}
    if fleet is not None:
        try:
            fleet_rows = fleet_cases(args, env, fleet, tmp)
        finally:
            fleet.stop()
    peer = rows.get(PEER, {}).get("seconds")
    print(f"\nfirst call on a warm host (beyond import torch and CUDA init), median of {args.repeats}:")
    for case, r in rows.items():
        ratio = f"{r['seconds'] / peer:5.2f}x the peer" if peer else ""
        print(f"  {case:40s} {r['seconds']:7.3f} s  {ratio}")
    if fleet_rows:
        print("\nfirst call on a host that never tuned, fleet hit (empty store and Triton cache):")
        for case, r in fleet_rows.items():
            print(f"  {case:40s} {r['seconds']:7.3f} s  kernels compiled {r['kernels_compiled']}")
    ours = {c: r["seconds"] for c, r in rows.items() if c != PEER}
    worst_op = max((r["seconds"] for c, r in rows.items() if c in OPS), default=None)
    fresh = [r["seconds"] for c, r in fleet_rows.items() if c.endswith("(fresh)")]
    synced = [r["seconds"] for c, r in fleet_rows.items() if c.endswith("(after sync)")]
    summary = {
        "warm_first_call_s": worst_op,
        "fleet_first_call_s": max(fresh) if fresh else None,
        "fleet_first_call_after_sync_s": max(synced) if synced else None,
        "fleet_kernels_compiled": sum(sum(r["kernels_compiled"]) for r in fleet_rows.values()) if fleet_rows else None,
        "seconds": ours,
        "peer": PEER,
        "peer_seconds": peer,
        "ratio_to_peer": {c: s / peer for c, s in ours.items()} if peer else None,
        "max_seconds": max(ours.values()) if ours else None,
        "goal_seconds": 0.3,
        "device": device_info().get("device"),
    }
    name = args.out.stem if args.out else f"coldstart-{(summary['device'] or 'cpu').replace(' ', '_')}"
    payload = {"summary": summary, "cases": rows, "fleet_cases": fleet_rows}
    path = write_results(name, payload, args.out.parent if args.out else RESULTS)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
