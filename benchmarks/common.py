"""Helpers shared by the benchmark scripts: device facts, timing, JSON results."""

from __future__ import annotations

import json
import math
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def geomean(values: list[float]) -> float:
    vals = [v for v in values if v and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")


def host_us(fn, calls: int = 50, batches: int = 1) -> float:
    """Microseconds of host time per call of `fn` (the median of `batches` runs of `calls`
    calls): the calls are queued behind a GPU sleep long enough that none of them waits for the
    GPU."""
    import statistics

    import torch

    out = []
    for _ in range(batches):
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000 // 1000 * 50)  # ~50 ms of GPU cycles at ~2 GHz
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def kernels_of(fn, calls: int = 1) -> list[dict]:
    """The GPU kernels (and copies) `calls` calls of `fn` run, in order: each one's name, device
    microseconds and start (microseconds after the first's), from torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    t0 = events[0].time_range.start if events else 0
    return [{"name": e.name[:90], "us": e.device_time, "start_us": e.time_range.start - t0} for e in events]


def device_info() -> dict:
    import torch
    import triton

    info = {"triton": triton.__version__, "torch": torch.__version__, "host": platform.node()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}")
    return info


def write_results(name: str, payload: dict, out_dir: Path | None = None) -> Path:
    out_dir = out_dir or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = dict(payload, when=time.strftime("%Y-%m-%dT%H:%M:%S"), env=device_info())
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1))
    return path


def serve(db_url: str, *args: str, log=None) -> tuple[subprocess.Popen, str]:
    """`tunecache serve` over `db_url` on a free loopback port, once it answers /healthz:
    (the process, its URL). `args`: more options of `tunecache serve`."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "tunecache.cli", "serve", "--port", str(port), "--db-url", db_url]
    proc = subprocess.Popen(
        [*cmd, "--log-level", "warning", *args],
        stdout=log,
        stderr=None if log is None else subprocess.STDOUT,
        cwd=Path(__file__).resolve().parent.parent,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            break
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the service did not start" + ("" if log is None else f": see {log.name}"))
