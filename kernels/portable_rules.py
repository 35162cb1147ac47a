"""Pruning rules shared by the portable kernels (plain data in, bool out)."""

from __future__ import annotations


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def interpreter_ok(c: dict, sizes: dict[str, int], fixed: dict) -> bool:
    """On the CPU interpreter only tile shapes matter: warps and stages change nothing, and a
    tile far larger than the problem only costs time. Keep one value of each fixed knob."""
    if any(c[k] != v for k, v in fixed.items() if k in c):
        return False
    if any(c[b] > max(16, pow2_at_least(n)) for b, n in sizes.items()):
        return False
    return c["BLOCK_M"] * c["BLOCK_N"] <= 64 * 64


def gpu_ok(c: dict, sizes: dict[str, int], itemsize: int, smem_limit: int = 227 * 1024) -> bool:
    """Shared memory of the pipelined tiles within the limit, no tile more than twice the
    problem, and the fp32 accumulator within ~256 registers per thread."""
    smem = c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * itemsize
    if smem > smem_limit:
        return False
    if any(c[b] > max(16, 2 * pow2_at_least(n)) for b, n in sizes.items()):
        return False
    return c["BLOCK_M"] * c["BLOCK_N"] // (32 * c["num_warps"]) <= 256


INTERPRETER_FIXED = {"num_warps": 4, "num_stages": 3, "GROUP_M": 8}


def interpreter_upcast(t) -> bool:
    """The CPU interpreter computes tl.dot in numpy, which has no bfloat16 (it multiplies the
    raw bits as integers): upcast the operands there. On a GPU, bf16 goes to the tensor cores."""
    import torch

    return t.device.type == "cpu" and t.dtype == torch.bfloat16
