"""First contact: a backend proves itself on a device class before its configs are trusted.

Before the ops use a backend on a device class (compute capability and SM count) at a kernel
version, its default config runs a small grid of problems per op in the isolated trial runner
(`tunecache.tuning.isolated`) and each output is checked against PyTorch. The verdict is kept in the
store, so it runs once per host. A backend that fails, crashes or hangs is skipped for the next
one (blackwell -> hopper -> portable, then PyTorch itself) with one warning that names it. This
is how kernels never run on a device class (the Blackwell ones, before a B200 is at hand) meet it:
in a process of their own, not inside somebody's training step.

`tunecache selftest` runs it on demand and prints a table.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

from tunecache import settings
from tunecache.errors import short
from tunecache.key import DeviceClass, torch_device_for, triton_version

if TYPE_CHECKING:
    from tunecache.store.records import ConfigRecord
    from tunecache.tuning.tuner import TuneResult

log = logging.getLogger("tunecache")

# Small problems that take each kernel's distinct paths: ragged tiles, both layouts, strides,
# paddings, 1x1 and 3x3 filters, odd channel counts, a stem's 3 input channels (the packed-taps
# kernels of conv fprop and wgrad) (canonicalised by compile.canonical_problem).
GRID: dict[str, list[dict]] = {
    "matmul": [
        {"M": 256, "N": 256, "K": 256, "dtype": "bfloat16"},
        {"M": 200, "N": 136, "K": 72, "dtype": "float16"},
        {"M": 128, "N": 192, "K": 64, "dtype": "bfloat16", "a_layout": "col", "b_layout": "col"},
    ],
    "conv2d_fprop": [
        {"N": 2, "H": 14, "W": 14, "Ci": 64, "Co": 64, "R": 3, "S": 3, "stride": 1, "padding": 1, "dtype": "bfloat16"},
        {"N": 3, "H": 15, "W": 13, "Ci": 40, "Co": 24, "R": 3, "S": 3, "stride": 2, "padding": 0, "dtype": "bfloat16"},
        {"N": 2, "H": 8, "W": 8, "Ci": 64, "Co": 128, "R": 1, "S": 1, "stride": 1, "padding": 0, "dtype": "float16"},
        {"N": 2, "H": 20, "W": 18, "Ci": 3, "Co": 64, "R": 7, "S": 7, "stride": 2, "padding": 3, "dtype": "bfloat16"},
    ],
    "conv2d_wgrad": [
        {"N": 2, "H": 14, "W": 14, "Ci": 64, "Co": 64, "R": 3, "S": 3, "stride": 1, "padding": 1, "dtype": "bfloat16"},
        {"N": 3, "H": 15, "W": 13, "Ci": 40, "Co": 24, "R": 3, "S": 3, "stride": 2, "padding": 0, "dtype": "bfloat16"},
        {"N": 2, "H": 8, "W": 8, "Ci": 64, "Co": 128, "R": 1, "S": 1, "stride": 1, "padding": 0, "dtype": "float16"},
        {"N": 2, "H": 20, "W": 18, "Ci": 3, "Co": 64, "R": 7, "S": 7, "stride": 2, "padding": 3, "dtype": "bfloat16"},
    ],
    # a 3x3 at stride 1 (one phase: the TMA-store epilogue), at stride 2 over odd sizes (four
    # phases of 4, 2, 2, 1 taps), and a strided 1x1 (three phases no tap reaches)
    "conv2d_dgrad": [
        {"N": 2, "H": 14, "W": 14, "Ci": 64, "Co": 64, "R": 3, "S": 3, "stride": 1, "padding": 1, "dtype": "bfloat16"},
        {"N": 3, "H": 15, "W": 13, "Ci": 40, "Co": 24, "R": 3, "S": 3, "stride": 2, "padding": 1, "dtype": "bfloat16"},
        {"N": 2, "H": 8, "W": 8, "Ci": 64, "Co": 128, "R": 1, "S": 1, "stride": 2, "padding": 0, "dtype": "float16"},
    ],
}
# the interpreter is slow: its grid is the same problems, smaller
_CPU_SCALE = {"M": 64, "N": 48, "K": 40, "H": 7, "W": 6, "Ci": 5, "Co": 7}


@dataclass
class Verdict:
    kernel: str
    device: DeviceClass
    version: str
    ok: bool
    detail: str = ""
    seconds: float = 0.0
    cases: int = 0
    stored: bool = False  # read from the store rather than run now
    # the check itself could not run (the trial runner could not start or make inputs): not
    # the backend's fault, so not kept; the backend is still passed over in this process
    inconclusive: bool = False


def grid(op: str, device: DeviceClass) -> list[dict]:
    """The op's self-check problems, as canonical problem dicts."""
    from tunecache.tuning.compile import canonical_problem

    out = []
    for given in GRID[op]:
        if device.arch == "cpu":
            given = {
                **given,
                **{k: min(v, _CPU_SCALE[k]) for k, v in given.items() if k in _CPU_SCALE},
                "dtype": "float32",
            }
        p = canonical_problem(op, given)
        if p not in out:
            out.append(p)
    return out


def run_check(mod: ModuleType, device: DeviceClass, torch_device: str | None = None) -> Verdict:
    """Run the backend's default config over the grid in the isolated trial runner."""
    from tunecache.backends import kernel_version
    from tunecache.tuning.accuracy import tolerance
    from tunecache.tuning.tuner import Trials, make_key

    torch_device = torch_device or torch_device_for(device)
    t0 = time.perf_counter()
    failures, cases, inconclusive = [], 0, False
    for problem in grid(mod.OP, device):
        if not mod.supports(problem, device):
            continue
        cases += 1
        config = mod.default_config(problem, device)
        key = make_key(mod, problem, device)
        try:
            runner = Trials(mod, problem, key, torch_device, tolerance(problem))
            res = runner.run(config, {}, time_it=False)
        except Exception as e:  # noqa: BLE001 - the inputs could not even be made
            res = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
            inconclusive = True
        if res["status"] != "ok":  # one failure is the verdict: no need to crash it again
            failures.append(f"{_brief(problem)}: {res['status']}: {short(res.get('error') or '')}")
            break
    ok = cases > 0 and not failures
    detail = "; ".join(failures) if failures else ("no problem of the grid is supported" if not cases else "")
    return Verdict(
        mod.KERNEL, device, kernel_version(mod), ok, detail, time.perf_counter() - t0, cases, inconclusive=inconclusive
    )


def _brief(p: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in p.items() if not k.startswith("gemm_"))


_VERDICTS: dict[tuple, Verdict] = {}
_LOCK = threading.Lock()


def verdict(mod: ModuleType, device: DeviceClass, *, force: bool = False, torch_device: str | None = None) -> Verdict:
    """The stored verdict of this backend on this device class, running the check first if
    there is none (or `force`)."""
    from tunecache.cache.config_cache import CACHE

    k = _key(mod, device)
    with _LOCK:
        if not force and k in _VERDICTS:
            return _VERDICTS[k]
        found = None if force else CACHE.read_selfcheck(*k)
        if found is not None:
            v = Verdict(mod.KERNEL, device, k[1], found[0], found[1] or "", stored=True)
        else:
            log.info("tunecache: first contact of %s with %s: running its self-check", mod.KERNEL, device)
            v = run_check(mod, device, torch_device)
            if not v.inconclusive:
                _keep(k, v)
        _VERDICTS[k] = v
        return v


def _key(mod: ModuleType, device: DeviceClass) -> tuple:
    """What a verdict is of: the backend at its kernel version and Triton, on a device class."""
    from tunecache.backends import kernel_version

    return (mod.KERNEL, kernel_version(mod), triton_version(), device.arch, device.sm_count)


def _keep(k: tuple, v: Verdict) -> None:
    """Keep a verdict in the store (a store that cannot write keeps it in this process only;
    the process has it at once: the write may be left to a thread, `ConfigCache.write_behind`)."""
    from tunecache.cache.config_cache import CACHE

    CACHE.write_behind(
        "keep a self-check",
        lambda store: store.put_selfcheck(*k, ok=v.ok, detail=v.detail, seconds=v.seconds, device_name=v.device.name),
    )


def vouch(mod: ModuleType, device: DeviceClass, rec: "ConfigRecord") -> bool:
    """Take a fleet winner of this backend version on this device class as its verdict: a
    tuning host of the class ran the backend in its isolated runner and checked every output
    against PyTorch (and only tuning hosts make fleet winners). Kept like this host's own
    verdict, unless one is already kept (a failed one stays failed); `tunecache selftest
    --force` runs the check itself. Returns whether the fleet's word was taken."""
    if rec.source != "fleet" or (
        rec.key.kernel,
        rec.key.kernel_version,
        rec.key.triton_version,
        rec.key.arch,
        rec.key.sm_count,
    ) != _key(mod, device):
        return False
    return _take(
        mod,
        device,
        f"vouched for by the fleet: its winner {rec.digest[:12]} ran and was checked on "
        f"{rec.device_name or device} by {rec.tuned_by or 'a tuning host'}",
    )


def unknown(mod: ModuleType, device: DeviceClass) -> bool:
    """No verdict yet for this backend on this device class (none run, kept or vouched for)."""

    with _LOCK:
        return not _known(_key(mod, device))


def _known(k: tuple) -> bool:
    """A verdict is at hand for key k, in this process or the store (hold _LOCK)."""
    from tunecache.cache.config_cache import CACHE

    return k in _VERDICTS or CACHE.read_selfcheck(*k) is not None


def checked_by_tuning(mod: ModuleType, device: DeviceClass, result: "TuneResult", problem: dict) -> bool:
    """Take this host's own tuning run as the backend's verdict when its default config (what
    the first-contact check runs) was among the candidates that ran right: every candidate ran
    in the isolated runner and was checked against PyTorch before it was timed. Kept unless a
    verdict is already kept; nothing is taken from a tune whose default failed (the check
    itself runs then: launcher._decide)."""
    if result.default_ms is None:
        return False
    return _take(
        mod,
        device,
        f"checked by this host's tuning of {_brief(problem)}: its default config and "
        f"{result.candidates - 1} other candidates ran in the isolated runner, each checked against PyTorch",
    )


def _take(mod: ModuleType, device: DeviceClass, detail: str) -> bool:
    """Keep a passing verdict on others' or other runs' word, unless one is already kept."""

    k = _key(mod, device)
    with _LOCK:
        if _known(k):
            return False
        v = Verdict(mod.KERNEL, device, k[1], True, detail)
        _keep(k, v)
        _VERDICTS[k] = v
        return True


def applies(device: DeviceClass) -> bool:
    """Whether backends are checked on this device class (TUNECACHE_SELFCHECK)."""
    mode = settings.selfcheck_mode()
    return not (mode == "never" or (mode == "gpu" and device.arch == "cpu"))


def trusted(mods: list[ModuleType], device: DeviceClass, torch_device: str | None = None) -> list[ModuleType]:
    """`mods` (preferred first) less those whose self-check on this device class failed; the
    first one that passes is where the checking stops (the rest are its fallbacks)."""
    from tunecache.cache.config_cache import CACHE

    if not applies(device):
        return mods
    for i, mod in enumerate(mods):
        v = verdict(mod, device, torch_device=torch_device)
        if v.ok:
            return mods[i:]
        nxt = mods[i + 1].KERNEL if i + 1 < len(mods) else "PyTorch"
        what = "could not run its self-check" if v.inconclusive else "failed its self-check"
        CACHE.warn_once(
            f"tunecache: the {mod.KERNEL} backend {what} on {device} "
            f"({short(v.detail, 500)}); using {nxt} instead. `tunecache selftest --force` checks it again."
        )
    return []


def forget() -> None:
    """Drop the in-process verdicts (tests; `tunecache selftest --force`)."""
    with _LOCK:
        _VERDICTS.clear()
