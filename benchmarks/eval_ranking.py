"""How well the learned candidate ranking (tunecache.tuning.ranking) would have picked, held out.

The tuned problems of a trials store (benchmarks/gather_trials.py's) are dealt into 10 folds
(seeded); each fold is ranked by what the other nine teach: their trials (the neighbours'
order) and trees trained on them alone (tunecache.tuning.rank_model, as gather_trials --build
trains the shipped ones). Each held-out problem's own timed candidates (in their static order)
are ranked, and the best of the short list a tune at default settings times
(`ranking.shortlist`: 12 and 4 run-time variants of the leaders, stood in for by the ranking's
next ones, and 8 more where the 12's fastest stood 7th or later; 36 and 4 where neither trees
nor a near problem order it) is compared with the best of all it timed. Times are the tune's
own (quick round; settled for its leaders), so a ratio below 1 by a percent or two is within
their noise.

    python benchmarks/eval_ranking.py shipped    # the trials the package ships (tunecache/tuning/trials)
    python benchmarks/eval_ranking.py STORE_URL [--no-trees]

Prints per kernel the share of problems whose pick is within 2% of the best and the worst pick:
learned (trees, with the nearest problem's best first, as a tune ranks), the neighbours' order
alone, and the static order's first as many; writes JSON with a `summary` to
benchmarks/results/ranking-offline.json. Training the trees needs LightGBM (the `learn` extra).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import write_results  # noqa: E402


def _trials(store: str, arch: str):
    """(kernel, Trial) of the store's trials on `arch`, oldest first (a tune's in the order it
    timed them), or of the shipped file's (kept in that order)."""
    from tunecache.tuning import ranking

    if store == "shipped":
        for kernel, trials in ranking.shipped_by_kernel(arch).items():
            yield from ((kernel, t) for t in trials)
        return
    from tunecache.store.store import Store

    yield from ranking.trial_rows(reversed(Store(store).ranking_trials(arch)))


FOLDS = 10


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store", help="the store's URL (sqlite:///trials.sqlite), or 'shipped': the package's trials")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--no-trees", action="store_true", help="the neighbours' order alone (no LightGBM needed)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from tunecache.tuning.ranking import Ranking, Trial, shortlist

    per_kernel: dict[str, list[Trial]] = defaultdict(list)
    order: dict[tuple[str, str], list[dict]] = {}  # the tune's own candidates, static order
    for kernel, t in _trials(args.store, args.arch):
        per_kernel[kernel].append(t)
        seen = order.setdefault((kernel, _id(t.problem)), [])
        if t.config not in seen:
            seen.append(t.config)
    summary: dict = {}
    rows = []
    for kernel, trials in sorted(per_kernel.items()):
        times: dict[str, dict[str, float]] = defaultdict(dict)
        for t in trials:
            times[_id(t.problem)][_id(t.config)] = t.median_ms
        folds = sorted(times)
        random.Random(0).shuffle(folds)
        picks: dict[str, list[float]] = {"learned": [], "neighbours": [], "static": []}
        lengths = []
        for f in range(FOLDS):
            held = set(folds[f::FOLDS])  # out of the trials and the trees that rank them
            rest = [t for t in trials if _id(t.problem) not in held]
            rankings = {"neighbours": Ranking(rest)}
            rankings["learned"] = rankings["neighbours"] if args.no_trees else Ranking(rest, _trees(rest))
            for pid in sorted(held):
                ms, static = times[pid], order[(kernel, pid)]
                problem, best = json.loads(pid), min(times[pid].values())
                row = {"kernel": kernel, "problem": problem}
                for name, ranking in rankings.items():
                    ranked = ranking.order(static, problem)
                    short = shortlist(ranked, static)
                    tried = list(short.candidates)
                    tried += short.widen(min(range(len(tried)), key=lambda i: ms[_id(tried[i])]))
                    # the run-time variants of the leaders: the ranking's next ones stand in
                    tried += [c for c in ranked.candidates if c not in tried][: short.siblings or 0]
                    picks[name].append(best / min(ms[_id(c)] for c in tried))
                    row[name], row[f"{name}_timed"] = picks[name][-1], len(tried)
                    if name == "learned":
                        lengths.append(len(tried))
                        row["why"] = short.why
                picks["static"].append(best / min(ms[_id(c)] for c in static[: lengths[-1]]))
                row["static"] = picks["static"][-1]
                rows.append(row)
        lengths.sort()
        out = {
            name: {
                "within_2pct": sum(v >= 0.98 for v in vals) / len(vals),
                "worst": min(vals),
                "geomean": math.exp(sum(math.log(v) for v in vals) / len(vals)),
            }
            for name, vals in picks.items()
        }
        neighbours = sorted(r["neighbours_timed"] for r in rows if r["kernel"] == kernel)
        summary[kernel] = {
            "problems": len(times),
            "timed_median": lengths[len(lengths) // 2],
            "timed_max": lengths[-1],
            "timed_mean": sum(lengths) / len(lengths),
            "neighbours_timed_median": neighbours[len(neighbours) // 2],
            **out,
        }
        lr, nb, st = out["learned"], out["neighbours"], out["static"]
        print(
            f"{kernel}: {len(times)} problems, {summary[kernel]['timed_median']} timed (median; max "
            f"{lengths[-1]}): learned {lr['within_2pct']:.0%} within 2% of the best, worst {lr['worst']:.3f}, "
            f"geomean {lr['geomean']:.4f} | neighbours alone ({summary[kernel]['neighbours_timed_median']} timed) "
            f"{nb['within_2pct']:.0%}, worst {nb['worst']:.3f} | "
            f"static order, as many: {st['within_2pct']:.0%}, worst {st['worst']:.3f}"
        )
    path = write_results(
        args.out.stem if args.out else "ranking-offline",
        {"summary": summary, "store": args.store, "folds": FOLDS, "trees": not args.no_trees, "rows": rows},
        args.out.parent if args.out else None,
    )
    print(f"wrote {path}")
    return 0


def _id(x: dict) -> str:
    return json.dumps(x, sort_keys=True)


def _trees(trials: list) -> object:
    """The trees trained on `trials` alone, as gather_trials --build trains the shipped ones."""
    from tunecache.tuning.rank_model import TreeModel, train

    return TreeModel(train(trials))


if __name__ == "__main__":
    sys.exit(main())
