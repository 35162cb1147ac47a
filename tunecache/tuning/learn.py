"""`tunecache learn`: the candidate ranking's trees trained again on everything measured since.

The package ships trees trained on the trials gathered for it (`tunecache.tuning.rank_model`).
A host's tunes, and the fleet's workers', add trials of shapes nobody gathered; the ranking
uses them at once through the nearest tuned problem's best, and this trains the trees on them
too, so that what they taught carries to shapes further away: the package's trials, this
store's and the fleet's (`GET /v1/trials`, workers' results only) together, per kernel, into
the file later tunes on this host read (`rank_model.learned_path`). Training needs LightGBM
(`pip install 'tunecache[learn]'`); ranking by its trees does not.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

# a kernel is trained on at least this many problems with two or more timed candidates each
MIN_PROBLEMS = 10
SOURCES = ("package", "store", "fleet")


@dataclass
class Learned:
    kernel: str
    problems: dict[str, int] = field(default_factory=dict)  # source -> problems it brought
    trials: int = 0
    seconds: float = 0.0
    trained: bool = False


def learn(arch: str, store: Any, fleet: Any, say: Callable[[str], None] = print) -> list[Learned]:
    """Train the trees of every kernel with trials on `arch` (the package's, `store`'s, `fleet`'s:
    either may be None) and write them as this host's; say what each kernel learned from."""
    from tunecache.tuning import rank_model, ranking
    from tunecache_kernels.spaces import kernels

    if arch == "cpu":
        raise ValueError("the interpreter's times (arch cpu) are not speeds: there is nothing to learn from them")
    _need_lightgbm()  # asked for before anything is read
    per_kernel: dict[str, dict[str, ranking.Trial]] = {}
    seen: dict[str, dict[str, set[str]]] = {}

    def add(source: str, rows: Iterable[tuple[str, ranking.Trial]]) -> None:
        for kernel, t in rows:
            pid = json.dumps(t.problem, sort_keys=True)
            per_kernel.setdefault(kernel, {})[json.dumps([pid, t.config], sort_keys=True)] = t
            seen.setdefault(kernel, {}).setdefault(source, set()).add(pid)

    add("package", ((k, t) for k, ts in ranking.shipped_by_kernel(arch).items() for t in ts))
    if store is not None:
        add("store", ranking.trial_rows(store.ranking_trials(arch, limit=1_000_000)))
    if fleet is not None:
        for kernel in sorted({*per_kernel, *(k for k in kernels() if not k.endswith(".portable"))}):
            add("fleet", ranking.trial_rows(fleet.trials(kernel, arch) or []))
    out, trees = [], {}
    package = {k: v.get("package", set()) for k, v in seen.items()}
    if not any(pid not in package[k] for k, v in seen.items() for s in SOURCES[1:] for pid in v.get(s, ())):
        say(f"nothing tuned on {arch} beyond the package's trials: its trees are what they would teach")
        return out
    for kernel, trials in sorted(per_kernel.items()):
        got = Learned(kernel, {s: len(seen[kernel].get(s, ())) for s in SOURCES}, len(trials))
        problems = len(set().union(*seen[kernel].values()))
        if problems < MIN_PROBLEMS:
            say(f"{kernel}: {problems} problems tuned on {arch}, fewer than {MIN_PROBLEMS}: not trained")
            out.append(got)
            continue
        t0 = time.perf_counter()
        trees[kernel] = rank_model.train(trials.values())
        got.seconds, got.trained = time.perf_counter() - t0, True
        from_ = ", ".join(f"{n} {s}" for s, n in got.problems.items())
        say(f"{kernel}: trained on {problems} problems ({from_}), {got.trials} trials, in {got.seconds:.1f} s")
        out.append(got)
    if trees:
        path = rank_model.write_learned(arch, trees)
        say(f"wrote {path}: later tunes on this host rank {', '.join(trees)} by these trees")
    return out


def _need_lightgbm() -> None:
    try:
        import lightgbm  # noqa: F401
    except ImportError:
        raise ImportError("training the trees needs LightGBM: pip install 'tunecache[learn]'") from None
