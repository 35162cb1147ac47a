"""Triton's tutorial matmul (03-matrix-multiplication) with a 48-config space, for the
drop-in benchmarks: the same kernel under `triton.autotune` and `tunecache.autotune`.

    python benchmarks/tutorial_matmul.py --variant tunecache --size 4096

runs one first call in this (fresh) process and prints one JSON line: seconds, the winner's
config and its time. Each variant must run in its own process with its own empty
TRITON_CACHE_DIR (the two share the kernel's source and so Triton's cache key).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import triton
import triton.language as tl

CONFIGS = [
    triton.Config(
        {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": 8}, num_stages=st, num_warps=w
    )
    for bm, bn, bk, st, w in itertools.product((64, 128), (64, 128, 256), (32, 64), (3, 4), (4, 8))
]
assert len(CONFIGS) == 48


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


def autotuned(variant: str, configs: list = CONFIGS):
    """The kernel under `variant`'s autotuner ("triton", "triton-cached" or "tunecache")."""
    jitted = triton.jit(matmul_kernel)
    if variant == "tunecache":
        import tunecache

        return tunecache.autotune(configs=configs, key=["M", "N", "K"])(jitted)
    return triton.autotune(configs=configs, key=["M", "N", "K"], cache_results=variant == "triton-cached")(jitted)


def launch(kernel, a, b):
    import torch

    M, K = a.shape
    _, N = b.shape
    c = torch.empty((M, N), device=a.device, dtype=a.dtype)
    grid = lambda META: (triton.cdiv(M, META["BLOCK_SIZE_M"]) * triton.cdiv(N, META["BLOCK_SIZE_N"]),)  # noqa: E731
    kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    return c


def config_of(kernel) -> dict | None:
    best = getattr(kernel, "best_config", None)
    if best is None:
        return None
    return {"kwargs": dict(best.kwargs), "num_warps": best.num_warps, "num_stages": best.num_stages}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=("triton", "triton-cached", "tunecache"), required=True)
    ap.add_argument("--size", type=int, default=4096)
    args = ap.parse_args()
    import torch

    torch.manual_seed(0)
    a = torch.randn(args.size, args.size, device="cuda", dtype=torch.float16)
    b = torch.randn(args.size, args.size, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    kernel = autotuned(args.variant)
    c = launch(kernel, a, b)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    err = ((c.float() - a.float() @ b.float()).norm() / (a.float() @ b.float()).norm()).item()
    print(json.dumps({"variant": args.variant, "seconds": seconds, "config": config_of(kernel), "rel_error": err}))


if __name__ == "__main__":
    main()
