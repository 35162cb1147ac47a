"""Tuning one problem: space -> prune -> compile -> check -> benchmark; the caller keeps the winner.

Every candidate's output is checked against the PyTorch reference before it is timed, so a
config that fails to compile, crashes or computes a wrong answer is recorded as a failed
trial and can never win.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

from . import settings
from .key import DeviceClass, TuneKey, triton_version
from .registry import kernel_version
from .store import ConfigRecord, TrialRecord, whoami

log = logging.getLogger("tunecache.tuner")

# ‖out - ref‖ / ‖ref‖ allowed per dtype (float32 dots may run as tf32 on a GPU)
TOLERANCE = {"float32": 5e-3, "float16": 1e-2, "bfloat16": 2e-2}
# after a quick first timing, candidates slower than this multiple of the best are dropped
LOSER_FACTOR = 1.5
# the quick first round's timing (do_bench milliseconds); the second round uses do_bench's own
QUICK_TIMING = {"warmup_ms": 5, "rep_ms": 20}


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
    seconds: float = 0.0
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    source: str = "inline"

    def record(self, device: DeviceClass) -> ConfigRecord:
        """The winner as the store and the fleet keep it."""
        return ConfigRecord(key=self.key, config=self.config, median_ms=self.median_ms, tflops=self.tflops,
                            candidates=self.candidates, device_name=device.name, tuned_by=whoami(),
                            source=self.source)


def make_key(mod: ModuleType, problem: dict, device: DeviceClass) -> TuneKey:
    return TuneKey(mod.KERNEL, kernel_version(mod), triton_version(), device.arch, device.sm_count, problem)


def relative_error(out: Any, ref: Any) -> float:
    o, r = out.double(), ref.double()
    denom = r.norm().item()
    err = (o - r).norm().item()
    return err / denom if denom > 0 else err


def tune(mod: ModuleType, problem: dict, device: DeviceClass, *,
         torch_device: str | None = None, source: str = "inline",
         progress: Callable[[str, int, int, float | None], None] | None = None,
         configs: list[dict] | None = None) -> TuneResult:
    """Tune `mod` (a backend module) for `problem` on this device; return the winner and every trial.

    Nothing is written: callers keep the result (`ConfigCache.keep`, or a store's `put_config`
    with `result.record(device)`). `configs` overrides the candidate list (benchmarks).
    """
    t0 = time.perf_counter()
    on_gpu = device.arch != "cpu"
    torch_device = torch_device or ("cuda:0" if on_gpu else "cpu")
    key = make_key(mod, problem, device)
    space = mod.config_space(problem, device) if configs is None else configs
    candidates = mod.prune(space, problem, device) if configs is None else list(configs)
    if configs is None:
        cap = settings.max_candidates()
        if cap is not None:
            candidates = candidates[:cap]
        # the untuned default always competes, so a tuned entry is never slower than no tuning
        default = mod.default_config(problem, device)
        if default not in candidates and mod.prune([default], problem, device):
            candidates.append(default)
    if not candidates:
        raise TuneError(f"{mod.KERNEL}: every config of its space was pruned for {problem} on {device}")
    trials: list[TrialRecord] = []
    if progress:
        progress("compile", 0, len(candidates), None)
    candidates = _precompile(mod, problem, device, candidates, trials)
    runner = Trials(mod, problem, key, torch_device, TOLERANCE[problem.get("dtype", "float32")])

    timed: list[tuple[float, dict]] = []
    for i, cfg in enumerate(candidates):
        if progress:
            progress("time", i, len(candidates), min(ms for ms, _ in timed) if timed else None)
        res = runner.run(cfg, QUICK_TIMING if on_gpu else {"cpu_reps": 1})
        if res["status"] != "ok":
            trials.append(TrialRecord(cfg, res["status"], error=res.get("error")))
            continue
        timed.append((res["median_ms"], cfg))
    if progress:
        progress("time", len(candidates), len(candidates), min(ms for ms, _ in timed) if timed else None)
    if not timed:
        errors = "; ".join(f"{t.config}: {t.error}" for t in trials[:5])
        raise TuneError(f"{mod.KERNEL}: no config of {len(candidates)} ran correctly for {problem}: {errors}")

    # second round: time the survivors properly, dropping clear losers of the quick round
    best_quick = min(ms for ms, _ in timed)
    for quick_ms, cfg in timed:
        if quick_ms > LOSER_FACTOR * best_quick:
            trials.append(TrialRecord(cfg, "ok", median_ms=quick_ms))
            continue
        res = runner.run(cfg, {} if on_gpu else {"cpu_reps": 3}, check=False)
        if res["status"] != "ok":  # it passed the quick round: a crash now is still a failed trial
            trials.append(TrialRecord(cfg, res["status"], error=res.get("error")))
            continue
        trials.append(TrialRecord(cfg, "ok", median_ms=res["median_ms"]))
    ok = [t for t in trials if t.status == "ok"]
    if not ok:
        raise TuneError(f"{mod.KERNEL}: every config that passed the first round failed the second for {problem}")
    best = min(ok, key=lambda t: t.median_ms)
    flops = mod.flops(problem)
    tflops = flops / (best.median_ms * 1e-3) / 1e12 if best.median_ms > 0 else None
    result = TuneResult(key, best.config, best.median_ms, tflops, len(candidates), trials,
                        seconds=time.perf_counter() - t0, source=source)
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


class Trials:
    """A problem's candidates, run one at a time in the device's isolated trial runner.

    The runner makes the inputs itself (seeded, so every candidate sees the same data) and
    checks each output against the reference before timing it. A candidate that kills the
    runner or runs past TUNECACHE_CANDIDATE_TIMEOUT_S is a failed trial with the reason; the
    runner is replaced and the problem set up again for the next one.
    """

    def __init__(self, mod: ModuleType, problem: dict, key: TuneKey, torch_device: str, tolerance: float) -> None:
        from .isolated import runner_for

        self.worker = runner_for(torch_device)
        self.setup = {"cmd": "setup", "module": mod.__name__, "problem": problem, "torch_device": torch_device,
                      "tolerance": tolerance, "digest": key.digest}
        self._ready_pid: int | None = None

    def _ensure_setup(self) -> None:
        from .isolated import WorkerFailed

        if self._ready_pid is not None and self._ready_pid == self.worker.pid:
            return
        try:
            self.worker.call(self.setup, settings.candidate_timeout_s() * 5)
        except WorkerFailed as e:
            raise TuneError(f"{self.setup['module']}: could not make the inputs of {self.setup['problem']} "
                            f"in the isolated trial runner: {e.reason}") from None
        self._ready_pid = self.worker.pid

    def run(self, config: dict, timing: dict, *, check: bool = True, time_it: bool = True) -> dict:
        """{"status": "ok", "median_ms": ...} or {"status": "failed" | "wrong", "error": ...}."""
        from .isolated import WorkerFailed

        self._ensure_setup()
        try:
            return self.worker.call({"cmd": "trial", "digest": self.setup["digest"], "config": config,
                                     "timing": timing, "check": check, "time": time_it},
                                    settings.candidate_timeout_s())
        except WorkerFailed as e:
            log.warning("tunecache: candidate %s of %s failed in isolation: %s", config, self.setup["module"],
                        e.reason)
            return {"status": "failed", "error": e.reason}
