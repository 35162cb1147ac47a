"""A shape as a person types it (`-p M=4096,N=4096,K=4096,dtype=bfloat16`, a manifest entry, a
REST query) -> the op's canonical problem, exactly as a library call with such tensors computes
it (both go through `tunecache_kernels.geometry`; no torch here, so the service uses it too).
The one place this is done: the CLI, `tunecache compile`, manifests, self-checks and the service.

Strict on purpose: a missing dtype, an unknown key, a layout that is neither `row` nor `col` or
a size that is not a positive integer is an error that names it, never a silent default.
"""

from __future__ import annotations

import math
from typing import Any

OPS = ("matmul", "conv2d_fprop", "conv2d_wgrad", "conv2d_dgrad")
KEYS = {
    "matmul": {
        "M": "rows of a and c",
        "N": "columns of b and c",
        "K": "the reduction",
        "dtype": "float16, bfloat16 or float32",
        "a_layout": "row (default) or col",
        "b_layout": "row (default) or col",
        "precision": "float32 only: ieee (default, as torch's matmuls) or tf32",
    },
    "conv2d_fprop": {
        "N": "batch",
        "H": "input height",
        "W": "input width",
        "Ci": "input channels",
        "Co": "output channels",
        "R": "filter height",
        "S": "filter width",
        "stride": "both strides (default 1)",
        "padding": "both paddings (default 0)",
        "stride_h": "",
        "stride_w": "",
        "pad_h": "",
        "pad_w": "",
        "dtype": "float16, bfloat16 or float32",
        "precision": "float32 only: tf32 (default, as torch's convolutions) or ieee",
    },
}
KEYS["conv2d_wgrad"] = KEYS["conv2d_dgrad"] = KEYS["conv2d_fprop"]
_LAYOUTS = ("row", "col")


def canonical_problem(op: str, given: dict[str, Any]) -> dict:
    """The canonical problem of `op` for the shape `given`; ValueError names what is wrong."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")
    given = dict(given)
    if op != "matmul" and "gemm_M" in given and "dtype" in given:
        return given  # canonical already (a conv's GEMM fields are computed, never typed)
    unknown = sorted(k for k in given if k not in KEYS[op])
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)} for {op}; it takes {', '.join(KEYS[op])}")
    from tunecache_kernels import geometry

    if "dtype" not in given:
        raise ValueError(f"the {op} shape needs a dtype: one of {', '.join(geometry.DTYPES)}")
    dtype = given["dtype"]
    if dtype not in geometry.DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(geometry.DTYPES)}, got {dtype!r}")

    def ints(*names: str, minimum: int = 1, default: int | None = None) -> list[int]:
        missing = [n for n in names if n not in given and default is None]
        if missing:
            raise ValueError(f"the {op} shape is missing {', '.join(missing)}")
        out = []
        for n in names:
            v = given.get(n, default)
            if isinstance(v, bool) or not isinstance(v, int) and not (isinstance(v, str) and v.strip().isdigit()):
                raise ValueError(f"{n} must be an integer >= {minimum}, got {v!r}")
            v = int(v)
            if v < minimum:
                raise ValueError(f"{n} must be an integer >= {minimum}, got {v}")
            out.append(v)
        return out

    if op == "matmul":
        M, N, K = ints("M", "N", "K")
        layouts = []
        for name in ("a_layout", "b_layout"):
            layout = given.get(name, "row")
            if layout not in _LAYOUTS:
                raise ValueError(f"{name} must be row or col, got {layout!r}")
            layouts.append(layout)
        return geometry.matmul(M, N, K, dtype, *layouts, _precision(given, dtype))
    N, H, W, Ci, Co, R, S = ints("N", "H", "W", "Ci", "Co", "R", "S")
    (st,) = ints("stride", default=1)
    (pd,) = ints("padding", minimum=0, default=0)
    (sh, sw) = ints("stride_h", "stride_w", default=st)
    (ph, pw) = ints("pad_h", "pad_w", minimum=0, default=pd)
    p = geometry.conv(N, H, W, Ci, Co, R, S, (sh, sw), (ph, pw), dtype, _precision(given, dtype))
    return {"conv2d_fprop": p, "conv2d_wgrad": geometry.wgrad(p), "conv2d_dgrad": geometry.dgrad(p)}[op]


def _precision(given: dict, dtype: str) -> str | None:
    if "precision" in given and dtype != "float32":
        raise ValueError(f"precision is a float32 shape's (ieee or tf32); this shape is {dtype}")
    return given.get("precision")


_DT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


def shape_text(p: dict) -> str:
    """A problem in a few characters, as `tunecache ls`, `jobs ls` and the dashboard print it:
    '4096x4096x4096 bf16', 'N32 56x56 256>256 3x3/s1p1 bf16'; a problem of another kind (a
    user's kernel) as k=v pairs, without the derived implicit-GEMM fields."""
    if not p:
        return "?"
    dt = _DT.get(str(p.get("dtype")), str(p.get("dtype", ""))) + (f"/{p['precision']}" if "precision" in p else "")
    if "M" in p and "R" not in p:
        lay = (
            ""
            if (p.get("a_layout"), p.get("b_layout")) == ("row", "row")
            else f" {str(p.get('a_layout', ''))[:1]}{str(p.get('b_layout', ''))[:1]}"
        )
        return f"{p.get('M')}x{p.get('N')}x{p.get('K')} {dt}{lay}"
    if "R" in p:
        st = p.get("stride_h", p.get("stride", 1))
        pd = p.get("pad_h", p.get("padding", 0))
        return (
            f"N{p.get('N')} {p.get('H')}x{p.get('W')} {p.get('Ci')}>{p.get('Co')} "
            f"{p.get('R')}x{p.get('S')}/s{st}p{pd} {dt}"
        )
    return shape_pairs(p)


def shape_pairs(p: dict) -> str:
    """A problem as the KEY=VALUE pairs `tunecache tune -p` and `GET /v1/best` take, without the
    fields derived from them (the implicit GEMM's sizes, a conv's output size)."""
    return ",".join(f"{k}={v}" for k, v in dict(p).items() if not str(k).startswith("gemm_") and k not in ("P", "Q"))


_SIZES = ("M", "N", "K", "gemm_M", "gemm_N", "gemm_K")
_MUST_MATCH = ("R", "S", "stride_h", "stride_w", "pad_h", "pad_w")  # sizes that change the kernel's walk


def problem_distance(a: dict, b: dict, unlike: float = math.inf) -> float:
    """How far problem `b` is from `a`: the log distance over the GEMM sizes, plus `unlike` for
    each categorical field (dtype, layouts), filter size, stride or padding that differs.
    Infinite there (the default) for borrowing a tuned neighbour's config (the miss policy
    `default`) and naming the nearest tuned shapes (`GET /v1/best`): a config of another walk
    may not run here; finite for ranking candidates by their neighbours' trials
    (tunecache.tuning.ranking), where an unlike neighbour still tells which tiles do well."""
    unlike_fields = sum(b.get(f) != v for f, v in a.items() if not isinstance(v, int) or f in _MUST_MATCH)
    sizes = sum(abs(math.log(max(1, a[f])) - math.log(max(1, b.get(f, 1)))) for f in _SIZES if f in a)
    return sizes + unlike * unlike_fields if unlike_fields else sizes
