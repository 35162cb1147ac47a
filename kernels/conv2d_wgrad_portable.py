"""Portable conv2d wgrad in `triton.language`: grad_w[Co, R*S*Ci] = grad_out^T @ im2col(x),
reduced over M = N*P*Q. SPLIT_K programs each own a slice of M and write fp32 partials that
are summed in a fixed order afterwards, so the result is deterministic."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import portable_rules as rules
from . import problems
from .spaces.portable import SPACES

OP, BACKEND, KERNEL, problem, inputs, reference, flops = problems.backend_names("conv2d_wgrad", "portable")


@triton.jit
def conv2d_wgrad_kernel(
    x_ptr,
    g_ptr,
    ws_ptr,
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
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)  # over Co
    pid_n = tl.program_id(1)  # over R*S*Ci
    pid_k = tl.program_id(2)  # split of N*P*Q
    RSC = R * S * Ci
    NPQ = N * P * Q
    offs_co = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r = offs_j // (S * Ci)
    s = (offs_j // Ci) % S
    c = offs_j % Ci
    co_ok = offs_co < Co
    j_ok = offs_j < RSC
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = min(k_start + k_per_split, NPQ)
    for k0 in range(k_start, k_end, BLOCK_K):
        m = k0 + tl.arange(0, BLOCK_K)
        m_ok = m < k_end
        n = m // (P * Q)
        pq = m % (P * Q)
        ih = ((pq // Q) * stride_h - pad_h)[:, None] + r[None, :]
        iw = ((pq % Q) * stride_w - pad_w)[:, None] + s[None, :]
        # A = grad_out^T tile [BLOCK_M (co), BLOCK_K (m)]
        a = tl.load(
            g_ptr + m[None, :].to(tl.int64) * Co + offs_co[:, None], mask=co_ok[:, None] & m_ok[None, :], other=0.0
        )
        # B = im2col(x) tile [BLOCK_K (m), BLOCK_N (r, s, c)]
        ok = m_ok[:, None] & j_ok[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        xoff = ((n[:, None].to(tl.int64) * H + ih) * W + iw) * Ci + c[None, :]
        b = tl.load(x_ptr + xoff, mask=ok, other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    ws = ws_ptr + pid_k.to(tl.int64) * Co * RSC + offs_co[:, None].to(tl.int64) * RSC + offs_j[None, :]
    tl.store(ws, acc, mask=co_ok[:, None] & j_ok[None, :])


JIT_FUNCTIONS = (conv2d_wgrad_kernel,)


supports = rules.supports


def config_space(p: dict, device) -> list[dict]:
    return list(SPACES[OP])


def _sizes(p: dict) -> dict[str, int]:
    return {"BLOCK_M": p["Co"], "BLOCK_N": p["gemm_N"], "BLOCK_K": p["gemm_K"]}


def prune(configs: list[dict], p: dict, device) -> list[dict]:
    # a split must leave each program at least one full BLOCK_K of the reduction
    configs = [c for c in configs if c["SPLIT_K"] * c["BLOCK_K"] <= max(c["BLOCK_K"], p["gemm_K"])]
    if device.arch == "cpu":
        configs = [c for c in configs if c["SPLIT_K"] in (1, 4)]
    gemm = (p["gemm_M"], p["gemm_N"], p["gemm_K"])
    return rules.prune(configs, p, device, _sizes(p), gemm, gpu_extra=lambda c: _split_ok(c, p, device))


def _split_ok(c: dict, p: dict, device) -> bool:
    """Split the reduction only as far as it takes to fill the GPU about twice over."""
    tiles = -(-p["Co"] // c["BLOCK_M"]) * -(-p["gemm_N"] // c["BLOCK_N"])
    if c["SPLIT_K"] == 1:
        return True
    return tiles * c["SPLIT_K"] <= 4 * max(1, device.sm_count) and tiles < 2 * max(1, device.sm_count)


_CPU_DEFAULT = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3}
_GPU_DEFAULT = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "SPLIT_K": 4, "num_warps": 4, "num_stages": 3}


def default_config(p: dict, device) -> dict:
    c = rules.default(_CPU_DEFAULT, _GPU_DEFAULT, _sizes(p), device)
    if prune([c], p, device):
        return c
    return dict(c, SPLIT_K=1)  # a reduction too short to split


def launch(config: dict, x: torch.Tensor, grad_out: torch.Tensor, R: int, S: int, stride=1, padding=0) -> torch.Tensor:
    N, H, W, Ci = x.shape
    _, P, Q, Co = grad_out.shape
    (sh, sw), (ph, pw) = problems.stride_padding(stride, padding)
    bm, bn, bk, split = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], config["SPLIT_K"]
    npq, rsc = N * P * Q, R * S * Ci
    k_per_split = triton.cdiv(triton.cdiv(npq, bk), split) * bk
    split = triton.cdiv(npq, k_per_split)  # no empty splits
    ws = torch.empty((split, Co, rsc), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(Co, bm), triton.cdiv(rsc, bn), split)
    conv = (N, H, W, Ci, Co, P, Q, R, S, sh, sw, ph, pw)
    conv2d_wgrad_kernel[grid](x, grad_out, ws, *conv, k_per_split, **rules.launch_options(config, x, "conv"))
    # the second pass: a fixed-order sum of the partials, so split-K stays deterministic
    gw = ws[0] if split == 1 else ws.sum(dim=0)
    return gw.to(x.dtype).view(Co, R, S, Ci)
