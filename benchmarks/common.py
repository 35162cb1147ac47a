"""Helpers shared by the benchmark scripts: device facts, timing, JSON results."""

from __future__ import annotations

import json
import math
import platform
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
