"""The candidates' order, learned from trials: time first what ran fastest on the nearest problems.

A tune used to time the first 48 candidates of a backend's static order (`prune`). Every tune
leaves its trials in the store (each candidate's time on that problem), so the order can be
learned: a new problem's candidates are ranked by how each ran, relative to the best, on the
tuned problems nearest to it (nearest-problem retrieval: log-scaled sizes, k nearest, closer
ones weigh more), and a tune times the first few of that order (`settings.max_candidates`).
A candidate no neighbour timed keeps its static place after the ones they did.

The trials come from three places, merged per kernel and architecture: the ones this package
ships (`trials/<arch>.json.gz`, gathered on a GPU by benchmarks/gather_trials.py, so a fresh
host ranks as a veteran does), the local store's, and the fleet's (`Fleet.trials`). With none,
the static order stands, and a tune times as many candidates as it always did.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

from tunecache import settings
from tunecache.shapes import problem_distance
from tunecache.tuning import rank_model
from tunecache.tuning.rank_model import TreeModel
from tunecache_kernels.spaces import is_vendor

# how many tuned problems vote on a candidate's rank, and how far the nearest may lie (in
# tunecache.shapes.problem_distance's units: natural-log size ratios, plus UNLIKE for each
# dtype, filter, stride or padding that differs) for a short list to be trusted; past it the
# tune widens (SHORT, WIDE below). Chosen on the 215 problems gathered on an H200, each left
# out in turn (benchmarks/eval_ranking.py).
NEIGHBOURS = 6
NEAR = 2.5
UNLIKE = 1.0


@dataclass(frozen=True)
class Trial:
    """One candidate's time on one tuned problem: a row the ranking learns from."""

    problem: dict
    config: dict
    median_ms: float


def _config_id(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


@dataclass
class Ranked:
    """A ranking's answer: the candidates in the order to time them, how near the nearest tuned
    problem was (None: none known), and whether the learned trees ordered them (else the
    neighbours did; neither: the static order stands)."""

    candidates: list[dict]
    nearest: float | None
    modelled: bool = False

    @property
    def learned(self) -> bool:
        return self.modelled or self.nearest is not None

    @property
    def confident(self) -> bool:
        """Whether a short list can be trusted: the trees ordered it, or a tuned problem lies near."""
        return self.modelled or (self.nearest is not None and self.nearest <= NEAR)


class Ranking:
    """Tuned problems of one kernel on one architecture, each candidate's time relative to the
    problem's best, and the learned trees of the kernel (tunecache.tuning.rank_model), if any."""

    def __init__(
        self, trials: Iterable[Trial] = (), model: TreeModel | None = None, sm_count: int = rank_model.SM_COUNT
    ) -> None:
        self._times: dict[str, tuple[dict, dict[str, float]]] = {}  # problem -> (it, config -> fastest ms)
        self._slowdowns: dict[str, tuple[dict, dict[str, float]]] = {}  # problem -> (it, config -> log(ms / best))
        self.model, self.sm_count = model, sm_count
        self.add(trials)

    @classmethod
    def shipped(cls, kernel: str, arch: str, sm_count: int = rank_model.SM_COUNT) -> "Ranking":
        """What the package ships for `kernel` on `arch`: its trials, and its trees (or this
        host's, where `tunecache learn` trained them)."""
        return cls(shipped(kernel, arch), rank_model.model(kernel, arch), sm_count)

    def add(self, trials: Iterable[Trial]) -> None:
        """Learn from more trials (a tune this process just ran): only the problems they are of
        are worked out again."""
        touched = set()
        for t in trials:
            if not (t.median_ms and t.median_ms > 0 and math.isfinite(t.median_ms)):
                continue
            pid = _config_id(t.problem)
            problem, times = self._times.setdefault(pid, (t.problem, {}))
            cid = _config_id(t.config)
            times[cid] = min(times.get(cid, math.inf), t.median_ms)
            touched.add(pid)
        for pid in touched:
            problem, times = self._times[pid]
            if len(times) >= 2:  # one candidate says nothing about an order
                best = min(times.values())
                self._slowdowns[pid] = (problem, {c: math.log(ms / best) for c, ms in times.items()})

    def __len__(self) -> int:
        return len(self._slowdowns)

    def order(self, candidates: Sequence[dict], problem: dict, exclude_self: bool = False) -> Ranked:
        """`candidates` (in their static order) as the trees score them, the best of the nearest
        tuned problem first where one lies within NEAR; without trees, those the nearest tuned
        problems timed first, by their weighted mean slowdown there, the rest after in their
        static order. `exclude_self`: leave out a tuned problem equal to this one (evaluating)."""
        if not candidates:
            return Ranked([], None)
        near = self._nearest(problem, exclude_self)
        if self.model is not None:
            ordered = self.model.order(candidates, problem, self.sm_count)
            if near and near[0][0] <= NEAR:  # what won nearby leads: the trees learn only where trials are gathered
                slowdown = near[0][2]
                known = [c for c in candidates if _config_id(c) in slowdown]
                if known:
                    first = min(known, key=lambda c: slowdown[_config_id(c)])
                    ordered = [first, *(c for c in ordered if c != first)]
            return Ranked(ordered, near[0][0] if near else None, modelled=True)
        if not near:
            return Ranked(list(candidates), None)
        scores: dict[int, float] = {}
        for i, c in enumerate(candidates):
            cid = _config_id(c)
            total = weight = 0.0
            for d, _, slowdown in near:
                if cid in slowdown:
                    w = 1.0 / (0.25 + d)
                    total += w * slowdown[cid]
                    weight += w
            if weight:
                # a candidate only far neighbours timed counts less than one the nearest did
                scores[i] = total / weight + 0.05 * (1.0 - weight * (0.25 + near[0][0]))
        known = sorted(scores, key=lambda i: (scores[i], i))
        rest = [i for i in range(len(candidates)) if i not in scores]
        return Ranked([candidates[i] for i in known + rest], near[0][0])

    def _nearest(self, problem: dict, exclude_self: bool) -> list[tuple[float, dict, dict[str, float]]]:
        """The NEIGHBOURS tuned problems nearest `problem`: (distance, it, config -> slowdown)."""
        near = sorted(
            ((problem_distance(problem, p, UNLIKE), p, s) for p, s in self._slowdowns.values()), key=lambda x: x[0]
        )
        if exclude_self:
            near = [x for x in near if x[0] > 0]
        return near[:NEIGHBOURS]


# ---- how many a tune times ------------------------------------------------------------------

# a tune's breadth by what the ranking knows: (candidates in all, of them at most this many
# run-time variants of the quick round's leaders, which cost no compile). A tuned problem near:
# the ranking's first ones, the default, variants. None near: the ranking's first WIDE_LEARNED,
# then the static order's first ones. Nothing known: the static order's first
# settings.max_candidates(). Chosen as NEAR was; the 12 held-out shapes bench_tuning timed on an
# H200 against the whole space pick within 1.5% of its best with these.
SHORT = (16, 4)
WIDE = (40, 4)
WIDE_LEARNED = 28
# a short list whose fastest candidate in the quick round stood LATE or later in it (counted from
# 0) was not set apart by the ranking: its next WIDEN are timed too. Held out of the trees'
# training (benchmarks/eval_ranking.py), conv problems within 2 % of their best went from 91-93 %
# to 94-97 % for 2-3 more candidates on average
LATE, WIDEN = 6, 8


@dataclass
class Shortlist:
    candidates: list[dict]
    siblings: int | None  # None: the tuner's own bound
    why: str
    rest: list[dict] = field(default_factory=list)  # the ranking's next ones, in its order

    def widen(self, fastest: int) -> list[dict]:
        """What to time after the quick round, where its fastest was `candidates[fastest]`."""
        return self.rest[:WIDEN] if fastest >= LATE else []


def shortlist(ranked: Ranked, static: list[dict], must: Sequence[dict] = ()) -> Shortlist:
    """The candidates a tune times first, `must` (the default) among them. TUNECACHE_MAX_CANDIDATES,
    when set, is the length whatever the ranking knows (0: all of them)."""
    if settings.max_candidates_given() or not ranked.learned:
        cap = settings.max_candidates()
        out = ranked.candidates[:cap] if cap else list(ranked.candidates)
        why = "learned order, capped" if ranked.learned else "static order"
        return Shortlist(out + [m for m in must if m not in out], None, why)
    n, variants = SHORT if ranked.confident else WIDE
    order = ranked.candidates if ranked.confident else _then(ranked.candidates[:WIDE_LEARNED], static)
    room = n - variants
    room -= sum(m not in order[:room] for m in must)
    out = order[:room]
    rest = [c for c in order[room:] if c not in must] if ranked.confident else []
    if ranked.modelled:
        why = "the learned trees"
    else:
        why = "a tuned problem near" if ranked.confident else f"nearest tuned problem {ranked.nearest:.1f} away"
    return Shortlist(out + [m for m in must if m not in out], variants, why, rest)


def _then(first: Sequence[dict], rest: Sequence[dict]) -> list[dict]:
    return [*first, *(c for c in rest if c not in first)]


# ---- where the trials come from -------------------------------------------------------------

_SHIPPED: dict[str, dict[str, list[Trial]]] = {}


def shipped(kernel: str, arch: str) -> list[Trial]:
    """The trials this package ships for `kernel` on `arch` (none for others)."""
    return shipped_by_kernel(arch).get(kernel, [])


def shipped_by_kernel(arch: str) -> dict[str, list[Trial]]:
    """Every kernel's trials this package ships for `arch`, read once."""
    if arch not in _SHIPPED:
        _SHIPPED[arch] = unpack(rank_model.read_shipped(f"{arch}.json.gz") or {})
    return _SHIPPED[arch]


def forget_shipped() -> None:
    """Read the shipped trials again at the next call: for whoever just rewrote the file."""
    _SHIPPED.clear()


def pack(trials: Iterable[tuple[str, Trial]]) -> dict:
    """(kernel, trial) pairs as the shipped file holds them: per kernel its problems and its
    configs once each, and rows of [problem index, config index, milliseconds]."""
    out: dict[str, dict] = {}
    index: dict[str, tuple[dict, dict]] = {}
    for kernel, t in trials:
        k = out.setdefault(kernel, {"problems": [], "configs": [], "rows": []})
        pi, ci = index.setdefault(kernel, ({}, {}))
        p, c = _config_id(t.problem), _config_id(t.config)
        if p not in pi:
            pi[p] = len(k["problems"])
            k["problems"].append(t.problem)
        if c not in ci:
            ci[c] = len(k["configs"])
            k["configs"].append(t.config)
        k["rows"].append([pi[p], ci[c], round(t.median_ms, 6)])
    return out


def unpack(data: dict) -> dict[str, list[Trial]]:
    return {kernel: [Trial(*row) for row in unpack_rows(k)] for kernel, k in data.items()}


def unpack_rows(packed: dict) -> Iterator[tuple[dict, dict, float]]:
    """One kernel's packed trials (the shipped file's, GET /v1/trials's answer) as (problem,
    config, milliseconds); rows that point nowhere or hold no positive time are left out (the
    ranking only orders: every candidate is still timed where it runs)."""
    problems, configs = packed["problems"], packed["configs"]
    for p, c, ms in packed["rows"]:
        if not (isinstance(p, int) and isinstance(c, int) and isinstance(ms, (int, float))):
            continue
        if 0 <= p < len(problems) and 0 <= c < len(configs) and ms > 0:
            yield problems[p], configs[c], float(ms)


def trial_rows(rows: Iterable[tuple]) -> Iterable[tuple[str, Trial]]:
    """A store's (kernel, problem, config, milliseconds) rows as (kernel, Trial), less the
    vendor's op (a row of every tune, not a candidate to rank)."""
    for kernel, problem, config, ms in rows:
        if isinstance(config, dict) and isinstance(problem, dict) and not is_vendor(config):
            yield kernel, Trial(problem, config, ms)
