"""A module written for plain Triton: `@triton.autotune`, no tunecache (test_autotune.py
checks that `tunecache.patch_triton()` makes its tuning persist without editing it)."""

import torch
import triton
import triton.language as tl


@triton.autotune(
    configs=[triton.Config({"BLOCK": 16}, num_warps=1), triton.Config({"BLOCK": 64}, num_warps=2)],
    key=["n"],
)
@triton.jit
def add_one_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)


def add_one(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    n = x.numel()
    add_one_kernel[lambda META: (triton.cdiv(n, META["BLOCK"]),)](x, y, n)
    return y
