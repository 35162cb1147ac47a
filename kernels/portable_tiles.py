"""The tile order of the portable kernels (matmul, conv2d fprop and dgrad)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile id -> (pid_m, pid_n), GROUP_M row-tiles at a time so their B columns stay in L2."""
    group = GROUP_M * num_pid_n
    first_m = (tile // group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % group) % group_m, (tile % group) // group_m
