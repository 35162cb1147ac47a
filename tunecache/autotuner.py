"""The Autotuner behind `tunecache.autotune`: Triton's own, with its disk cache replaced.

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
import statistics
import time
from functools import cached_property
from typing import Any, Callable, Sequence

from triton import knobs
from triton.runtime.autotuner import Autotuner as TritonAutotuner
from triton.runtime.autotuner import Config
from triton.runtime.jit import JITFunction

from . import settings
from .key import DeviceClass, TuneKey, canonical_json, cuda_device, interpreter_device, triton_version

log = logging.getLogger("tunecache.autotune")

KERNEL_PREFIX = "triton:"  # tunecache_kernels.spaces.USER_KERNEL_PREFIX: the fleet checks these as triton.Configs
_KERNEL_NAME_MAX = 128  # tuned_configs.kernel is a String(128)


class Autotuner(TritonAutotuner):
    """`triton.runtime.autotuner.Autotuner` whose results persist; see `tunecache.autotune`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cache_results = True  # the store is always on, under the interpreter too
        self.kernel_name = kernel_name(self.base_fn)
        self._call_kwargs: dict[str, Any] = {}

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
        return TritonAutotuner.do_bench.func(self)

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
        key, device = self.tune_key()
        self._call_kwargs = {}  # hold no tensors after the call, as Triton drops `nargs`
        found = self._lookup(key, configs)
        if found is not None:
            self.cache[tuning_key], self.configs_timings = found
            return True
        bench_fn()
        self._persist(key, device, tuning_key, configs)
        return False

    def tune_key(self) -> tuple[TuneKey, DeviceClass]:
        """The store's key for the current call (`run` has set `self.nargs`)."""
        args = {k: v for k, v in {**self.nargs, **self._call_kwargs}.items() if k in self.arg_names}
        problem = {name: _plain(args[name]) for name in self.keys if name in args}
        for name, arg in args.items():  # as Triton keys its memo: every argument with a dtype
            if hasattr(arg, "dtype"):
                problem[f"{name}.dtype"] = str(arg.dtype)
        device = current_device()
        key = TuneKey(self.kernel_name, self.kernel_version, triton_version(), device.arch, device.sm_count,
                      problem)
        return key, device

    def _lookup(self, key: TuneKey, configs: list[Config]) -> tuple[Config, dict] | None:
        """The stored or fleet winner as one of `configs`, with its timings; None to benchmark."""
        from .config_cache import CACHE
        from .launcher import in_space

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
            log.warning("tunecache: ignoring %s config of %s %s: it matches none of the kernel's configs "
                        "left after pruning: %s", where, self.kernel_name, key.digest[:12], rec.config)
            return None
        if any(c != matches[0] for c in matches[1:]):  # same values, different pre_hooks
            log.warning("tunecache: ignoring %s config of %s %s: several configs (with different pre_hooks) "
                        "have its values: %s", where, self.kernel_name, key.digest[:12], rec.config)
            return None
        return matches[0]

    def _stored_timings(self, key: TuneKey, configs: Sequence[Config], best: Config,
                        best_ms: float) -> dict[Config, list[float]]:
        """`configs_timings` after a hit: the last stored median of each candidate, in ms."""
        from .config_cache import CACHE

        timings: dict[Config, list[float]] = {}
        store = CACHE.store()
        if store is not None:
            trials = CACHE.store_call("read trials", lambda: store.trials(key.digest), [])
            by_values = {canonical_json(v): c for c in configs if (v := config_values(c)) is not None}
            for t in trials:
                c = by_values.get(canonical_json(t.config))
                if c is not None:
                    timings[c] = [t.median_ms if t.status == "ok" and t.median_ms is not None else math.inf]
        timings[best] = [best_ms]
        return timings

    def _persist(self, key: TuneKey, device: DeviceClass, tuning_key: tuple, configs: list[Config]) -> None:
        """Store (and publish) what the benchmark just chose, with every candidate's timing."""
        from .store import ConfigRecord, TrialRecord, whoami

        best = self.cache[tuning_key]
        values = config_values(best)
        best_ms = _median(self.configs_timings.get(best))
        if values is None or not (math.isfinite(best_ms) and best_ms > 0):
            log.info("tunecache: not keeping %s's config %s (not plain values, or no valid timing)",
                     self.kernel_name, best)
            return
        trials = []
        for config, timing in self.configs_timings.items():
            v = config_values(config)
            ms = _median(timing)
            if v is not None:
                trials.append(TrialRecord(v, "ok", median_ms=ms) if math.isfinite(ms)
                              else TrialRecord(v, "failed", error="did not compile or ran out of resources"))
        rec = ConfigRecord(key=key, config=values, median_ms=best_ms, candidates=len(configs),
                           device_name=device.name, tuned_by=whoami(), source="inline")
        from .config_cache import CACHE

        kept, won = CACHE.keep(rec, trials, tune_seconds=getattr(self, "bench_time", None))
        if not won:
            # the store keeps a winner within its margin of ours (another process tuned the
            # same key): run that one, so that every process of the host agrees
            live = self.live_config(kept, key, configs, "stored")
            if live is not None:
                self.cache[tuning_key] = live


# ---- helpers ------------------------------------------------------------------------------


def config_values(config: Config) -> dict | None:
    """A config as the store keeps it, or None if it is not plain values (then it is not kept)."""
    from tunecache_kernels.spaces import TritonConfigSchema

    if config.ir_override is not None:  # a file on this host; its contents are no value
        return None
    values = {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
              "num_ctas": config.num_ctas, "maxnreg": config.maxnreg}
    return values if TritonConfigSchema().contains(values) else None


def _same_values(config: Config, wanted: str) -> bool:
    values = config_values(config)
    return values is not None and canonical_json(values) == wanted  # strict: 1, 1.0 and true differ


def kernel_name(fn: Callable) -> str:
    """'triton:<module>.<qualname>' of the Python function under the jit."""
    name = f"{KERNEL_PREFIX}{fn.__module__}.{fn.__qualname__}"
    if len(name) > _KERNEL_NAME_MAX:
        digest = hashlib.sha256(name.encode()).hexdigest()[:16]
        name = f"{name[:_KERNEL_NAME_MAX - 17]}~{digest}"
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


def current_device() -> DeviceClass:
    """The device Triton launches on: TUNECACHE_DEVICE if set, the interpreter, or the current GPU."""
    override = settings.device_override()
    if override:
        return DeviceClass.parse(override)
    if knobs.runtime.interpret:
        return interpreter_device()
    from triton.runtime.driver import driver

    return cuda_device(driver.active.get_current_device())


def wall_clock_bench(fn: Callable[[], Any], quantiles: Sequence[float] | None = None, reps: int = 3) -> Any:
    """`do_bench` for the interpreter: one untimed call, then the wall clock over `reps` calls."""
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    if quantiles is None:
        return statistics.median(samples)
    samples.sort()
    return [_quantile(samples, q) for q in quantiles]


def _quantile(sorted_samples: list[float], q: float) -> float:
    pos = q * (len(sorted_samples) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_samples) - 1)
    return sorted_samples[lo] + (sorted_samples[hi] - sorted_samples[lo]) * (pos - lo)


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
