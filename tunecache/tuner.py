"""Tuning one problem: space -> prune -> compile -> check -> benchmark -> store.

Every candidate's output is checked against the PyTorch reference before it is timed, so a
config that fails to compile, crashes or computes a wrong answer is recorded as a failed
trial and can never win.
"""

from __future__ import annotations

import logging
import traceback
import uuid
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

from . import bench, settings
from .key import DeviceClass, TuneKey, triton_version
from .registry import kernel_version
from .store import ConfigRecord, Store, TrialRecord, whoami

log = logging.getLogger("tunecache.tuner")

# ‖out - ref‖ / ‖ref‖ allowed per dtype (float32 dots may run as tf32 on a GPU)
TOLERANCE = {"float32": 5e-3, "float16": 1e-2, "bfloat16": 2e-2}
# after a quick first timing, candidates slower than this multiple of the best are dropped
LOSER_FACTOR = 1.5


class TuneError(RuntimeError):
    """No candidate compiled, ran and matched the reference."""


@dataclass
class TuneResult:
    key: TuneKey
    config: dict
    median_ms: float
    tflops: float | None
    candidates: int
    trials: list[TrialRecord] = field(default_factory=list)
    stored: ConfigRecord | None = None


def make_key(mod: ModuleType, problem: dict, device: DeviceClass) -> TuneKey:
    return TuneKey(mod.KERNEL, kernel_version(mod), triton_version(), device.arch, device.sm_count, problem)


def relative_error(out: Any, ref: Any) -> float:
    o, r = out.double(), ref.double()
    denom = r.norm().item()
    err = (o - r).norm().item()
    return err / denom if denom > 0 else err


def tune(mod: ModuleType, problem: dict, device: DeviceClass, store: Store | None = None, *,
         torch_device: str | None = None, source: str = "inline",
         progress: Callable[[int, int, dict], None] | None = None,
         configs: list[dict] | None = None) -> TuneResult:
    """Tune `mod` (a backend module) for `problem` on this device and store the winner.

    `store=None` tunes without storing (benchmarks). `configs` overrides the candidate list.
    """
    import torch

    on_gpu = device.arch != "cpu"
    torch_device = torch_device or ("cuda" if on_gpu else "cpu")
    key = make_key(mod, problem, device)
    space = mod.config_space(problem, device) if configs is None else configs
    candidates = mod.prune(space, problem, device) if configs is None else list(configs)
    if configs is None:
        cap = settings.max_candidates()
        if cap is not None:
            candidates = candidates[:cap]
        # the untuned default always competes, so a tuned entry is never slower than no tuning
        default = mod.default_config(problem, device)
        if default not in candidates:
            candidates.append(default)
    if not candidates:
        raise TuneError(f"{mod.KERNEL}: every config of its space was pruned for {problem} on {device}")
    trials: list[TrialRecord] = []
    candidates = _precompile(mod, problem, device, candidates, trials)

    # tuning inside a user's call must not move the user's random number generators
    devices = [torch.device(torch_device).index or 0] if on_gpu else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        args = mod.inputs(problem, torch_device)
    ref = mod.reference(*args)
    tol = TOLERANCE[problem.get("dtype", "float32")]

    timed: list[tuple[float, dict]] = []
    for i, cfg in enumerate(candidates):
        if progress:
            progress(i, len(candidates), cfg)
        try:
            out = mod.launch(cfg, *args)
            if on_gpu:
                torch.cuda.synchronize()
            err = relative_error(out, ref)
        except Exception as e:  # a config that does not compile or crashes never wins
            if on_gpu and _cuda_broken():
                raise
            trials.append(TrialRecord(cfg, "failed", error=_short_error(e)))
            continue
        if not err <= tol:  # NaN fails too
            trials.append(TrialRecord(cfg, "wrong", error=f"relative error {err:.3g} > {tol}"))
            continue
        ms = bench.time_ms(lambda: mod.launch(cfg, *args), on_gpu, warmup_ms=5, rep_ms=20, cpu_reps=1)
        timed.append((ms, cfg))
    if progress:
        progress(len(candidates), len(candidates), {})
    if not timed:
        _store_trials(store, key, trials)
        errors = "; ".join(f"{t.config}: {t.error}" for t in trials[:5])
        raise TuneError(f"{mod.KERNEL}: no config of {len(candidates)} ran correctly for {problem}: {errors}")

    # second round: time the survivors properly, dropping clear losers of the quick round
    best_quick = min(ms for ms, _ in timed)
    for quick_ms, cfg in timed:
        if quick_ms > LOSER_FACTOR * best_quick:
            trials.append(TrialRecord(cfg, "ok", median_ms=quick_ms))
            continue
        ms = bench.time_ms(lambda: mod.launch(cfg, *args), on_gpu)
        trials.append(TrialRecord(cfg, "ok", median_ms=ms))
    ok = [t for t in trials if t.status == "ok"]
    best = min(ok, key=lambda t: t.median_ms)
    flops = mod.flops(problem)
    tflops = flops / (best.median_ms * 1e-3) / 1e12 if best.median_ms > 0 else None
    result = TuneResult(key, best.config, best.median_ms, tflops, len(candidates), trials)
    if store is not None:
        rec = ConfigRecord(key=key, config=best.config, median_ms=best.median_ms, tflops=tflops,
                           candidates=len(candidates), device_name=device.name, tuned_by=whoami(),
                           source=source)
        result.stored, _ = store.put_config(rec, trials, run_id=uuid.uuid4().hex)
    log.info("tunecache: tuned %s %s in %d candidates: %s (%.4f ms)", mod.KERNEL, problem, len(candidates),
             best.config, best.median_ms)
    return result


def _precompile(mod: ModuleType, problem: dict, device: DeviceClass, candidates: list[dict],
                trials: list[TrialRecord]) -> list[dict]:
    """Compile Gluon candidates in parallel for the device's target; drop those that fail."""
    if device.arch == "cpu" or not hasattr(mod, "compile_specs"):
        return candidates
    from .compile import compile_configs

    kept = []
    for cfg, report in zip(candidates, compile_configs(mod, problem, candidates, device)):
        if report.ok:
            kept.append(cfg)
        else:
            trials.append(TrialRecord(cfg, "failed", error=f"compile: {report.error}"))
    return kept


def _store_trials(store: Store | None, key: TuneKey, trials: list[TrialRecord]) -> None:
    if store is not None and trials:
        store.add_trials(key, trials)


def _short_error(e: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    return text[-2000:]


def _cuda_broken() -> bool:
    """After an illegal memory access the context is gone: stop instead of mis-recording."""
    import torch

    try:
        torch.cuda.synchronize()
        return False
    except RuntimeError:
        return True
