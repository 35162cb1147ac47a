"""Compile many configs at once in warm worker processes (`tunecache.tuning.isolated`), one per
CPU core. Identical specs are compiled once: configs that differ only in runtime arguments of
the kernel (GROUP_M, SPLIT_K) share their kernel, and the reduction kernel of split-K is shared
by every split.

The tuner uses `compile_configs_as_ready` to precompile its candidates and drop those the
compiler rejects or that do not fit the device; `tunecache compile` prints the same reports
as JSON (`compile_space`).
"""

from __future__ import annotations

import json
import os
import threading
from types import ModuleType
from typing import Any, Callable, Iterable, Iterator

from tunecache import settings
from tunecache.errors import short
from tunecache.key import DeviceClass
from tunecache.tuning.compile import (
    ERROR_CHARS,
    ConfigReport,
    KernelReport,
    arch_of,
    backend_module,
    canonical_problem,
    config_report,
    device_for,
    spec_key,
)
from tunecache.tuning.isolated import WorkerFailed, compile_pool


def compile_in_fresh_processes(
    jobs: list[tuple[ModuleType, dict, dict, int]], device: DeviceClass, arch: str
) -> list[dict]:
    """Compile (module, problem, config, spec index) jobs in the compile workers; for each, the
    text assembly (`asm`: ttir, ttgir, llir, ptx) and the shared memory it uses (`shared`).

    The workers never run Triton's CPU interpreter, which may leave a process unable to
    compile Gluon correctly: an interpreted call of a @jit helper (tl.cdiv, say) patches
    triton.language and never restores it (triton/runtime/interpreter.py)."""
    pool = compile_pool(default_workers())
    msgs = [
        {"cmd": "asm", "task": [mod.__name__, p, c, i, arch_of(arch), [device.arch, device.sm_count]]}
        for mod, p, c, i in jobs
    ]
    out = []
    for answer in pool.run(msgs, settings.compile_timeout_s()):
        if isinstance(answer, WorkerFailed):
            raise RuntimeError(f"compiling failed: {answer.reason}")
        out.append(answer)
    return out


_LAUNCH_UTILS_ASKED: set[str | None] = set()  # Triton cache dirs a worker was asked to build it in


def prebuild_launch_utils() -> None:
    """Have a compile worker build (or find in Triton's cache) the C module every launch goes
    through, which Triton otherwise builds at a process's first launch on a host with an empty
    cache (a second of gcc, in the trial runner while the candidates wait). Once per Triton
    cache in a process: it lives there. Fire and forget."""
    cache = os.environ.get("TRITON_CACHE_DIR")
    if cache in _LAUNCH_UTILS_ASKED:
        return
    _LAUNCH_UTILS_ASKED.add(cache)
    compile_pool(default_workers()).submit({"cmd": "launch_utils"}, settings.compile_timeout_s())


def default_workers() -> int:
    """TUNECACHE_COMPILE_WORKERS, else the cores this process may run on; a rank of a job whose
    processes share the host's cores (torchrun's LOCAL_WORLD_SIZE, no CPU binding) takes its
    share, so that N ranks tuning at once do not start N compile processes per core."""
    n = settings.compile_workers()
    if n:
        return n
    total = max(1, os.cpu_count() or 1)
    try:
        mine = max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        mine = total
    return max(1, mine // settings.local_ranks()) if mine >= total else mine


def _run_tasks(tasks: list[tuple], keys: list[str], workers: int, env: dict) -> Iterator[tuple[int, KernelReport]]:
    """Compile each task in the warm compile workers (`tunecache.tuning.isolated`): processes with
    their own entry point, so any `__main__` can compile. A task that kills its worker (ptxas
    or LLVM crashing, the OOM killer) or runs past TUNECACHE_COMPILE_TIMEOUT_S fails alone. A
    task already asked ahead (`compile_ahead`, by its spec key `keys[i]`) is not asked again:
    it is hurried, or its answer taken. Yields (task index, report) as each one finishes."""
    if not tasks:
        return
    from concurrent.futures import FIRST_COMPLETED, wait

    pool = compile_pool(max(1, workers), env)  # a worker starts at its first task
    futures = {}
    taken = set()  # the futures of compiles asked ahead
    for i, t in enumerate(tasks):
        f = _ahead_of(pool, keys[i])
        if f is not None:
            taken.add(f)
        futures[f if f is not None else _submit(pool, t)] = i
    while futures:
        done, _ = wait(futures, return_when=FIRST_COMPLETED)
        for f in done:
            i, answer = futures.pop(f), f.result()
            if isinstance(answer, WorkerFailed) and f in taken:
                futures[_submit(pool, tasks[i])] = i  # asked ahead and lost (a pool closed): now
            elif isinstance(answer, WorkerFailed):
                error = short(f"compile worker: {answer.reason}", ERROR_CHARS)
                yield i, KernelReport(f"spec {tasks[i][3]}", False, error=error)
            else:
                yield i, KernelReport(**answer)


def _submit(pool: Any, task: tuple, ahead: bool = False) -> Any:
    return pool.submit({"cmd": "compile", "task": list(task)}, settings.compile_timeout_s(), ahead=ahead)


# compiles asked ahead of their tune (spec key -> (pool, future)), until a tune takes them
_AHEAD: dict[str, tuple[Any, Any]] = {}
_AHEAD_LOCK = threading.Lock()


def _ahead_of(pool: Any, key: str) -> Any:
    """The future of `key`'s compile asked ahead in `pool`, hurried to the front; None if none."""
    with _AHEAD_LOCK:
        found = _AHEAD.pop(key, None)
    if found is None or found[0] is not pool:
        return None
    pool.hurry(found[1])
    return found[1]


def compile_ahead(mod: ModuleType, problem: dict, configs: Iterable[dict], device: DeviceClass) -> int:
    """Compile `configs` for `problem` in the compile workers behind every compile a tune waits
    for, and return at once: a later tune of the problem finds them done, or in progress and
    takes them over (`tunecache.tune_all` compiles its next shapes' first candidates while it
    times this one's). Returns how many compiles were asked."""
    if device.arch == "cpu" or not hasattr(mod, "compile_specs"):
        return 0
    arch = arch_of(device)
    pool = compile_pool(default_workers())  # the pool a tune compiles in (compile_configs_as_ready)
    asked = 0
    for cfg in configs:
        try:
            specs = _spec_tasks(mod, problem, cfg, device, arch)
        except Exception:  # noqa: BLE001 - the tune reports it
            continue
        for k, task in specs:
            with _AHEAD_LOCK:
                if k in _AHEAD:
                    continue
                _AHEAD[k] = (pool, _submit(pool, task, ahead=True))
            asked += 1
    return asked


def _spec_tasks(mod: ModuleType, problem: dict, cfg: dict, device: DeviceClass, arch: str) -> list[tuple[str, tuple]]:
    """(spec key, compile task) of each kernel `cfg` launches: same key, same binary."""
    specs = mod.compile_specs(problem, cfg, device)
    task = (mod.__name__, problem, cfg)
    return [(spec_key(spec, arch), (*task, i, arch, (device.arch, device.sm_count))) for i, spec in enumerate(specs)]


# ---- configs -----------------------------------------------------------------------------------


def compile_configs(
    mod: ModuleType,
    problem: dict,
    configs: Iterable[dict],
    device: DeviceClass | str,
    *,
    progress: Callable[[int, int], None] | None = None,
    **options: Any,
) -> list[ConfigReport]:
    """`compile_configs_as_ready`'s reports (`options`: its keywords), one per config, in order;
    progress(done, total) is called as each config's compile ends."""
    configs = list(configs)
    done: dict[int, ConfigReport] = {}
    for i, report in compile_configs_as_ready(mod, problem, configs, device, **options):
        done[i] = report
        if progress is not None:
            progress(len(done), len(configs))
    return [done[i] for i in range(len(configs))]


def compile_configs_as_ready(
    mod: ModuleType,
    problem: dict,
    configs: Iterable[dict],
    device: DeviceClass | str,
    *,
    workers: int | None = None,
    cache_dir: str | None = None,
    unfit_suffices: Callable[[dict], bool] | None = None,
) -> Iterator[tuple[int, ConfigReport]]:
    """Compile every kernel of every config for the device's target, yielding (index, report)
    for each config as soon as all its kernels are compiled: the tuner times one candidate while
    the others still compile. Identical specs are compiled once (in parallel across `workers`
    processes). unfit_suffices(config): only whether the config fits is asked (a check that
    pruning may drop it): a kernel that only such configs need stops at its allocation where
    that does not fit."""
    arch = arch_of(device)
    if not isinstance(device, DeviceClass):
        device = device_for(arch)
    configs = list(configs)
    unique: dict[str, int] = {}
    tasks: list[tuple] = []
    keys: list[str] = []  # each task's spec key
    plan: list[list[tuple[int, bool]] | str] = []  # per config: [(task index, shared)] or an error
    for cfg in configs:
        try:
            specs = _spec_tasks(mod, problem, cfg, device, arch)
        except Exception as e:
            plan.append(short(f"compile_specs failed: {type(e).__name__}: {e}", ERROR_CHARS))
            continue
        entries = []
        for k, task in specs:
            if k in unique:
                entries.append((unique[k], True))
            else:
                unique[k] = len(tasks)
                keys.append(k)
                tasks.append(task)
                entries.append((unique[k], False))
        plan.append(entries)
    if unfit_suffices is not None:  # a kernel stops at its allocation only if no config needs more
        whole = {
            idx for c, e in enumerate(plan) if not isinstance(e, str) and not unfit_suffices(configs[c]) for idx, _ in e
        }
        tasks = [(*t, i not in whole) for i, t in enumerate(tasks)]
    waiting: dict[int, set[int]] = {}  # task index -> configs that need it
    left: dict[int, int] = {}  # config index -> tasks it still waits for
    for c, entry in enumerate(plan):
        if isinstance(entry, str) or not entry:
            yield c, config_report(configs[c], arch, entry, [])
            continue
        needed = {idx for idx, _ in entry}
        left[c] = len(needed)
        for idx in needed:
            waiting.setdefault(idx, set()).add(c)
    env = {"TRITON_CACHE_DIR": cache_dir} if cache_dir else {}
    results: dict[int, KernelReport] = {}
    for idx, report in _run_tasks(tasks, keys, workers or default_workers(), env):
        results[idx] = report
        for c in sorted(waiting.get(idx, ())):
            left[c] -= 1
            if left[c] == 0:
                yield c, config_report(configs[c], arch, plan[c], results)


def compile_space(
    op: str,
    backend: str,
    arch: str,
    problem: dict | None = None,
    *,
    all_configs: bool = False,
    workers: int | None = None,
    sm_count: int | None = None,
    cache_dir: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[ConfigReport]:
    """`tunecache compile`: the backend's candidates for the problem (its config_space after
    prune) or, with all_configs, every config of its space, each marked with `pruned`.
    progress(done, total) is called as each config's compile ends."""
    from tunecache_kernels.spaces import space_for

    mod = backend_module(op, backend)
    if not hasattr(mod, "compile_specs"):
        raise ValueError(f"{mod.KERNEL} has no compile_specs: only Gluon backends compile for a target")
    device = device_for(arch, sm_count)
    p = canonical_problem(op, problem)
    if not mod.supports(p, device):
        raise ValueError(f"{mod.KERNEL} does not support this problem on {arch_of(arch)}: {p}")
    if all_configs:
        configs = list(space_for(mod.KERNEL))
    else:
        configs = mod.prune(mod.config_space(p, device), p, device)
    kept = {json.dumps(c, sort_keys=True) for c in mod.prune(configs, p, device)}
    reports = compile_configs(mod, p, configs, device, progress=progress, workers=workers, cache_dir=cache_dir)
    for r in reports:
        r.pruned = json.dumps(r.config, sort_keys=True) not in kept
    return reports
