"""How well the learned candidate ranking (tunecache.tuning.ranking) would have picked, offline.

For every tuned problem of a trials store (benchmarks/gather_trials.py's), the problem is left
out of the ranking's data; its own timed candidates (in their static order) are ranked from the
rest, and the best of the ranking's short list (and of the static order's first as many) is
compared with the best of all it timed. Times are the tune's own (quick round; settled for its leaders), so a
ratio below 1 by a percent or two is within their noise.

    python benchmarks/eval_ranking.py STORE_URL
    python benchmarks/eval_ranking.py shipped    # the trials the package ships (tunecache/tuning/trials)

The ranking's list is what a tune at default settings times (`ranking.shortlist`: 16, or 32
where no tuned problem is near; its run-time variants stood in for by the ranking's next
ones); the static order's is as long. Prints per kernel the share of problems whose pick is
within 2% of the best and the worst pick, for both; writes JSON with a `summary` to
benchmarks/results/ranking-offline.json.
"""

from __future__ import annotations

import argparse
import json
import math
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store", help="the store's URL (sqlite:///trials.sqlite), or 'shipped': the package's trials")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from tunecache.tuning.ranking import Ranking, Trial, shortlist

    per_kernel: dict[str, list[Trial]] = defaultdict(list)
    order: dict[tuple[str, str], list[dict]] = {}  # the tune's own candidates, static order
    for kernel, t in _trials(args.store, args.arch):
        per_kernel[kernel].append(t)
        seen = order.setdefault((kernel, json.dumps(t.problem, sort_keys=True)), [])
        if t.config not in seen:
            seen.append(t.config)
    summary: dict = {}
    rows = []
    for kernel, trials in sorted(per_kernel.items()):
        ranking = Ranking(trials)
        times: dict[str, dict[str, float]] = defaultdict(dict)
        for t in trials:
            times[json.dumps(t.problem, sort_keys=True)][json.dumps(t.config, sort_keys=True)] = t.median_ms
        picks: dict[str, list[float]] = {"learned": [], "static": []}
        lengths = []
        for pid, ms in times.items():
            problem = json.loads(pid)
            static = order[(kernel, pid)]
            short = shortlist(ranking.order(static, problem, exclude_self=True), static)
            n = len(short.candidates) + (short.siblings or 0)  # variants: the ranking's next ones stand in
            ranked = ranking.order(static, problem, exclude_self=True).candidates
            tried = short.candidates + [c for c in ranked if c not in short.candidates][: short.siblings or 0]
            best = min(ms.values())
            picks["learned"].append(best / min(ms[json.dumps(c, sort_keys=True)] for c in tried))
            picks["static"].append(best / min(ms[json.dumps(c, sort_keys=True)] for c in static[:n]))
            lengths.append(n)
            rows.append(
                {
                    "kernel": kernel,
                    "problem": problem,
                    "timed": n,
                    "why": short.why,
                    "learned": picks["learned"][-1],
                    "static": picks["static"][-1],
                }
            )
        lengths.sort()
        out = {
            name: {
                "within_2pct": sum(v >= 0.98 for v in vals) / len(vals),
                "worst": min(vals),
                "geomean": math.exp(sum(math.log(v) for v in vals) / len(vals)),
            }
            for name, vals in picks.items()
        }
        summary[kernel] = {
            "problems": len(times),
            "timed_median": lengths[len(lengths) // 2],
            "timed_mean": sum(lengths) / len(lengths),
            **out,
        }
        lr, st = out["learned"], out["static"]
        print(
            f"{kernel}: {len(times)} problems, {summary[kernel]['timed_median']} timed (median; mean "
            f"{summary[kernel]['timed_mean']:.1f}): learned {lr['within_2pct']:.0%} within 2% of the best, worst "
            f"{lr['worst']:.3f}, geomean {lr['geomean']:.4f} | static order, as many: {st['within_2pct']:.0%}, "
            f"worst {st['worst']:.3f}, geomean {st['geomean']:.4f}"
        )
    path = write_results(
        args.out.stem if args.out else "ranking-offline",
        {"summary": summary, "store": args.store, "rows": rows},
        args.out.parent if args.out else None,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
