"""From a call to a launch: memo -> local store -> fleet -> miss policy.

The hot path is `Op.memo.get(raw)` in `ops`: a dict lookup on the raw shapes, strides,
dtypes and arguments, then the cached launch. Everything below runs once per raw shape.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

from . import registry, settings
from .key import DeviceClass, TuneKey, device_of
from .store import ConfigRecord, Store, default_store
from .tuner import make_key, tune

log = logging.getLogger("tunecache")


class MissingConfig(LookupError):
    """Miss policy `strict` and no tuned config for this key."""


@dataclass
class Entry:
    """A memoized decision: the backend's launch bound to a config."""

    run: Callable[..., Any]
    config: dict
    kernel: str
    provisional: bool = False  # a default; ask the store again after `recheck_at`
    recheck_at: float = math.inf
    key: TuneKey | None = None


class Op:
    """One op (e.g. "conv2d_fprop"): its memo and the slow path that fills it."""

    def __init__(self, name: str, problem_fn: Callable[..., dict]) -> None:
        self.name = name
        self.problem_fn = problem_fn
        self.memo: dict[tuple, Entry] = {}
        self._lock = threading.Lock()

    def resolve(self, raw: tuple, args: tuple, device_tensor: Any) -> Entry:
        """The slow path: check arguments, pick a backend, look up or tune, memoize."""
        entry = self.memo.get(raw)
        if entry is not None and entry.provisional:
            entry = self._recheck(raw, entry)
            if entry is not None:
                return entry
        problem = self.problem_fn(*args)  # raises errors naming the bad argument
        device = device_of(device_tensor)
        mod = registry.backend_for(self.name, device, problem, settings.backend_override())
        with self._lock:  # one tune per shape per process, even under threads
            entry = self.memo.get(raw)
            if entry is None or entry.provisional:
                entry = _decide(mod, problem, device)
                self.memo[raw] = entry
        return entry

    def _recheck(self, raw: tuple, entry: Entry) -> Entry | None:
        if time.monotonic() < entry.recheck_at:
            return entry
        mod = registry.module_for_kernel(entry.kernel)
        rec = _lookup(mod, entry.key)
        if rec is None:
            entry.recheck_at = time.monotonic() + settings.recheck_seconds()
            return entry
        new = Entry(_bind(mod, rec.config), rec.config, mod.KERNEL, key=entry.key)
        self.memo[raw] = new
        return new

    def clear(self) -> None:
        self.memo.clear()


def _bind(mod: ModuleType, config: dict) -> Callable[..., Any]:
    launch = mod.launch

    def run(*args):
        return launch(config, *args)

    return run


def valid_record(kernel: str, rec: ConfigRecord | None, key: TuneKey, where: str) -> ConfigRecord | None:
    """A record is launched only if it is this key's and its config lies in the kernel's space
    (the ops and `@tunecache.autotune` both check what they read through here)."""
    if rec is None:
        return None
    from tunecache_kernels.spaces import space_for

    if rec.key.digest != key.digest:
        log.warning("tunecache: ignoring a %s entry for another key (%s)", where, rec.key.kernel)
        return None
    try:
        space_for(kernel).check(rec.config)
    except ValueError as e:
        log.warning("tunecache: ignoring %s config of %s %s: %s", where, kernel, key.digest[:12], e)
        return None
    return rec


def _fleet():
    url = settings.server_url()
    if not url:
        return None
    from .client import fleet_client

    return fleet_client(url)


def _lookup(mod: ModuleType, key: TuneKey, store: Store | None = None) -> ConfigRecord | None:
    store = store or default_store()
    rec = valid_record(mod.KERNEL, store.get_config(key.digest), key, "stored")
    if rec is not None:
        return rec
    fleet = _fleet()
    if fleet is None:
        return None
    rec = valid_record(mod.KERNEL, fleet.lookup(key), key, "fleet")
    if rec is not None:
        rec.source = "fleet"
        store.put_config(rec)  # write-through: the next process on this host needs no network
    return rec


def _decide(mod: ModuleType, problem: dict, device: DeviceClass) -> Entry:
    key = make_key(mod, problem, device)
    store = default_store()
    rec = _lookup(mod, key, store)
    if rec is not None:
        return Entry(_bind(mod, rec.config), rec.config, mod.KERNEL, key=key)
    policy = settings.miss_policy()
    if policy == "strict":
        raise MissingConfig(
            f"no tuned config for {mod.KERNEL} {problem} on {device} (digest {key.digest[:12]}) and "
            f"TUNECACHE_MISS_POLICY=strict; tune it with `tunecache tune` or pre-tune a manifest")
    if policy == "tune":
        result = tune(mod, problem, device, store)
        fleet = _fleet()
        if fleet is not None and result.stored is not None:
            fleet.publish(result.stored, result.trials)
        config = result.stored.config if result.stored is not None else result.config
        return Entry(_bind(mod, config), config, mod.KERNEL, key=key)
    # policy "default": run something reasonable now, let a worker tune it
    config = nearest_neighbour(mod, problem, device, store) or mod.default_config(problem, device)
    store.enqueue(key)
    fleet = _fleet()
    if fleet is not None:
        fleet.enqueue(key)
    return Entry(_bind(mod, config), config, mod.KERNEL, provisional=True,
                 recheck_at=time.monotonic() + settings.recheck_seconds(), key=key)


_SIZE_FIELDS = ("M", "N", "K", "gemm_M", "gemm_N", "gemm_K")


def nearest_neighbour(mod: ModuleType, problem: dict, device: DeviceClass, store: Store) -> dict | None:
    """The config of the closest tuned problem of this kernel version and device class.

    Distance is in log space over the GEMM sizes; categorical fields (dtype, layouts, filter,
    stride) must match, and the config must survive this problem's pruning.
    """
    key = make_key(mod, problem, device)
    best, best_d = None, math.inf
    for rec in store.list_configs(kernel=mod.KERNEL, arch=device.arch):
        k = rec.key
        if (k.kernel_version, k.triton_version, k.sm_count) != (key.kernel_version, key.triton_version,
                                                               key.sm_count):
            continue
        other = k.problem
        if any(other.get(f) != v for f, v in problem.items()
               if not isinstance(v, int) or f in ("R", "S", "stride_h", "stride_w", "pad_h", "pad_w")):
            continue
        d = sum(abs(math.log(max(1, problem[f])) - math.log(max(1, other.get(f, 1))))
                for f in _SIZE_FIELDS if f in problem)
        if d < best_d and valid_record(mod.KERNEL, rec, k, "stored") and mod.prune([rec.config], problem, device):
            best, best_d = rec.config, d
    return best
