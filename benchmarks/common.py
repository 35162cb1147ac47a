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
