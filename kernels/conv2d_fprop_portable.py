"""Portable implicit-GEMM conv2d fprop in `triton.language` (NHWC; any stride, padding and
channel count). M = N*P*Q output pixels, N = Co, K = R*S*Ci walked as (r, s, channel block)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import portable_rules as rules
from . import portable_tiles as tiles
from . import problems

OP, BACKEND, KERNEL, problem, inputs, reference, flops = problems.backend_names("conv2d_fprop", "portable")


@triton.jit
def conv2d_fprop_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    N,
    H,
    W,
    Ci,
    Co,
    P,
    Q,
    R,
    S,
    stride_h,
    stride_w,
    pad_h,
    pad_w,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    M = N * P * Q
    pid_m, pid_n = tiles.grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(Co, BLOCK_N), GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_co = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_K)
    n = offs_m // (P * Q)
    pq = offs_m % (P * Q)
    oh = (pq // Q) * stride_h - pad_h
    ow = (pq % Q) * stride_w - pad_w
    m_ok = offs_m < M
    co_ok = offs_co < Co
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(R):
        ih = oh + r
        for s in range(S):
            iw = ow + s
            pix_ok = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            x_row = ((n.to(tl.int64) * H + ih) * W + iw) * Ci
            w_col = ((offs_co.to(tl.int64) * R + r) * S + s) * Ci
            for c0 in range(0, Ci, BLOCK_K):
                c = c0 + offs_c
                c_ok = c < Ci
                a = tl.load(x_ptr + x_row[:, None] + c[None, :], mask=pix_ok[:, None] & c_ok[None, :], other=0.0)
                b = tl.load(w_ptr + w_col[None, :] + c[:, None], mask=c_ok[:, None] & co_ok[None, :], other=0.0)
                if UPCAST:
                    a, b = a.to(tl.float32), b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    y = y_ptr + offs_m[:, None].to(tl.int64) * Co + offs_co[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & co_ok[None, :])


def _extents(p: dict) -> tuple:
    """The problem's extent along (BLOCK_M, BLOCK_N, BLOCK_K), and its GEMM's (M, N, K)."""
    return (p["gemm_M"], p["Co"], p["Ci"]), (p["gemm_M"], p["gemm_N"], p["gemm_K"])


JIT_FUNCTIONS = (conv2d_fprop_kernel,)
supports, config_space, prune, default_config = rules.host_rules(
    OP, _extents, cpu=(32, 32, 16, 4), gpu=(128, 64, 32, 4)
)


def launch(config: dict, x: torch.Tensor, w: torch.Tensor, stride=1, padding=0) -> torch.Tensor:
    N, H, W, Ci = x.shape
    Co, R, S, _ = w.shape
    (sh, sw), (ph, pw) = problems.stride_padding(stride, padding)
    P, Q = problems.out_size(H, R, sh, ph), problems.out_size(W, S, sw, pw)
    y = torch.empty((N, P, Q, Co), device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(N * P * Q, config["BLOCK_M"]) * triton.cdiv(Co, config["BLOCK_N"]),)
    conv = (N, H, W, Ci, Co, P, Q, R, S, sh, sw, ph, pw)
    conv2d_fprop_kernel[grid](x, w, y, *conv, **rules.launch_options(config, x, "conv"))
    return y
