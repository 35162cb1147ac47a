"""The Autotuner behind `@tunecache.autotune` (tunecache.dropin): Triton's own, with its
disk cache replaced by the store and the fleet.

Triton's `Autotuner.run` is inherited untouched, so a memo hit (`self.cache[key]`) costs
exactly what it costs under `triton.autotune`: no hashing, no I/O. On a memo miss with more
than one candidate left after pruning, Triton hands its disk cache the key, the candidates and
the benchmark (`check_disk_cache`); here that hook always runs (under the interpreter too),
asks the local store, then the fleet, and benchmarks only when neither has a winner.

A config is stored as plain values, {"kwargs", "num_warps", "num_stages", "num_ctas",
"maxnreg"}, and launched only as the live decorator's own `triton.Config` with identical
values: that config brings its `pre_hook` back, and a stored config that matches none of the
candidates is never launched.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import math
import os
import time
import weakref
from functools import cached_property
from typing import Any, Callable, Sequence

from triton import knobs
from triton.runtime.autotuner import Autotuner as TritonAutotuner
from triton.runtime.autotuner import Config
from triton.runtime.jit import JITFunction

from tunecache import locks
from tunecache.key import DeviceClass, TuneKey, canonical_json, device_of, triton_version
from tunecache.tuning import triton_key_cache
from tunecache.tuning.timing import QUICK_REP_MS, QUICK_WARMUP_MS, leaders, settle, wall_clock_bench

log = logging.getLogger("tunecache.autotune")

KERNEL_PREFIX = "triton:"  # tunecache_kernels.spaces.USER_KERNEL_PREFIX: the fleet checks these as triton.Configs
_KERNEL_NAME_MAX = 128  # tuned_configs.kernel is a String(128)


_LIVE: weakref.WeakSet = weakref.WeakSet()  # every decorated kernel of the process (`forget_all`)


def forget_all() -> None:
    """Every decorated kernel looks its configs up again at its next call (`tunecache.refresh`)."""
    for tuner in list(_LIVE):
        tuner.cache.clear()


class Autotuner(TritonAutotuner):
    """`triton.runtime.autotuner.Autotuner` whose results persist; see `tunecache.autotune`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _LIVE.add(self)
        self.cache_results = True  # the store is always on, under the interpreter too
        self.kernel_name = kernel_name(self.base_fn)
        self._call_kwargs: dict[str, Any] = {}
        # the caller chose how to time (do_bench, warmup, rep, use_cuda_graph): time every
        # candidate that way; else the quick round and the settling round below
        self._own_timing = any(kwargs.get(k) for k in ("do_bench", "warmup", "rep", "use_cuda_graph"))
        self._round: list[Config] | None = None  # candidates of the benchmark about to run
        self._quick: dict[Config, Any] | None = None  # their quick-round timings
        self._quick_mode = False

    @cached_property
    def kernel_version(self) -> str:
        """The kernel's code (and what it calls) and its list of configs; 16 hex digits."""
        h = hashlib.sha256(code_version(self.fn).encode())
        for config in self.configs:
            h.update(b"\0" + str(config).encode())
        return h.hexdigest()[:16]

    @cached_property
    def do_bench(self) -> Callable[..., Any]:
        # The interpreter has no GPU driver to ask for a benchmarker (triton.autotune fails there).
        if self._do_bench is None and knobs.runtime.interpret:
            return wall_clock_bench
        full = TritonAutotuner.do_bench.func(self)
        if self._own_timing:
            return full

        def bench(kernel_call: Callable[[], None], quantiles: Any = None) -> Any:
            if self._quick_mode:
                from triton.testing import do_bench

                return do_bench(kernel_call, warmup=QUICK_WARMUP_MS, rep=QUICK_REP_MS, quantiles=quantiles)
            return full(kernel_call, quantiles=quantiles)

        return bench

    def _bench(self, *args: Any, config: Config, **meta: Any) -> Any:
        """Triton's loop calls this per candidate. Its first call compiles every candidate at
        once in threads (Triton's AsyncCompileMode: the compiler releases the GIL) and times
        each in a quick round as soon as its binary is ready; the loop then reads those times."""
        if self._round is not None:
            todo, self._round = self._round, None
            self._quick = self._quick_round(todo, args, meta)
            self._settle_with = (args, meta)
        if self._quick is not None and config in self._quick:
            return self._quick[config]
        return super()._bench(*args, config=config, **meta)

    def _quick_round(self, configs: list[Config], args: tuple, meta: dict) -> dict[Config, Any]:
        from concurrent.futures import ThreadPoolExecutor

        from triton.runtime._async_compile import AsyncCompileMode

        from tunecache import settings

        workers = max(1, min(len(configs), settings.compile_workers() or os.cpu_count() or 1))
        timings: dict[Config, Any] = {}
        with (
            ThreadPoolExecutor(workers, thread_name_prefix="tunecache-compile") as pool,
            AsyncCompileMode(pool, ignore_errors=True),
        ):
            for config in configs:  # submit: each call returns at once with its binary's future
                current = {**meta, **config.all_kwargs(), "warmup": True}
                try:
                    self.fn.run(*args, **current)
                except Exception as e:  # noqa: BLE001 - the candidate's own round reports it
                    log.debug("tunecache: %s %s does not compile: %s", self.kernel_name, config, e)
            self._quick_mode = not self._own_timing
            try:
                for config in configs:  # each waits only for its own binary
                    timings[config] = super()._bench(*args, config=config, **meta)
            finally:
                self._quick_mode = False
        return timings

    def prune_configs(self, kwargs: dict) -> list[Config]:
        # Triton prunes right before it consults the cache; keep the call's keyword arguments,
        # which `run` does not store, so that the key names every argument.
        self._call_kwargs = kwargs
        return super().prune_configs(kwargs)

    def warmup(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().warmup(*args, **kwargs)
        finally:
            self._call_kwargs = {}  # hold no tensors after the call, as Triton drops `nargs`

    # ---- the slow path: once per key and process ------------------------------------------

    def check_disk_cache(self, tuning_key: tuple, configs: list[Config], bench_fn: Callable[[], None]) -> bool:
        """Triton's hook on a memo miss: fill `self.cache[tuning_key]`; True if nothing was benchmarked."""
        if not knobs.runtime.interpret:
            triton_key_cache.install()  # before the first compile lookup (see there)
        key, device = self.tune_key()
        self._call_kwargs = {}  # hold no tensors after the call, as Triton drops `nargs`
        found = self._lookup(key, configs)
        if found is not None:
            self.cache[tuning_key], self.configs_timings = found
            return True
        from tunecache.cache.config_cache import CACHE
        from tunecache.ops.launcher import in_space

        # one process of the host (and with a fleet, one host of it) tunes a key; the others wait for it
        with CACHE.turn(key, in_space(self.kernel_name)) as turn:
            found = self._lookup(key, configs) if turn.waited else None
            if found is not None:
                self.cache[tuning_key], self.configs_timings = found
                return True
            parallel = not knobs.runtime.interpret and len(configs) > 1
            self._round = list(configs) if parallel else None
            t0 = time.perf_counter()
            try:
                with locks.gpu_timer(_timer_of(device)):  # no other process times on this GPU meanwhile
                    bench_fn()
                    if parallel and not self._own_timing:
                        self._settle(tuning_key)
            finally:
                self._round, self._quick, self._settle_with = None, None, None
            self.bench_time = time.perf_counter() - t0
            self._persist(key, device, tuning_key, configs)
            return False

    def _settle(self, tuning_key: tuple) -> None:
        """Time the quick round's leaders (`timing.settle`) as Triton would (its do_bench
        defaults); the fastest of those wins."""
        args, meta = self._settle_with
        quick = {c: _median(t) for c, t in self.configs_timings.items()}
        if not leaders(quick):
            return
        self._quick = None

        def time_fn(c: Any) -> float:
            self.configs_timings[c] = TritonAutotuner._bench(self, *args, config=c, **meta)
            return _median(self.configs_timings[c])

        settled = settle(quick, time_fn)
        winner = min(settled, key=settled.get)
        self.cache[tuning_key] = winner
        self.pre_hook({**self.nargs, **meta, **winner.all_kwargs()}, reset_only=True)

    def _winner_binaries(self, tuning_key: tuple) -> list:
        """The winner's compiled kernel as Triton cached it (tunecache.tuning.binaries), for a fleet
        to hand to hosts that never tuned; none without a fleet, on the interpreter, or when
        the call's arguments are gone. Compiles nothing: the kernel is in Triton's cache, and
        only this kernel's in-memory copies are dropped (its next launch reads the cache)."""
        from tunecache.cache.config_cache import CACHE
        from tunecache.tuning import binaries

        winner, jit = self.cache.get(tuning_key), self.fn
        if knobs.runtime.interpret or CACHE.fleet() is None or winner is None or not hasattr(jit, "warmup"):
            return []
        try:
            with binaries.capture(jit) as seen:
                jit.warmup(**{**self.nargs, **winner.all_kwargs()}, grid=(1,))
            return binaries.read(seen)
        except Exception as e:  # noqa: BLE001 - the result is kept without its binary
            log.info("tunecache: could not find the compiled kernel of %s: %s", self.kernel_name, e)
            return []

    def tune_key(self) -> tuple[TuneKey, DeviceClass]:
        """The store's key for the current call (`run` has set `self.nargs`)."""
        args = {k: v for k, v in {**self.nargs, **self._call_kwargs}.items() if k in self.arg_names}
        problem = {name: _plain(args[name]) for name in self.keys if name in args}
        for name, arg in args.items():  # as Triton keys its memo: every argument with a dtype
            if hasattr(arg, "dtype"):
                problem[f"{name}.dtype"] = str(arg.dtype)
        device = device_of()  # where Triton launches (or TUNECACHE_DEVICE)
        key = TuneKey(self.kernel_name, self.kernel_version, triton_version(), device.arch, device.sm_count, problem)
        return key, device

    def _lookup(self, key: TuneKey, configs: list[Config]) -> tuple[Config, dict] | None:
        """The stored or fleet winner as one of `configs`, with its timings; None to benchmark."""
        from tunecache.cache.config_cache import CACHE
        from tunecache.ops.launcher import in_space

        rec = CACHE.get(key, in_space(self.kernel_name))  # this key's, and a well-formed triton.Config
        config = None if rec is None else self.live_config(rec, key, configs, rec.source)
        if config is None:
            return None
        return config, self._stored_timings(key, configs, config, rec.median_ms)

    def live_config(self, rec: Any, key: TuneKey, configs: Sequence[Config], where: str) -> Config | None:
        """The candidate whose values are `rec.config`'s, or None (with a warning) if there is none.
        `rec` is this key's, checked by the config cache (or the store's own faster result)."""
        wanted = canonical_json(rec.config)
        matches = [c for c in configs if _same_values(c, wanted)]
        if not matches:
            log.warning(
                "tunecache: ignoring %s config of %s %s: it matches none of the kernel's configs "
                "left after pruning: %s",
                where,
                self.kernel_name,
                key.digest[:12],
                rec.config,
            )
            return None
        if any(c != matches[0] for c in matches[1:]):  # same values, different pre_hooks
            log.warning(
                "tunecache: ignoring %s config of %s %s: several configs (with different pre_hooks) "
                "have its values: %s",
                where,
                self.kernel_name,
                key.digest[:12],
                rec.config,
            )
            return None
        return matches[0]

    def _stored_timings(
        self, key: TuneKey, configs: Sequence[Config], best: Config, best_ms: float
    ) -> dict[Config, list[float]]:
        """`configs_timings` after a hit: the last stored median of each candidate, in ms."""
        from tunecache.cache.config_cache import CACHE

        timings: dict[Config, list[float]] = {}
        by_values = {canonical_json(v): c for c in configs if (v := config_values(c)) is not None}
        for t in CACHE.read_trials(key.digest):
            c = by_values.get(canonical_json(t.config))
            if c is not None:
                timings[c] = [t.median_ms if t.status == "ok" and t.median_ms is not None else math.inf]
        timings[best] = [best_ms]
        return timings

    def _persist(self, key: TuneKey, device: DeviceClass, tuning_key: tuple, configs: list[Config]) -> None:
        """Store (and publish) what the benchmark just chose, with every candidate's timing."""
        from tunecache.store.records import ConfigRecord, TrialRecord, whoami

        best = self.cache[tuning_key]
        values = config_values(best)
        best_ms = _median(self.configs_timings.get(best))
        if values is None or not (math.isfinite(best_ms) and best_ms > 0):
            log.info(
                "tunecache: not keeping %s's config %s (not plain values, or no valid timing)", self.kernel_name, best
            )
            return
        trials = []
        for config, timing in self.configs_timings.items():
            v = config_values(config)
            ms = _median(timing)
            if v is not None:
                trials.append(
                    TrialRecord(v, "ok", median_ms=ms)
                    if math.isfinite(ms)
                    else TrialRecord(v, "failed", error="did not compile or ran out of resources")
                )
        rec = ConfigRecord(
            key=key,
            config=values,
            median_ms=best_ms,
            candidates=len(configs),
            device_name=device.name,
            tuned_by=whoami(),
            source="inline",
        )
        from tunecache.cache.config_cache import CACHE

        kept, won, _ = CACHE.keep(
            rec, trials, tune_seconds=getattr(self, "bench_time", None), binaries=self._winner_binaries(tuning_key)
        )
        if not won:
            # the store keeps a winner within its margin of ours (another process tuned the
            # same key): run that one, so that every process of the host agrees
            live = self.live_config(kept, key, configs, "stored")
            if live is not None:
                self.cache[tuning_key] = live


# ---- helpers ------------------------------------------------------------------------------


def _timer_of(device: DeviceClass) -> str:
    """The name of the GPU's timer (`tunecache.locks.gpu_timer`): its UUID, "cpu" on the interpreter."""
    if device.arch == "cpu":
        return "cpu"
    import torch

    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def config_values(config: Config) -> dict | None:
    """A config as the store keeps it, or None if it is not plain values (then it is not kept)."""
    from tunecache_kernels.spaces import TritonConfigSchema

    if config.ir_override is not None:  # a file on this host; its contents are no value
        return None
    values = {
        "kwargs": dict(config.kwargs),
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
        "num_ctas": config.num_ctas,
        "maxnreg": config.maxnreg,
    }
    return values if TritonConfigSchema().contains(values) else None


def _same_values(config: Config, wanted: str) -> bool:
    values = config_values(config)
    return values is not None and canonical_json(values) == wanted  # strict: 1, 1.0 and true differ


def kernel_name(fn: Callable) -> str:
    """'triton:<module>.<qualname>' of the Python function under the jit."""
    name = f"{KERNEL_PREFIX}{fn.__module__}.{fn.__qualname__}"
    if len(name) > _KERNEL_NAME_MAX:
        digest = hashlib.sha256(name.encode()).hexdigest()[:16]
        name = f"{name[: _KERNEL_NAME_MAX - 17]}~{digest}"
    return name


def code_version(fn: Any) -> str:
    """Triton's `cache_key` of the jit function (it covers the jit functions it calls); under
    the interpreter, which has none, a hash of the sources of the function and its callees."""
    while not isinstance(fn, JITFunction) and hasattr(fn, "fn") and not inspect.isfunction(fn):
        if type(fn).__name__ == "InterpretedFunction":
            return _source_hash(fn.fn)
        fn = fn.fn
    if isinstance(fn, JITFunction):
        return fn.cache_key
    return _source_hash(fn)


def _source_hash(fn: Callable) -> str:
    h = hashlib.sha256()
    seen: set = set()
    todo = [fn]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        try:
            h.update(inspect.getsource(f).encode())
        except (OSError, TypeError):
            h.update(f.__qualname__.encode())
        for name in getattr(f.__code__, "co_names", ()):
            callee = f.__globals__.get(name)
            inner = getattr(callee, "fn", None)
            if inspect.isfunction(inner) and type(callee).__name__ in ("InterpretedFunction", "JITFunction"):
                todo.append(inner)
    return h.hexdigest()


def _median(timing: Any) -> float:
    """The median of a `do_bench` result: Triton asks for quantiles (0.5, 0.2, 0.8)."""
    if timing is None:
        return math.inf
    if isinstance(timing, (list, tuple)):
        timing = timing[0] if timing else math.inf
    try:
        return float(timing)
    except (TypeError, ValueError):
        return math.inf


def _plain(value: Any) -> Any:
    """A key argument's value as JSON (Triton keys on the value itself)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
