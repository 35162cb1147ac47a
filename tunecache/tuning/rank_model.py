"""A learned model of which candidates run fastest: gradient-boosted trees over a problem's and a
config's features, trained on the trials gathered on a GPU and shipped beside them.

Ranking by the nearest tuned problems (tunecache.tuning.ranking) needs a tuned problem near; the
convolutions' shapes lie far apart (the nearest 3-7 log units away), and there a tune timed 40
candidates to find the best. Trees over features that say how a tile fits a problem (tiles per
wave, the padding a tile wastes, iterations along K) carry what was learnt across shapes: held
out of training (benchmarks/eval_ranking.py), a tune's 16 candidates in their order (24 at most)
held one within 2 % of the best for 94-100 % of problems per backend, where the neighbours'
order needed 40 for 83-96 %.

The trees are trained by LightGBM (a LambdaRank objective: the order of a problem's candidates,
not their times) where the trials are gathered (`benchmarks/gather_trials.py --build`, with the
`learn` extra installed), and again on a host on what it and the fleet measured since
(`tunecache learn`: tunecache.tuning.learn), and kept as plain JSON: scoring a tune's candidates is a few thousand
comparisons in Python, so the library a training job imports loads no learning library.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import os
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Sequence

log = logging.getLogger("tunecache")

# the device class's SMs, where a problem's tiles fill waves; the shipped trials' (an H200's)
# unless the caller knows its own
SM_COUNT = 132
# a config's fields the trees see (absent: 0); the kernels' run-time and compile-time choices
CONFIG_FIELDS = (
    "BLOCK_M",
    "BLOCK_N",
    "BLOCK_K",
    "GROUP_M",
    "SPLIT_K",
    "SWAP_AB",
    "num_stages",
    "num_warps",
    "CTAS_PER_SM",
)
DTYPES = {"float16": 0, "bfloat16": 1, "float32": 2}
# relevance of a candidate in training: RELEVANCE for the problem's best, one less per STEP of
# log slowdown (2 %), 0 past it
RELEVANCE, STEP = 30, 0.02
TRAINING = {
    "objective": "lambdarank",
    "num_iterations": 150,
    "learning_rate": 0.05,
    "num_leaves": 15,
    "min_data_in_leaf": 20,
    "deterministic": True,  # the same trials make the same file
    "force_row_wise": True,
    "seed": 0,
    "verbose": -1,
}


def _number(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) else 0.0


def features(problem: dict, config: dict, sm_count: int = SM_COUNT) -> list[float]:
    """What the trees see of `config` on `problem`: the GEMM's sizes (a convolution's implicit
    GEMM), its kind, the config's fields, and how the config's tiles fit the problem."""
    sm_count = sm_count or SM_COUNT
    conv = "gemm_M" in problem
    m, n, k = (max(1, int(problem[f])) for f in (("gemm_M", "gemm_N", "gemm_K") if conv else ("M", "N", "K")))
    if config.get("SWAP_AB"):
        m, n = n, m
    if conv:
        shape = [
            _number(problem.get("R")),
            _number(problem.get("stride_h")),
            _number(problem.get("pad_h")),
            math.log(max(1, problem.get("N", 1))),
            math.log(max(1, problem.get("P", 1) * problem.get("Q", 1))),
            math.log(max(1, problem.get("Ci", 1))),
            math.log(max(1, problem.get("Co", 1))),
        ]
    else:
        shape = [float(problem.get("a_layout") == "row"), float(problem.get("b_layout") == "row"), 0, 0, 0, 0, 0]
    bm, bn, bk = (max(1, int(_number(config.get(f)) or 1)) for f in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    split = int(_number(config.get("SPLIT_K")))
    split = split if split > 0 else 1
    tiles_m, tiles_n = -(-m // bm), -(-n // bn)
    tiles = tiles_m * tiles_n * split
    waves = tiles / sm_count
    return [
        math.log(m),
        math.log(n),
        math.log(k),
        float(DTYPES.get(problem.get("dtype"), 3)),
        float(conv),
        *shape,
        *(_number(config.get(f)) for f in CONFIG_FIELDS),
        math.log(tiles),
        math.log(waves),
        tiles / (math.ceil(waves) * sm_count),  # how full the last wave is
        tiles_m * bm / m,  # the rows a tile computes for nothing
        tiles_n * bn / n,
        math.log(max(k / split / bk, 1e-3)),  # iterations along K
        math.log(bm * bn),
        bm * bn / (bm + bn),  # a tile's reuse
    ]


class TreeModel:
    """Trees as LightGBM dumps them, in a compact form: a node is [feature, threshold, left,
    right] (left where the feature <= threshold), a leaf its value. A higher score ranks first."""

    def __init__(self, trees: list) -> None:
        self.trees = trees

    def score(self, rows: Iterable[Sequence[float]]) -> list[float]:
        out = []
        for x in rows:
            total = 0.0
            for node in self.trees:
                while isinstance(node, list):
                    node = node[2] if x[node[0]] <= node[1] else node[3]
                total += node
            out.append(total)
        return out

    def order(self, candidates: Sequence[dict], problem: dict, sm_count: int = SM_COUNT) -> list[dict]:
        """`candidates`, the highest scored first (ties in their given order)."""
        scores = self.score(features(problem, c, sm_count) for c in candidates)
        return [candidates[i] for i in sorted(range(len(candidates)), key=lambda i: (-scores[i], i))]


def _compact(node: dict) -> Any:
    if "leaf_value" in node:
        return node["leaf_value"]
    if node.get("decision_type") != "<=" or node.get("missing_type") not in ("None", "NaN"):
        split = f"{node.get('decision_type')} {node.get('missing_type')}"
        raise ValueError(f"a split the compact trees do not hold: {split}")
    return [node["split_feature"], node["threshold"], _compact(node["left_child"]), _compact(node["right_child"])]


def train(trials: Iterable[Any]) -> list:
    """Trees trained on `trials` (tunecache.tuning.ranking.Trial: problem, config, median_ms), in
    the compact form `TreeModel` takes. Needs LightGBM (`pip install tunecache[learn]`)."""
    return compact(fit(trials))


def compact(booster: Any) -> list:
    """A LightGBM booster's trees in the form `TreeModel` takes."""
    return [_compact(t["tree_structure"]) for t in booster.dump_model()["tree_info"]]


def fit(trials: Iterable[Any]) -> Any:
    """A LightGBM booster ranking the candidates of each problem of `trials`."""
    import lightgbm
    import numpy

    timed: dict[str, tuple[dict, dict[str, tuple[dict, float]]]] = {}
    for t in trials:
        problem, times = timed.setdefault(json.dumps(t.problem, sort_keys=True), (t.problem, {}))
        c = json.dumps(t.config, sort_keys=True)
        if c not in times or t.median_ms < times[c][1]:
            times[c] = (t.config, t.median_ms)
    x, y, groups = [], [], []
    for problem, times in timed.values():
        if len(times) < 2:  # one candidate says nothing about an order
            continue
        best = min(ms for _, ms in times.values())
        for config, ms in times.values():
            x.append(features(problem, config))
            y.append(max(0, RELEVANCE - int(math.log(ms / best) / STEP)))
        groups.append(len(times))
    return lightgbm.train(TRAINING, lightgbm.Dataset(numpy.array(x, dtype=float), numpy.array(y), group=groups))


# ---- the shipped models ---------------------------------------------------------------------

_SHIPPED: dict[str, dict[str, TreeModel]] = {}


def _shipped_file(name: str) -> Any:
    """The file `name` of tunecache/tuning/trials/ (the trials, the trees), as the package holds it."""
    return resources.files("tunecache.tuning").joinpath("trials", name)


def read_shipped(name: str) -> Any:
    """The gzipped JSON file `name` of tunecache/tuning/trials/ (the trials, the trees), or None."""
    path = _shipped_file(name)
    if not path.is_file():
        return None
    with path.open("rb") as f:
        return json.loads(gzip.decompress(f.read()))


def shipped_model(kernel: str, arch: str) -> TreeModel | None:
    """The trees this package ships for `kernel` on `arch`, or None."""
    if arch not in _SHIPPED:
        _SHIPPED[arch] = {k: TreeModel(t) for k, t in (read_shipped(f"{arch}.trees.json.gz") or {}).items()}
    return _SHIPPED[arch].get(kernel)


# ---- what a tune ranks by: this host's trees (`tunecache learn`), else the package's ---------

_LEARNED: dict[str, dict[str, TreeModel]] = {}


def model(kernel: str, arch: str) -> TreeModel | None:
    """The trees a tune ranks `kernel`'s candidates on `arch` by: those `tunecache learn` trained
    on this host (read once per process), else the package's, else None."""
    if arch not in _LEARNED:
        _LEARNED[arch] = {k: TreeModel(t) for k, t in (_read_learned(arch) or {}).items()}
    return _LEARNED[arch].get(kernel) or shipped_model(kernel, arch)


def learned_path(arch: str) -> Path:
    """Where `tunecache learn` writes the trees of `arch` (settings.trees_dir)."""
    from tunecache import settings

    return settings.trees_dir() / f"{arch}.trees.json.gz"


def _read_learned(arch: str) -> Any:
    """This host's trees of `arch`, unless they were trained beside other trees than the
    package's now (an upgrade ships trees trained on more: those rank until `tunecache learn`
    runs again)."""
    path = learned_path(arch)
    try:
        data = json.loads(gzip.decompress(path.read_bytes()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, EOFError) as e:  # a tune never fails on them: the package's rank
        log.warning("tunecache: the learned trees in %s cannot be read (%s); the package's rank candidates", path, e)
        return None
    if not isinstance(data, dict) or data.get("package") != _package_trees(arch):
        log.warning(
            "tunecache: the learned trees in %s were trained with another version of tunecache's own; its trees "
            "rank candidates until `tunecache learn` runs again",
            path,
        )
        return None
    return data.get("trees")


def _package_trees(arch: str) -> str:
    """A digest of the trees the package ships for `arch` ('' for none)."""
    import hashlib

    path = _shipped_file(f"{arch}.trees.json.gz")
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else ""


def write_learned(arch: str, trees: dict[str, list]) -> Path:
    """`trees` (kernel -> compact trees) as this host's for `arch`, replacing the file whole (a
    tune that reads it meanwhile reads the old one or the new one)."""
    path = learned_path(arch)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = {"package": _package_trees(arch), "trees": trees}
    tmp.write_bytes(gzip.compress(json.dumps(data, separators=(",", ":")).encode(), 9, mtime=0))
    os.replace(tmp, path)
    _LEARNED.pop(arch, None)
    return path
