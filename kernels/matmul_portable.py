"""Portable blocked matmul in `triton.language`: any CUDA GPU Triton supports, and the CPU
interpreter (TRITON_INTERPRET=1). Any M, N, K; row- or column-major inputs via strides."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import portable_rules as rules
from . import portable_tiles as tiles
from . import problems

OP, BACKEND, KERNEL, problem, inputs, reference, flops = problems.backend_names("matmul", "portable")


@triton.jit
def matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m, pid_n = tiles.grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None].to(tl.int64) * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _extents(p: dict) -> tuple:
    """The problem's extent along (BLOCK_M, BLOCK_N, BLOCK_K), and its GEMM's (M, N, K)."""
    return (p["M"], p["N"], p["K"]), (p["M"], p["N"], p["K"])


JIT_FUNCTIONS = (matmul_kernel,)
supports, config_space, prune, default_config = rules.host_rules(
    OP, _extents, cpu=(32, 32, 32, 4), gpu=(128, 128, 32, 8)
)


def launch(config: dict, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), device=a.device, dtype=a.dtype)
    grid = (triton.cdiv(M, config["BLOCK_M"]) * triton.cdiv(N, config["BLOCK_N"]),)
    strides = (*a.stride(), *b.stride(), *c.stride())
    matmul_kernel[grid](a, b, c, M, N, K, *strides, **rules.launch_options(config, a, "matmul"))
    return c
