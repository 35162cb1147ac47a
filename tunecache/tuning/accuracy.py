"""How close a candidate's output must be to the reference (PyTorch) for its time to count.

A module of its own so the trial runner's child process checks outputs by the same rule as
the tuner without importing the tuner."""

from __future__ import annotations

from typing import Any

# relative error (Frobenius norm) a candidate may have against the reference, per dtype (a
# float32 problem's, per precision: TensorFloat-32 keeps 10 bits of mantissa, IEEE fp32 23)
TOLERANCE = {"float32": 5e-3, "float16": 1e-2, "bfloat16": 2e-2}
IEEE_FP32_TOLERANCE = 1e-5


def tolerance(problem: dict) -> float:
    if problem.get("precision") == "ieee":
        return IEEE_FP32_TOLERANCE
    return TOLERANCE[problem.get("dtype", "float32")]


def relative_error(out: Any, ref: Any) -> float:
    o, r = out.double(), ref.double()
    denom = r.norm().item()
    err = (o - r).norm().item()
    return err / denom if denom > 0 else err
