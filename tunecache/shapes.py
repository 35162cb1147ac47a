"""A shape as a person types it (`-p M=4096,N=4096,K=4096,dtype=bfloat16`, a manifest entry, a
REST query) -> the op's canonical problem, exactly as a library call with such tensors computes
it (both go through `tunecache_kernels.geometry`; no torch here, so the service uses it too).
The one place this is done: the CLI, `tunecache compile`, manifests, self-checks and the service.

Strict on purpose: a missing dtype, an unknown key, a layout that is neither `row` nor `col` or
a size that is not a positive integer is an error that names it, never a silent default.
"""

from __future__ import annotations

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
        return geometry.matmul(M, N, K, dtype, *layouts)
    N, H, W, Ci, Co, R, S = ints("N", "H", "W", "Ci", "Co", "R", "S")
    (st,) = ints("stride", default=1)
    (pd,) = ints("padding", minimum=0, default=0)
    (sh, sw) = ints("stride_h", "stride_w", default=st)
    (ph, pw) = ints("pad_h", "pad_w", minimum=0, default=pd)
    p = geometry.conv(N, H, W, Ci, Co, R, S, (sh, sw), (ph, pw), dtype)
    return {"conv2d_fprop": p, "conv2d_wgrad": geometry.wgrad(p), "conv2d_dgrad": geometry.dgrad(p)}[op]
