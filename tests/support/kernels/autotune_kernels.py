"""Kernels for test_autotune.py, decorated with `tunecache.autotune` (jit needs a real file).

Run them under TRITON_INTERPRET=1: test_autotune.py starts fresh processes that import this.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import tunecache

BENCH_CALLS: list[int] = []


def counting_bench(kernel_call, quantiles=None):
    """A `do_bench` that records its calls. Each call reports a shorter time than the one
    before, so the last candidate benchmarked wins, whatever the wall clock says: a process
    that skipped the benchmark and fell back to the first config would be caught."""
    kernel_call()
    BENCH_CALLS.append(1)
    ms = 10.0 - 0.5 * len(BENCH_CALLS)
    return [ms, ms, ms] if quantiles else ms


# ---- a blocked matmul, as in Triton's tutorial 03-matrix-multiplication -------------------

MATMUL_CONFIGS = [
    triton.Config(
        {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 2}, num_warps=4, num_stages=2
    ),
    triton.Config(
        {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 2}, num_warps=4, num_stages=3
    ),
    triton.Config(
        {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 1}, num_warps=2, num_stages=3
    ),
]


@tunecache.autotune(configs=MATMUL_CONFIGS, key=["M", "N", "K"], do_bench=counting_bench)
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
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
):
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_am = (pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)) % M
    offs_bn = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)) % N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + (offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak)
    b_ptrs = b_ptr + (offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn)
    accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k * BLOCK_SIZE_K, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k * BLOCK_SIZE_K, other=0.0)
        accumulator = tl.dot(a, b, accumulator)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk
    c = accumulator.to(c_ptr.dtype.element_ty)

    offs_cm = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    c_ptrs = c_ptr + stride_cm * offs_cm[:, None] + stride_cn * offs_cn[None, :]
    c_mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
    tl.store(c_ptrs, c, mask=c_mask)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    M, K = a.shape
    K, N = b.shape
    c = torch.empty((M, N), device=a.device, dtype=a.dtype)

    def grid(META):
        return (triton.cdiv(M, META["BLOCK_SIZE_M"]) * triton.cdiv(N, META["BLOCK_SIZE_N"]),)

    matmul_kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    return c


# ---- configs with a pre_hook that sets a descriptor's block shape (as conv fprop does) -----

HOOK_CALLS: list[tuple[int, int]] = []


def set_block_shape(nargs):
    HOOK_CALLS.append((nargs["BLOCK_M"], nargs["BLOCK_N"]))
    nargs["in_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_N"]]


SCALE_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, pre_hook=set_block_shape)
    for bm, bn in ((16, 8), (32, 8), (16, 16))
]


@tunecache.autotune(configs=SCALE_CONFIGS, key=["M", "N"], do_bench=counting_bench)
@triton.jit
def scale_kernel(in_desc, out_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    tile = in_desc.load([pid_m * BLOCK_M, pid_n * BLOCK_N])
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(out_ptr + offs_m * N + offs_n, tile * 2, mask=(offs_m < M) & (offs_n < N))


def scale(x: torch.Tensor) -> torch.Tensor:
    """2 * x through a tensor descriptor whose block shape only the config's pre_hook sets."""
    M, N = x.shape
    out = torch.zeros_like(x)
    in_desc = TensorDescriptor.from_tensor(x, [1, 1])  # a placeholder the kernel cannot run with

    def grid(META):
        return (triton.cdiv(M, META["BLOCK_M"]), triton.cdiv(N, META["BLOCK_N"]))

    scale_kernel[grid](in_desc, out, M, N)
    return out
