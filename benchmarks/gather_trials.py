"""Gather the trials that the shipped candidate ranking is trained on (issue 40).

Calls `tunecache.ops` on a list of training shapes, one op after another, with a wider
candidate cap than a user's tune (TUNECACHE_MAX_CANDIDATES, 64 here), into the store named by
TUNECACHE_DB_URL; the store's trials are what `tunecache.tuning.ranking` learns from
(`gather_trials.py --build STORE_URL` writes them to the file the package ships,
tunecache/tuning/trials/<arch>.json.gz, and the trees trained on them beside it,
<arch>.trees.json.gz: tunecache.tuning.rank_model; `--trees` trains those alone).

The training shapes are drawn at random (seeded) from ranges a model's layers fall in, plus
the layers of two models of bench_models' suite (resnet50 at batch 32, llama3-8b). Held out,
never gathered here: bench_kernels' set (bench_tuning --kernel-set) and bench_models' other
models (resnet50 at batch 1 and 128, sd-vae, inception-v3, llama3-70b, moe-expert), on which
bench_tuning measures the ranked tune against the whole space. Those whole-space runs are
training data afterwards (`--add-results`): the shipped file holds 9 such layers of sd-vae,
inception-v3 and llama3-70b (benchmarks/results/tuning-trees-h200-20261128-s49*.json), so a
held-out measurement since then names shapes of none of bench_models' layers.

    TUNECACHE_DB_URL=sqlite:///trials.sqlite python benchmarks/gather_trials.py --seconds 500

Prints a line per tune; stops after --seconds (the shapes alternate between ops, so a cut run
still covers each op).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRIALS = HERE.parent / "tunecache" / "tuning" / "trials"  # the source tree's shipped trials and trees, written here
sys.path.insert(0, str(HERE))

OPS = ("matmul", "conv2d_fprop", "conv2d_wgrad", "conv2d_dgrad")
TRAINING_MODELS = ("resnet50-b32", "llama3-8b")
_SIZES = (512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192, 11008, 14336)
_ROWS = (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_CHANNELS = (3, 16, 32, 64, 96, 128, 160, 192, 256, 320, 384, 512, 768, 1024, 2048)


def synthetic(op: str, rng: random.Random) -> dict:
    """A random shape of `op` (as bench_models writes them), at most ~2^37 multiply-adds."""
    dtype = rng.choice(("bfloat16", "float16"))
    while True:
        if op == "matmul":
            s = {"M": rng.choice(_ROWS), "N": rng.choice(_SIZES), "K": rng.choice(_SIZES), "dtype": dtype}
            work = s["M"] * s["N"] * s["K"]
        else:
            r = rng.choice((1, 1, 3, 3, 3, 5, 7))
            hw = rng.choice((7, 14, 17, 28, 32, 56, 64, 112))
            s = {
                "N": rng.choice((1, 2, 8, 16, 32, 64, 128)),
                "H": hw,
                "W": hw,
                "Ci": rng.choice(_CHANNELS),
                "Co": rng.choice(_CHANNELS[1:]),
                "R": r,
                "S": r,
                "stride": rng.choice((1, 1, 1, 2)),
                "padding": r // 2,
                "dtype": dtype,
            }
            work = s["N"] * hw * hw * s["Ci"] * s["Co"] * r * r // s["stride"] ** 2
        if 2**22 <= work <= 2**37:
            return s


def named(op: str) -> list[dict]:
    """The training models' shapes of `op` from bench_models' suite."""
    from bench_models import suite

    out = []
    for lay in suite():
        if lay.model in TRAINING_MODELS and (op in lay.ops or lay.op == op):
            out.append({**lay.shape, "dtype": lay.dtype})
    return out


def shapes(seed: int, with_named: bool = True) -> list[tuple[str, dict]]:
    """(op, shape) pairs, ops taking turns, named and random shapes taking turns within an op."""
    rng = random.Random(seed)
    per_op = []
    for op in OPS:
        mine = named(op) if with_named else []
        rng.shuffle(mine)
        drawn = [synthetic(op, rng) for _ in range(60)]
        mixed = [s for pair in itertools.zip_longest(mine, drawn) for s in pair if s is not None]
        per_op.append([(op, s) for s in mixed])
    return [x for turn in itertools.zip_longest(*per_op) for x in turn if x is not None]


def build(url: str, arch: str) -> int:
    """The store's measured trials on `arch` added to tunecache/tuning/trials/<arch>.json.gz (a
    later gathering adds to an earlier one's; a trial of the same problem and config the store
    holds anew replaces the file's)."""
    from tunecache.store.store import Store
    from tunecache.tuning import ranking

    fresh = list(ranking.trial_rows(reversed(Store(url).ranking_trials(arch, limit=1_000_000))))
    return _add_to_shipped(arch, fresh, "from the store")


def add_results(paths: list[str], arch: str) -> int:
    """The whole-space trials of bench_tuning runs (results JSON: each shape's `exhaustive` tune,
    every candidate of its pruned space timed) added to the shipped file of `arch`, then the
    trees trained again: what a whole-space tune measured on a shape the trees ranked badly is
    what they learn from next."""
    from tunecache.tuning import ranking

    fresh = []
    for name in paths:
        for row in json.loads(Path(name).read_text())["ops"]:
            whole = row["exhaustive"]
            for config, status, ms in whole["trials"]:
                if status == "ok" and ms and not config.get("vendor"):
                    fresh.append((whole["kernel"], ranking.Trial(whole["problem"], config, ms)))
    return _add_to_shipped(arch, fresh, f"from {len(paths)} result file(s)")


def _add_to_shipped(arch: str, fresh: list, source: str) -> int:
    """(kernel, trial) pairs merged into the shipped trials of `arch` (a trial of the same
    problem and config replaces the file's), the file written, then the trees trained on it."""
    import gzip

    from tunecache.tuning import ranking

    path = TRIALS / f"{arch}.json.gz"
    kept = {}
    for kernel, trials in ranking.shipped_by_kernel(arch).items():  # this file, as the package reads it
        for t in trials:
            kept[_trial_id(kernel, t.problem, t.config)] = (kernel, t)
    for kernel, t in fresh:
        kept[_trial_id(kernel, t.problem, t.config)] = (kernel, t)
    rows = list(kept.values())
    packed = ranking.pack(rows)
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(gzip.compress(json.dumps(packed, separators=(",", ":")).encode(), 9, mtime=0))
    problems = {k: len(v["problems"]) for k, v in packed.items()}
    print(f"wrote {path}: {len(fresh)} trials {source}, {len(rows)} in all, problems per kernel {problems}")
    ranking.forget_shipped()  # the trees are trained on the file as now written
    return build_trees(arch)


def build_trees(arch: str) -> int:
    """The trees (tunecache.tuning.rank_model) trained on the shipped trials of `arch`, written
    beside them (needs LightGBM: pip install -e ".[learn]")."""
    import gzip

    from tunecache.tuning import rank_model, ranking

    path = TRIALS / f"{arch}.trees.json.gz"
    trees = {kernel: rank_model.train(trials) for kernel, trials in sorted(ranking.shipped_by_kernel(arch).items())}
    path.write_bytes(gzip.compress(json.dumps(trees, separators=(",", ":")).encode(), 9, mtime=0))
    print(f"wrote {path}: trees of {', '.join(trees)}, {path.stat().st_size // 1024} KiB")
    return 0


def _trial_id(kernel: str, problem: dict, config: dict) -> str:
    return json.dumps([kernel, problem, config], sort_keys=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=500, help="stop starting tunes after this long")
    ap.add_argument("--cap", type=int, default=64, help="candidates per tune (TUNECACHE_MAX_CANDIDATES)")
    ap.add_argument("--seed", type=int, default=40, help="the random shapes' seed")
    ap.add_argument("--ops", default=",".join(OPS), help="comma-separated ops to gather")
    ap.add_argument("--no-named", action="store_true", help="random shapes only (the models' were gathered)")
    ap.add_argument("--list", action="store_true", help="print the shapes and exit")
    ap.add_argument("--build", metavar="STORE_URL", help="write STORE_URL's trials to the shipped file and exit")
    ap.add_argument("--arch", default="sm_90", help="with --build or --trees: the architecture's trials")
    ap.add_argument("--trees", action="store_true", help="train the trees on the shipped trials only, and exit")
    ap.add_argument(
        "--add-results",
        nargs="+",
        metavar="JSON",
        help="add bench_tuning results' whole-space trials to the shipped file, train the trees, and exit",
    )
    args = ap.parse_args(argv)
    if args.add_results:
        return add_results(args.add_results, args.arch)
    if args.build:
        return build(args.build, args.arch)
    if args.trees:
        return build_trees(args.arch)
    wanted = set(args.ops.split(","))
    todo = [(op, s) for op, s in shapes(args.seed, not args.no_named) if op in wanted]
    if args.list:
        for op, s in todo:
            print(op, json.dumps(s))
        return 0
    if not os.environ.get("TUNECACHE_DB_URL"):
        ap.error("set TUNECACHE_DB_URL to the store the trials go to")
    os.environ["TUNECACHE_MAX_CANDIDATES"] = str(args.cap)
    os.environ["TUNECACHE_RANKING"] = "static"  # gather what the static order finds, not the model's own picks
    import torch

    import tunecache.ops as ops
    from tunecache import backends
    from tunecache.key import device_of
    from tunecache.shapes import canonical_problem

    where = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a smoke test of this script
    device = device_of(torch.empty(1, device=where))
    t0 = time.perf_counter()
    done = 0
    for op, shape in todo:
        if time.perf_counter() - t0 > args.seconds:
            break
        p = canonical_problem(op, shape)
        mod = backends.backends_for(op, device, p)[0]
        inputs = mod.inputs(p, where)
        start = time.perf_counter()
        try:
            getattr(ops, op)(*inputs)
            if where == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - one shape's failure is reported, the rest go on
            print(f"{op} {shape}: failed: {e}", flush=True)
            continue
        done += 1
        print(f"{op} {json.dumps(shape)}: {time.perf_counter() - start:.1f} s", flush=True)
        del inputs
    print(f"gathered {done} tunes in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
