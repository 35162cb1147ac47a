"""Where a cold tune's seconds go, worker by worker (issue 14, item 1).

Runs one first call of `tunecache.ops` in a fresh process (empty store, empty Triton cache,
torch and tunecache imported) and traces every request to the isolated processes: when each
compile worker and the trial runner started, when their first answer came (the start-up:
Python, imports, CUDA), how many requests each served and how long they were busy. Prints the
tuner's timeline beside it and writes JSON to benchmarks/results/profile-tune-<device>.json.

    python benchmarks/profile_tune.py [--op matmul] [--shape M=4096,N=4096,K=4096,dtype=bfloat16]
        [--runs 2]

--runs 2 profiles a second cold tune (its own store and Triton cache) on a host whose runner
server the first one started (tunecache.tuning.forkserver): its workers are forked, torch imported.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_tuning import FIRST_CALL_PRELUDE, cold_env, run_child, stop_runner_servers  # noqa: E402
from common import device_info, write_results  # noqa: E402

CHILD = (
    FIRST_CALL_PRELUDE
    + r"""
from tunecache.tuning import isolated
events = []
t0 = [None]
def now():
    return time.perf_counter() - (t0[0] or 0.0)
spawn, request = isolated.Worker.spawn, isolated.Worker._request
def traced_spawn(self):
    before = self.proc
    spawn(self)
    if self.proc is not before:
        events.append({"role": self.role, "pid": self.proc.pid, "what": "spawn", "at": now()})
def traced_request(self, msg, timeout):
    start = now()
    try:
        return request(self, msg, timeout)
    finally:
        events.append({"role": self.role, "pid": self.pid, "what": msg.get("cmd"), "start": start, "end": now()})
isolated.Worker.spawn, isolated.Worker._request = traced_spawn, traced_request
from tunecache.cache.config_cache import CACHE
def traced(name, fn):
    def call(*a, **k):
        start = now()
        try:
            return fn(*a, **k)
        finally:
            events.append({"role": "caller", "pid": 0, "what": name, "start": start, "end": now()})
    return call
for name in ("get", "keep_tuned"):
    setattr(CACHE, name, traced(name, getattr(CACHE, name)))
import tunecache.tuning.tuner as tuner
for name, given in (("QUICK_TIMING", sys.argv[3]), ("SETTLE_TIMING", sys.argv[4])):
    if given:
        warmup, rep = (float(x) for x in given.split(","))
        setattr(tuner, name, {"warmup_ms": warmup, "rep_ms": rep})
torch.cuda.synchronize()
t0[0] = time.perf_counter()
getattr(ops, op)(*args)
torch.cuda.synchronize()
events.append({"role": "caller", "pid": 0, "what": "first_call_done", "start": now(), "end": now()})
t1 = time.perf_counter()
getattr(ops, op)(*args)
torch.cuda.synchronize()
events.append({"role": "caller", "pid": 0, "what": "second_call", "start": 0, "end": time.perf_counter() - t1})
print(json.dumps({"seconds": now(), "timeline": timelines[-1] if timelines else None, "events": events}))
"""
)


def parse_shape(text: str) -> dict:
    out: dict = {}
    for part in filter(None, text.split(",")):
        k, _, v = part.partition("=")
        out[k.strip()] = int(v) if v.strip().lstrip("-").isdigit() else v.strip()
    return out


def summarize(events: list[dict]) -> dict:
    """Per process: started, first answer (its start-up done), requests, busy seconds."""
    procs: dict = {}
    for e in events:
        p = procs.setdefault(e["pid"], {"role": e["role"], "requests": 0, "busy_s": 0.0})
        if e["what"] == "spawn":
            p["spawned"] = round(e["at"], 3)
        else:
            p.setdefault("first_answer", round(e["end"], 3))
            p["requests"] += 1
            p["busy_s"] += e["end"] - e["start"]
            p[f"{e['what']}_end"] = round(e["end"], 3)
    for p in procs.values():
        p["busy_s"] = round(p["busy_s"], 3)
    return procs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", default="matmul")
    ap.add_argument("--shape", default="M=4096,N=4096,K=4096,dtype=bfloat16")
    ap.add_argument("--quick", default="", help="WARMUP_MS,REP_MS of the quick round (default: the tuner's)")
    ap.add_argument("--settle", default="", help="WARMUP_MS,REP_MS of the settling round (default: the tuner's)")
    ap.add_argument("--tag", default="", help="appended to the JSON's name")
    ap.add_argument("--runs", type=int, default=1, help="cold tunes one after another; the last is reported")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        child = ["-c", CHILD, args.op, json.dumps(parse_shape(args.shape)), args.quick, args.settle]
        for run in range(args.runs):
            env = cold_env(Path(tmp) / f"triton-{run}", Path(tmp) / f"store-{run}.sqlite")
            res = run_child(child, env, f"tuning {args.op} {args.shape}", 900)
            if run + 1 < args.runs:
                print(f"run {run + 1}: {res['seconds']:.2f} s; timeline: {json.dumps(res['timeline'])}")
                time.sleep(5)  # the runner server the first run started: up by now
        stop_runner_servers(Path(tmp) / "runtime")
    procs = summarize(res["events"])
    timing = f"quick={args.quick or 'default'} settle={args.settle or 'default'}"
    print(f"{args.op} {args.shape} {timing}: {res['seconds']:.2f} s")
    print("timeline:", json.dumps(res["timeline"]))
    for pid, p in sorted(procs.items(), key=lambda kv: kv[1].get("spawned", 0)):
        print(pid, json.dumps(p))
    compile_procs = [p for p in procs.values() if p["role"] == "compile"]
    summary = {
        "device": device_info().get("device"),
        "seconds": res["seconds"],
        "compile_workers": len(compile_procs),
        "compile_busy_s": round(sum(p["busy_s"] for p in compile_procs), 3),
        "runner_first_answer": next((p.get("first_answer") for p in procs.values() if p["role"] != "compile"), None),
        "runner_forked": (res["timeline"] or {}).get("runner_forked"),
        "command": "python benchmarks/profile_tune.py " + " ".join(sys.argv[1:]),
    }
    print("summary:", json.dumps(summary))
    payload = {"summary": summary, "timeline": res["timeline"], "processes": procs}
    write_results(f"profile-tune-{args.op}{args.tag}", payload)


if __name__ == "__main__":
    main()
