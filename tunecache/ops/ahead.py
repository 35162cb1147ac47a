"""`tunecache.tune_all(shapes)`: tune a model's shapes ahead of its first step, the work split
over every process of the host that calls it at the same time (the ranks of a job, each on its
own GPU).

Each process walks the shapes longest tune first and takes every key no other process holds
(`ConfigCache.turn(wait=False)`), tuning it on its own GPU; the keys others held it then waits
for, and runs their winners. N ranks of a host thus tune each shape once between them, about N
times as fast as one rank alone, and every rank ends with the same winners. While a shape's
candidates are timed, the next shapes' first candidates compile (`_CompileAhead`).

`tunecache.tune_model(model, x)`: the same for the shapes a model's step asks of the ops, read
from the model itself.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from tunecache.cache.config_cache import CACHE
from tunecache.key import DeviceClass, local_device, torch_device_for

log = logging.getLogger("tunecache")


@dataclass
class TuneAllReport:
    total: int  # shapes (distinct keys) asked for
    already: int = 0  # had a winner before
    tuned: int = 0  # tuned by this process
    by_others: int = 0  # tuned by another process of the host meanwhile
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _planned(shapes: Any, device: DeviceClass) -> list:
    from tunecache.fleet.pretune import Manifest, Shape, load_manifest, longest_first, plan
    from tunecache.shapes import canonical_problem

    if isinstance(shapes, (str, os.PathLike)):
        manifest = load_manifest(shapes)
    elif isinstance(shapes, Manifest):
        manifest = shapes
    else:
        manifest = Manifest(name="tune_all", path=Path("tune_all"))
        for op, given in shapes:
            manifest.shapes.append(Shape(op, dict(given), canonical_problem(op, dict(given))))
    return longest_first(plan(manifest, device), device)


class _CompileAhead:
    """The next shapes' first candidates compiled while this one's are timed: a tune's GPU time
    and its compiles overlap across shapes (the compile workers take them only when no tune
    waits for a compile). Asked on a thread: ranking a shape's candidates takes time too."""

    WINDOW = 3  # shapes asked ahead of the one being tuned

    def __init__(self, todo: list, device: DeviceClass) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.todo, self.device, self.asked = todo, device, 0
        on = device.arch != "cpu" and len(todo) > 1
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tunecache-ahead") if on else None

    def at(self, i: int) -> None:
        """Shape i is tuned now: ask for shapes i+1 .. i+WINDOW's compiles."""
        if self._thread is None:
            return
        self.asked = max(self.asked, i + 1)
        while self.asked < min(i + 1 + self.WINDOW, len(self.todo)):
            p, mod, _ = self.todo[self.asked]
            self._thread.submit(self._ask, mod, p.shape.problem)
            self.asked += 1

    def _ask(self, mod: Any, problem: dict) -> None:
        from tunecache.tuning.compile_pool import compile_ahead
        from tunecache.tuning.tuner import first_candidates

        try:
            first = first_candidates(mod, problem, self.device, CACHE.ranking(mod.KERNEL, self.device))
            compile_ahead(mod, problem, first, self.device)
        except Exception as e:  # noqa: BLE001 - only a head start: the tune compiles what it needs
            log.debug("tunecache: compiling %s %s ahead failed: %s", mod.KERNEL, problem, e)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)


def tune_all(shapes: str | os.PathLike | Iterable[tuple[str, dict]], gpu: int | None = None) -> TuneAllReport:
    """Tune every shape of `shapes` (a manifest's name or path, as `tunecache pretune` takes, or
    (op, {KEY: VALUE}) pairs as `tunecache tune -p` takes) that has no winner yet, on this
    process's GPU (`gpu`, default the current one), sharing the shapes with every process of the
    host that runs `tune_all` over the same store meanwhile. Returns what was done."""
    from tunecache import backends
    from tunecache.ops.launcher import announce_tune, launchable
    from tunecache.tuning.tuner import TuneError, tune

    t0 = time.perf_counter()
    device = local_device(gpu)
    if device.arch != "cpu" and gpu is None:
        import torch

        gpu = torch.cuda.current_device()
    where = torch_device_for(device, gpu)
    planned = _planned(shapes, device)
    report = TuneAllReport(total=len(planned))

    def settle(p: Any, mod: Any, check: Any, wait: bool) -> bool:
        """Tune p's key if it is this process's turn; False: another process holds it (wait=False)."""
        with CACHE.turn(p.key, check, wait=wait) as turn:
            if not turn.held and not turn.waited:
                return False
            if CACHE.get(p.key, check) is not None:  # it had none when this call began
                report.by_others += 1
                return True
            problem = p.shape.problem
            try:
                announce = announce_tune(mod, problem, device, where)
                ranking = CACHE.ranking(mod.KERNEL, device)
                result = tune(
                    mod, problem, device, torch_device=where, progress=announce, hint=turn.hint, ranking=ranking
                )
            except TuneError as e:
                report.failed.append(f"{p.kernel} {problem}: {e}")
                return True
            CACHE.keep_tuned(result, device)
            report.tuned += 1
            return True

    todo = []
    for p in planned:
        mod = backends.module_for_kernel(p.kernel)
        check = launchable(mod, p.shape.problem, device)
        if CACHE.get(p.key, check) is not None:
            report.already += 1
        else:
            todo.append((p, mod, check))
    ahead = _CompileAhead(todo, device)
    later = []
    try:
        for i, t in enumerate(todo):
            ahead.at(i)
            if not settle(*t, wait=False):
                later.append(t)
    finally:
        ahead.close()
    for t in later:  # another process had each of these: its winner, or this process's own tune
        settle(*t, wait=True)
    report.seconds = time.perf_counter() - t0
    log.warning(
        "tunecache: tune_all on %s: %d shape(s), %d had a winner, %d tuned here, %d by other processes%s in %.1f s",
        device,
        report.total,
        report.already,
        report.tuned,
        report.by_others,
        f", {len(report.failed)} failed" if report.failed else "",
        report.seconds,
    )
    return report


def tune_model(model: Any, example: Any, *, training: bool = True, gpu: int | None = None) -> TuneAllReport:
    """Tune every shape `model` asks of tunecache's ops for an input like `example` (a tensor:
    only its shape and dtype are read) before its first step: the shapes are read from one
    forward pass on the meta device (the model itself is not touched), with their backward
    passes' shapes when `training`, then tuned together by `tune_all` (the next shapes compile
    while this one's are timed). The layers' precision is the model's floating parameters'."""
    import torch

    from tunecache.model_shapes import entries
    from tunecache_kernels.problems import DTYPES, dtype_name

    if not isinstance(example, torch.Tensor) or example.dim() < 1:
        raise TypeError(f"tune_model: `example` must be a tensor of one batch of inputs, got {type(example).__name__}")
    floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
    name = dtype_name(floats[0] if floats else example.dtype)
    if name not in DTYPES:
        raise TypeError(f"tune_model: the model's parameters are {name}; tunecache's ops take {', '.join(DTYPES)}")
    found, _ = entries(
        model,
        tuple(example.shape[1:]),
        example.shape[0],
        name,
        training=training,
        input_dtype=dtype_name(example.dtype),
    )
    return tune_all([(op, e.fields) for e in found for op in e.ops], gpu=gpu)
