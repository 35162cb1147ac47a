"""Kernels for test_autotune.py, decorated with `tunecache.autotune` (jit needs a real file).

Run them under TRITON_INTERPRET=1: test_autotune.py starts fresh processes that import this.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import tunecache

ROOT = Path(__file__).resolve().parents[3]
BENCH_CALLS: list[int] = []


def counting_bench(kernel_call, quantiles=None):
    """A `do_bench` that records its calls. Each call reports a shorter time than the one
    before, so the last candidate benchmarked wins, whatever the wall clock says: a process
    that skipped the benchmark and fell back to the first config would be caught."""
    kernel_call()
    BENCH_CALLS.append(1)
    ms = 10.0 - 0.5 * len(BENCH_CALLS)
    return [ms, ms, ms] if quantiles else ms


# ---- Triton's tutorial matmul (03-matrix-multiplication), as benchmarks/tutorial_matmul.py holds it

# loaded by path: benchmarks/ is no package, and a child process has only KERNELS and ROOT on its path
_spec = importlib.util.spec_from_file_location("tutorial_matmul", ROOT / "benchmarks" / "tutorial_matmul.py")
tutorial_matmul = sys.modules["tutorial_matmul"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tutorial_matmul)

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

matmul_kernel = tunecache.autotune(configs=MATMUL_CONFIGS, key=["M", "N", "K"], do_bench=counting_bench)(
    triton.jit(tutorial_matmul.matmul_kernel)
)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return tutorial_matmul.launch(matmul_kernel, a, b)


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
