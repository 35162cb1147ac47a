"""The canonical problem of each op from plain integers: no torch, no Triton.

`problems.py` builds problems from the user's tensors (after checking them) through these, and
`tunecache.shapes` builds them from a shape typed by hand, on hosts and in the service alike,
so the same shape always gives the same key. Also the integer rounding every backend's static
rules share (pow2_at_least): here, where the portable backends reach it without Triton.
"""

from __future__ import annotations

DTYPES = ("float16", "bfloat16", "float32")


def pow2_at_least(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def out_size(size: int, k: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - k) // stride + 1


# How a float32 problem's products are computed: "ieee" (fp32 as IEEE defines it) or "tf32"
# (TensorFloat-32 inputs, fp32 accumulation), as torch's settings say for its own ops
# (`tunecache_kernels.problems.fp32_precision`); part of a float32 problem's key, so that a
# winner tuned at one precision never runs a call made at the other. torch's defaults: matmuls
# "ieee" (get_float32_matmul_precision() "highest"), convolutions "tf32" (cudnn.allow_tf32).
FP32_PRECISIONS = ("ieee", "tf32")
DEFAULT_FP32_PRECISION = {"matmul": "ieee", "conv": "tf32"}


def with_precision(p: dict, precision: str | None, kind: str) -> dict:
    """p with its float32 precision (torch's default for `kind` where None); other dtypes have none."""
    if p["dtype"] != "float32":
        return p
    precision = precision or DEFAULT_FP32_PRECISION[kind]
    if precision not in FP32_PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(FP32_PRECISIONS)}, got {precision!r}")
    p["precision"] = precision
    return p


def matmul(M: int, N: int, K: int, dtype: str, a_layout: str, b_layout: str, precision: str | None = None) -> dict:
    p = {"M": M, "N": N, "K": K, "dtype": dtype, "a_layout": a_layout, "b_layout": b_layout}
    return with_precision(p, precision, "matmul")


def conv(
    N: int,
    H: int,
    W: int,
    Ci: int,
    Co: int,
    R: int,
    S: int,
    stride: tuple[int, int],
    padding: tuple[int, int],
    dtype: str,
    precision: str | None = None,
) -> dict:
    """conv2d fprop's problem: the geometry and the implicit GEMM the kernels tile."""
    (sh, sw), (ph, pw) = stride, padding
    P, Q = out_size(H, R, sh, ph), out_size(W, S, sw, pw)
    if P <= 0 or Q <= 0:
        raise ValueError(
            f"empty output: a {R}x{S} filter with stride {stride} and padding {padding} over a "
            f"{H}x{W} input gives {P}x{Q}"
        )
    p = {
        "N": N,
        "H": H,
        "W": W,
        "Ci": Ci,
        "Co": Co,
        "R": R,
        "S": S,
        "stride_h": sh,
        "stride_w": sw,
        "pad_h": ph,
        "pad_w": pw,
        "P": P,
        "Q": Q,
        "dtype": dtype,
        "gemm_M": N * P * Q,
        "gemm_N": Co,
        "gemm_K": R * S * Ci,
    }
    return with_precision(p, precision, "conv")


def is_pointwise(p: dict) -> bool:
    """A conv problem with a 1x1 filter, stride 1 and no padding: im2col(x) is x itself."""
    return pointwise(p["R"], p["S"], (p["stride_h"], p["stride_w"]), (p["pad_h"], p["pad_w"]))


def patches(R: int, S: int, stride, padding) -> bool:
    """A conv whose filter steps by its own size with no padding, larger than 1x1 (a vision
    transformer's patch embedding): each output pixel reads a patch of its own, so the conv is
    the matmul of the patches (as rows) and the filter, and runs as that matmul."""
    st = (stride, stride) if type(stride) is int else stride
    return st == (R, S) != (1, 1) and padding in (0, (0, 0))


def pointwise(R: int, S: int, stride, padding) -> bool:
    """is_pointwise from the filter's size and the stride and padding (ints or pairs)."""
    return R == S == 1 and stride in (1, (1, 1)) and padding in (0, (0, 0))


def runs_as_matmul(R: int, S: int, stride, padding) -> bool:
    """A pointwise conv's fprop and dgrad are plain GEMMs, y [N*H*W, Co] = x [N*H*W, Ci] @ w^T
    and grad_x [N*H*W, Ci] = grad_out [N*H*W, Co] @ w [Co, Ci]: `tunecache.ops` runs them as
    matmuls (their own tuned kernels, split-K for few pixels, the TMA-store epilogue). H200,
    ResNet-50's 1x1s at batch 1, 32 and 128: fprop 0.74-1.02x cuDNN as convs, 0.87-1.04x as
    matmuls; dgrad 1.1x faster as matmuls. Its wgrad: wgrad_runs_as_matmul."""
    return pointwise(R, S, stride, padding)


WGRAD_MATMUL_PIXELS = 16384  # see wgrad_runs_as_matmul


def wgrad_runs_as_matmul(R: int, S: int, stride, padding, pixels: int) -> bool:
    """A pointwise conv's wgrad, grad_w [Co, Ci] = grad_out^T [Co, N*H*W] @ x [N*H*W, Ci], runs
    as a matmul where its reduction is short. H100, ResNet-50's 1x1s at batch 128: over 7x7
    images (6272 pixels) 0.91-0.92x cuDNN as a matmul, 0.77-0.82x as a conv; at 25088 pixels
    the conv ahead or even (0.83-0.97x against 0.84-0.90x); from 100352 on the conv 5-15% faster."""
    return pointwise(R, S, stride, padding) and pixels <= WGRAD_MATMUL_PIXELS


def wgrad(p: dict) -> dict:
    """conv2d wgrad's problem from fprop's: [Co, R*S*Ci] = grad_out^T [Co, NPQ] @ im2col(x) [NPQ, R*S*Ci]."""
    return {**p, "gemm_M": p["Co"], "gemm_N": p["R"] * p["S"] * p["Ci"], "gemm_K": p["N"] * p["P"] * p["Q"]}


def dgrad(p: dict) -> dict:
    """conv2d dgrad's problem from fprop's: grad_x [N*H*W, Ci] from grad_out [N*P*Q, Co] and w, one
    phase of stride-1 taps per (row, column) residue of the stride: K is a phase's share of R*S*Co."""
    k = -(-p["R"] // p["stride_h"]) * -(-p["S"] // p["stride_w"]) * p["Co"]
    return {**p, "gemm_M": p["N"] * p["H"] * p["W"], "gemm_N": p["Ci"], "gemm_K": k}
