"""Tuning one problem: space -> prune -> compile -> check -> benchmark; the caller keeps the winner.

Every candidate's output is checked against the PyTorch reference before it is timed, so a
config that fails to compile, crashes or computes a wrong answer is recorded as a failed
trial and can never win.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Callable, Iterator

from tunecache import settings
from tunecache.backends import kernel_version
from tunecache.key import DeviceClass, TuneKey, triton_version
from tunecache.store.records import ConfigRecord, TrialRecord, whoami
from tunecache.tuning.accuracy import tolerance
from tunecache.tuning.binaries import Binary
from tunecache.tuning.ranking import Ranking, shortlist
from tunecache.tuning.timing import (
    HOST_BOUND_MS,
    LOOP_CALLS,
    QUICK_REP_MS,
    QUICK_WARMUP_MS,
    SETTLE_REP_MS,
    SETTLE_WARMUP_MS,
    leaders,
    settle,
)
from tunecache_kernels.spaces import VENDOR, is_vendor

log = logging.getLogger("tunecache.tuning.tuner")

# ‖out - ref‖ / ‖ref‖ allowed per dtype (float32 dots may run as tf32 on a GPU)
# the quick round's timing (do_bench milliseconds); its leaders, the default and the vendor's op
# are timed with the settling round's
QUICK_TIMING = {"warmup_ms": QUICK_WARMUP_MS, "rep_ms": QUICK_REP_MS}
SETTLE_TIMING = {"warmup_ms": SETTLE_WARMUP_MS, "rep_ms": SETTLE_REP_MS}
LOOP_TIMING = {"loop_calls": LOOP_CALLS}


# a kernel wins over the vendor's op only where it is faster by more than this fraction: within
# the timings' noise (a few percent at ~10 us), a kernel that won by noise ran 7% slower than
# cuBLAS when measured again (moe-expert gate_up@M=1 on an H200); the vendor is the safe side
VENDOR_MARGIN = 0.03


def _vendor_wins(runner: Trials, best: TrialRecord, vendor_ms: float, timeline: dict) -> bool:
    """Whether the vendor's op wins over the best kernel: by GPU time, beyond VENDOR_MARGIN;
    where either takes under HOST_BOUND_MS, by the time of calls back to back, each one's host
    launch included (torch's dispatch to cuBLAS cost 38 us of host time a call where a kernel's
    launch plan cost 12: a ResNet-50 1x1 conv at batch 1 on an H200, which cuBLAS won by GPU
    time and lost 0.61x in a loop). The loop times go into the timeline (loop_us_*)."""
    ours, theirs = best.median_ms, vendor_ms
    if min(ours, theirs) < HOST_BOUND_MS:
        ours_loop = runner.run(best.config, LOOP_TIMING, check=False).get("median_ms")
        theirs_loop = runner.vendor_ms(LOOP_TIMING)
        if ours_loop is not None and theirs_loop is not None:
            ours, theirs = ours_loop, theirs_loop
            timeline.update(loop_us_kernel=round(ours * 1e3, 2), loop_us_vendor=round(theirs * 1e3, 2))
    return theirs * (1 - VENDOR_MARGIN) < ours


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
    default_ms: float | None = None  # the backend's untuned default, same run
    vendor_ms: float | None = None  # the vendor's op (torch's reference: cuBLAS / cuDNN on a GPU), same run
    # the winner's compiled kernels as this host's Triton cached them (tunecache.tuning.binaries)
    binaries: list[Binary] = field(default_factory=list)
    # where the seconds went: stage -> seconds since the start (the benchmarks print it)
    timeline: dict[str, float] = field(default_factory=dict)

    @property
    def start_seconds(self) -> float:
        """Of `seconds`, how long the tune waited for its trial runner to start (its process,
        torch's import, CUDA's): what a warm runner does not pay again; the problem's inputs
        and reference, which every tune makes, are not part of it."""
        t = self.timeline
        made = t.get("runner_inputs_s", 0.0) + t.get("runner_reference_s", 0.0)
        return round(max(0.0, min(self.seconds, t.get("inputs_ready", 0.0) - made)), 3)

    def record(self, device: DeviceClass) -> ConfigRecord:
        """The winner as the store and the fleet keep it."""
        return ConfigRecord(
            key=self.key,
            config=self.config,
            median_ms=self.median_ms,
            tflops=self.tflops,
            candidates=self.candidates,
            device_name=device.name,
            tuned_by=whoami(),
            source=self.source,
            default_ms=self.default_ms,
            vendor_ms=self.vendor_ms,
            tune_seconds=round(self.seconds, 3),
            start_seconds=self.start_seconds,
        )


class Timeline(dict):
    """Where a tuning run's seconds went: each stage's first time since the start, and
    summed durations (compile_cpu_s: the compiles' own seconds, over every worker)."""

    def __init__(self, t0: float) -> None:
        super().__init__()
        self.t0 = t0

    def mark(self, stage: str) -> None:
        self.setdefault(stage, round(time.perf_counter() - self.t0, 3))

    def add(self, name: str, seconds: float) -> None:
        self[name] = round(self.get(name, 0.0) + seconds, 3)


def make_key(mod: ModuleType, problem: dict, device: DeviceClass) -> TuneKey:
    return TuneKey(mod.KERNEL, kernel_version(mod), triton_version(), device.arch, device.sm_count, problem)


def tune(
    mod: ModuleType,
    problem: dict,
    device: DeviceClass,
    *,
    torch_device: str | None = None,
    source: str = "inline",
    progress: Callable[[str, int, int, float | None], None] | None = None,
    configs: list[dict] | None = None,
    hint: dict | None = None,
    ranking: Ranking | None = None,
) -> TuneResult:
    """Tune `mod` (a backend module) for `problem` on this device; return the winner and every trial.

    Nothing is written: callers keep the result (`ConfigCache.keep`, or a store's `put_config`
    with `result.record(device)`). `configs` overrides the candidate list (benchmarks).
    `hint`: a config another host of the fleet tuned this key to (a claim measured there only):
    it is timed against the default (and the vendor's op) first, and wins without a tune of
    the whole space when it runs right here and beats them; else the whole space is tuned.
    `ranking`: what past tunes of the kernel say of its candidates (`ConfigCache.ranking`); a
    tune times the few it puts first. Without it, the trials this package ships.
    """
    if hint is not None and configs is None:
        t0 = time.perf_counter()
        try:
            checked = _tune(mod, problem, device, torch_device, source, progress, None, hint, None)
        except TuneError:  # neither it nor the default ran right here: the whole space decides
            checked = None
        ran = checked and next((t for t in checked.trials if t.config == hint and t.status == "ok"), None)
        if device.arch == "cpu" and ran:  # the interpreter's times are not speeds (as for the vendor)
            checked = replace(checked, config=hint, median_ms=ran.median_ms)
        if checked is not None and checked.config == hint:
            log.info("tunecache: %s %s: the fleet's submitted config holds here (%s)", mod.KERNEL, problem, hint)
            return checked
        log.warning(
            "tunecache: %s: the config another host submitted (%s) is no faster than the default here; tuning "
            "the whole space",
            mod.KERNEL,
            hint,
        )
        result = _tune(mod, problem, device, torch_device, source, progress, None, None, ranking)
        result.seconds = time.perf_counter() - t0
        return result
    return _tune(mod, problem, device, torch_device, source, progress, configs, None, ranking)


def _default_ranking(mod: ModuleType, device: DeviceClass) -> Ranking:
    """The ranking a tune given none uses: the trials this package ships (unless turned off)."""
    learned = settings.ranking_learned()
    return Ranking.shipped(mod.KERNEL, device.arch, device.sm_count) if learned else Ranking()


def _shortlist(mod: ModuleType, problem: dict, device: DeviceClass, candidates: list[dict], ranking: Ranking):
    """The few of `candidates` (the pruned space) a tune times first, by `ranking`."""
    default = mod.default_config(problem, device)
    # the untuned default always competes, so a tuned entry is never slower than no tuning
    must = [default] if mod.prune([default], problem, device) else []
    return shortlist(ranking.order(candidates, problem), candidates, must)


def first_candidates(mod: ModuleType, problem: dict, device: DeviceClass, ranking: Ranking | None = None) -> list[dict]:
    """The candidates a tune of `problem` times first, before any widening (what `tune_all`
    compiles ahead of the tune)."""
    space = mod.prune(mod.config_space(problem, device), problem, device)
    ranking = ranking if ranking is not None else _default_ranking(mod, device)
    return list(_shortlist(mod, problem, device, space, ranking).candidates) if space else []


def _tune(
    mod: ModuleType,
    problem: dict,
    device: DeviceClass,
    torch_device: str | None,
    source: str,
    progress: Callable[[str, int, int, float | None], None] | None,
    configs: list[dict] | None,
    hint: dict | None,
    ranking: Ranking | None,
) -> TuneResult:
    t0 = time.perf_counter()
    on_gpu = device.arch != "cpu"
    default = mod.default_config(problem, device)
    torch_device = torch_device or ("cuda:0" if on_gpu else "cpu")
    key = make_key(mod, problem, device)
    space = mod.config_space(problem, device) if configs is None else configs
    if hint is not None:  # the claim and the default: the vendor competes below as in any tune
        space = [c for c in (hint, default) if not is_vendor(c)]
        space = [c for i, c in enumerate(space) if c not in space[:i]]
    candidates = mod.prune(space, problem, device) if configs is None else list(configs)
    siblings = MAX_SIBLINGS
    short = None
    if configs is None and hint is None:
        ranking = ranking if ranking is not None else _default_ranking(mod, device)
        short = _shortlist(mod, problem, device, candidates, ranking)
        candidates, siblings = list(short.candidates), MAX_SIBLINGS if short.siblings is None else short.siblings
        log.info(
            "tunecache: %s: %d candidates first (%s; %d tuned problems known)",
            mod.KERNEL,
            len(candidates),
            short.why,
            len(ranking),
        )
    # on a GPU the vendor's op competes too (timed beside the settled leaders): a tuned call is
    # never slower than torch's; not on the CPU interpreter (it measures correctness, not speed),
    # nor where a caller gives the candidates (the kernels' own standing)
    vendor_competes = on_gpu and configs is None and settings.vendor_competes()
    if not candidates:
        raise TuneError(f"{mod.KERNEL}: every config of its space was pruned for {problem} on {device}")
    trials: list[TrialRecord] = []
    if progress:
        progress("start", 0, len(candidates), None)
    timeline = Timeline(t0)
    mark = timeline.mark
    runner = Trials(mod, problem, key, torch_device, tolerance(problem), mark)
    runner.prewarm()  # the runner makes its inputs while the candidates compile
    if on_gpu and hasattr(mod, "compile_specs"):
        from tunecache.tuning.compile_pool import prebuild_launch_utils

        prebuild_launch_utils()

    # quick round: each candidate is checked and timed as soon as its binary is ready, while
    # the others still compile
    quick: dict[int, float] = {}

    def time_quickly(i: int) -> None:
        """Check and time candidate i in the quick round: its time, or a failed trial."""
        res = runner.run(candidates[i], QUICK_TIMING if on_gpu else {"cpu_reps": 1})
        if res["status"] != "ok":
            trials.append(TrialRecord(candidates[i], res["status"], error=res.get("error")))
        else:
            quick[i] = res["median_ms"]

    for n, i in enumerate(_compiled(mod, problem, device, candidates, trials, progress, timeline)):
        if progress:
            progress("time", n, len(candidates), min(quick.values()) if quick else None)
        time_quickly(i)
        mark("first_timed")
    more = short.widen(min(quick, key=quick.get)) if short is not None and quick else []
    if more:  # the ranking did not set the leaders apart: its next ones too
        start = len(candidates)
        candidates.extend(more)
        for i in _compiled(mod, problem, device, more, trials, progress, timeline):
            time_quickly(start + i)
        mark("widened")
    mark("quick_round")
    # the leaders' variants in run-time arguments only (GROUP_M, SPLIT_K): the same binaries,
    # so they cost a timing each and no compile; the capped list holds each kernel once
    if quick and configs is None and hint is None:
        leading = [candidates[i] for i in leaders(quick)]
        for sibling in _siblings(mod, problem, device, space, leading, candidates)[:siblings]:
            candidates.append(sibling)
            time_quickly(len(candidates) - 1)
        mark("siblings")
    if progress:
        progress("time", len(candidates), len(candidates), min(quick.values()) if quick else None)
    if not quick:
        errors = "; ".join(f"{t.config}: {t.error}" for t in trials[:5])
        raise TuneError(f"{mod.KERNEL}: no config of {len(candidates)} ran correctly for {problem}: {errors}")

    # settling round: the leaders (and the default, whose time the record keeps) timed properly
    settled: dict[int, TrialRecord] = {}

    def time_settled(i: int) -> float | None:
        res = runner.run(candidates[i], SETTLE_TIMING if on_gpu else {"cpu_reps": 3}, check=False)
        # it passed the quick round: a crash now is still a failed trial
        settled[i] = TrialRecord(candidates[i], res["status"], median_ms=res.get("median_ms"), error=res.get("error"))
        return res.get("median_ms") if res["status"] == "ok" else None

    settle(quick, time_settled, [i for i in quick if candidates[i] == default])
    for i, quick_ms in sorted(quick.items()):
        trials.append(settled.get(i) or TrialRecord(candidates[i], "ok", median_ms=quick_ms))
    mark("settled")
    ok = [t for t in trials if t.status == "ok"]
    if not ok:
        raise TuneError(f"{mod.KERNEL}: every config that passed the first round failed the second for {problem}")
    settled_ok = [t for t in settled.values() if t.status == "ok"] or ok
    best = min(settled_ok, key=lambda t: t.median_ms)
    flops = mod.flops(problem)
    tflops = flops / (best.median_ms * 1e-3) / 1e12 if best.median_ms > 0 else None
    default_ms = next((t.median_ms for t in ok if t.config == default), None)
    vendor_ms = runner.vendor_ms(SETTLE_TIMING if on_gpu else {"cpu_reps": 3})
    mark("vendor")
    if vendor_competes and vendor_ms is not None and _vendor_wins(runner, best, vendor_ms, timeline):
        best = TrialRecord(VENDOR, "ok", median_ms=vendor_ms)  # torch's own op is as fast here: it wins
        trials.append(best)
    winner_binaries = runner.binaries(best.config) if on_gpu and not is_vendor(best.config) else []
    mark("binaries")
    timeline.update({f"runner_{stage}_s": s for stage, s in runner.setup_seconds.items()})
    timeline["runner_forked"] = int(runner.worker.forked)  # from the host's runner server
    result = TuneResult(
        key,
        best.config,
        best.median_ms,
        tflops,
        len(candidates),
        trials,
        seconds=time.perf_counter() - t0,
        source=source,
        default_ms=default_ms,
        vendor_ms=vendor_ms,
        binaries=winner_binaries,
        timeline=dict(timeline),
    )
    log.info(
        "tunecache: tuned %s %s in %d candidates: %s (%.4f ms)",
        mod.KERNEL,
        problem,
        len(candidates),
        best.config,
        best.median_ms,
        extra={"timeline": result.timeline},
    )
    return result


# at most this many run-time variants of the quick round's leaders are timed after it
MAX_SIBLINGS = 12


def _siblings(
    mod: ModuleType, problem: dict, device: DeviceClass, space: list[dict], leading: list[dict], tried: list[dict]
) -> list[dict]:
    """Configs of the pruned space not yet tried that launch exactly the kernels of one of the
    `leading` configs (the same compile specs: they differ only in run-time arguments), the
    leaders' in order, at most MAX_SIBLINGS. None for backends that compile at launch."""
    if device.arch == "cpu" or not hasattr(mod, "compile_specs"):
        return []
    from tunecache.tuning.compile import arch_of, spec_key

    arch = arch_of(device)

    def kernels(c: dict) -> tuple | None:
        try:
            return tuple(spec_key(s, arch) for s in mod.compile_specs(problem, c, device))
        except Exception:  # noqa: BLE001 - a config whose specs cannot be made has no siblings
            return None

    def near(a: dict, b: dict) -> bool:  # run-time arguments are a key or two of a config
        return a.keys() == b.keys() and sum(a[k] != b[k] for k in a) <= 2

    pruned = [c for c in mod.prune(space, problem, device) if c not in tried]
    out: list[dict] = []
    for lead in leading:
        mine = kernels(lead)
        for c in pruned:
            if len(out) < MAX_SIBLINGS and c not in out and near(c, lead) and kernels(c) == mine is not None:
                out.append(c)
    return out


def _compiled(
    mod: ModuleType,
    problem: dict,
    device: DeviceClass,
    candidates: list[dict],
    trials: list[TrialRecord],
    progress: Callable[[str, int, int, float | None], None] | None = None,
    timeline: "Timeline | None" = None,
) -> Iterator[int]:
    """Indices of the candidates whose binaries are ready, as they become ready: Gluon
    candidates are compiled in parallel for the device's target (one that fails is a failed
    trial); others compile at their first launch. `progress("compile", done, total, None)`
    follows the compiles."""
    if device.arch == "cpu" or not hasattr(mod, "compile_specs"):
        yield from range(len(candidates))
        return
    from tunecache.tuning.compile_pool import compile_configs_as_ready

    timeline = timeline if timeline is not None else Timeline(time.perf_counter())
    for done, (i, report) in enumerate(compile_configs_as_ready(mod, problem, candidates, device), 1):
        timeline.mark("first_compiled")
        if done == len(candidates):
            timeline.mark("compiled")
        if progress:
            progress("compile", done, len(candidates), None)
        timeline.add("compile_cpu_s", report.seconds)
        if report.ok:
            yield i
        else:
            trials.append(TrialRecord(candidates[i], "failed", error=f"compile: {report.error}"))


class Trials:
    """A problem's candidates, run one at a time in the device's isolated trial runner.

    The runner makes the inputs itself (seeded, so every candidate sees the same data) and
    checks each output against the reference before timing it. A candidate that kills the
    runner or runs past TUNECACHE_CANDIDATE_TIMEOUT_S is a failed trial with the reason; the
    runner is replaced and the problem set up again for the next one.
    """

    def __init__(
        self,
        mod: ModuleType,
        problem: dict,
        key: TuneKey,
        torch_device: str,
        tolerance: float,
        mark: Callable[[str], None] = lambda stage: None,
    ) -> None:
        from tunecache.tuning.isolated import runner_for

        self.worker = runner_for(torch_device)
        self.setup = {
            "cmd": "setup",
            "module": mod.__name__,
            "problem": problem,
            "torch_device": torch_device,
            "tolerance": tolerance,
            "digest": key.digest,
        }
        self._ready_pid: int | None = None
        self.setup_seconds: dict[str, float] = {}  # the runner's start, stage by stage
        self._warming: threading.Thread | None = None
        self._mark = mark

    def prewarm(self) -> None:
        """Set the problem up in the runner on a thread (its start, torch, CUDA, the inputs and
        the reference), so that it overlaps the compiles; the first trial waits for it, and a
        set-up that failed there is tried again (and reported) by the first trial."""
        self._warming = self.worker.in_background(self._ensure_setup)

    def _ensure_setup(self) -> None:
        warming = self._warming
        if warming is not None and warming is not threading.current_thread():
            warming.join()
            self._warming = None
        from tunecache.tuning.isolated import WorkerFailed

        if self._ready_pid is not None and self._ready_pid == self.worker.pid:
            return
        try:
            answer = self.worker.call(self.setup, settings.candidate_timeout_s() * 5)
        except WorkerFailed as e:
            raise TuneError(
                f"{self.setup['module']}: could not make the inputs of {self.setup['problem']} "
                f"in the isolated trial runner: {e.reason}"
            ) from None
        self._ready_pid = self.worker.pid
        self._mark("inputs_ready")
        self.setup_seconds = answer.get("seconds") or {}

    def run(self, config: dict, timing: dict, *, check: bool = True, time_it: bool = True) -> dict:
        """{"status": "ok", "median_ms": ...} or {"status": "failed" | "wrong", "error": ...}."""
        from tunecache.tuning.isolated import WorkerFailed

        self._ensure_setup()
        try:
            return self.worker.call(
                {
                    "cmd": "trial",
                    "digest": self.setup["digest"],
                    "config": config,
                    "timing": timing,
                    "check": check,
                    "time": time_it,
                },
                settings.candidate_timeout_s(),
            )
        except WorkerFailed as e:
            log.warning("tunecache: candidate %s of %s failed in isolation: %s", config, self.setup["module"], e.reason)
            return {"status": "failed", "error": e.reason}

    def _ask(self, cmd: str, what: str, **fields: object) -> dict | None:
        """The runner's answer to `cmd` on this problem's inputs; None, logged as "could not
        `what`", if the set-up or the runner failed."""
        from tunecache.tuning.isolated import WorkerFailed

        try:
            self._ensure_setup()
            return self.worker.call(
                {"cmd": cmd, "digest": self.setup["digest"], **fields}, settings.candidate_timeout_s()
            )
        except (WorkerFailed, TuneError) as e:
            log.info("tunecache: could not %s of %s: %s", what, self.setup["module"], e)
            return None

    def binaries(self, config: dict) -> list[Binary]:
        """The compiled kernels a launch of `config` uses (read from this host's Triton cache),
        for the fleet; none if they could not be found."""
        from tunecache.tuning import binaries

        res = self._ask("binaries", "find the compiled kernels", config=config)
        if res is None:
            return []
        if res.get("status") != "ok":
            log.info("tunecache: could not find the compiled kernels of %s: %s", self.setup["module"], res.get("error"))
            return []
        return binaries.read(res.get("binaries") or {})

    def vendor_ms(self, timing: dict) -> float | None:
        """The reference op's time on the same inputs (what the user would call without
        tunecache), for the record; None if it could not be timed."""
        res = self._ask("reference", "time the reference", timing=timing)
        return None if res is None else res.get("median_ms")
