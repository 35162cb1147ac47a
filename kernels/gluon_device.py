"""Device helpers both Gluon architectures' kernels call: a ring of mbarriers set up and torn
down, a ring stage's operands as an MMA reads them, the grouped tile order, and an
implicit-GEMM conv's walk over (channel block, filter tap) k-steps.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


@gluon.jit
def barrier_ring(NUM: gl.constexpr):
    """A ring of NUM mbarriers in shared memory, each initialized for one arrival."""
    bars = gl.allocate_shared_memory(gl.int64, [NUM, 1], mbarrier.MBarrierLayout())
    init_ring(bars)
    return bars


@gluon.jit
def init_ring(bars, count: gl.constexpr = 1):
    """Initialize a ring of mbarriers ([NUM, 1] in shared memory), each expecting `count` arrivals."""
    NUM: gl.constexpr = bars.shape[0]
    for i in gl.static_range(NUM):
        mbarrier.init(bars.index(i), count=count)


@gluon.jit
def invalidate_ring(bars):
    NUM: gl.constexpr = bars.shape[0]
    for i in gl.static_range(NUM):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def invalidate_rings(first, second, third=None, fourth=None):
    """A kernel's rings of mbarriers, invalidated in this order once it is done with them."""
    invalidate_ring(first)
    invalidate_ring(second)
    if third is not None:
        invalidate_ring(third)
    if fourth is not None:
        invalidate_ring(fourth)


@gluon.jit
def stage_operands(a_bufs, b_bufs, slot, A_TRANS: gl.constexpr, B_TRANS: gl.constexpr):
    """Stage `slot` of the operand rings as an MMA (WGMMA, tcgen05) reads it: an operand stored
    K-outer (A_TRANS, B_TRANS) through a permuted view. Returns (a, b)."""
    a = a_bufs.index(slot)
    if A_TRANS:
        a = a.permute((1, 0))
    b = b_bufs.index(slot)
    if B_TRANS:
        b = b.permute((1, 0))
    return a, b


@gluon.jit
def grouped_tile(tile_id, num_pid_m, num_pid_n, group_m):
    """Tile id -> (pid_m, pid_n), walking `group_m` row-tiles at a time so that they
    share their B columns in L2 while all SMs work on the same band."""
    tiles_per_group = group_m * num_pid_n
    first_m = (tile_id // tiles_per_group) * group_m
    rows = gl.minimum(num_pid_m - first_m, group_m)
    in_group = tile_id % tiles_per_group
    return first_m + in_group % rows, in_group // rows


@gluon.jit
def next_conv_k(c0, r, s, Ci, R, S, BLOCK_K: gl.constexpr):
    """An implicit-GEMM conv's next k-step: (channel block, tap) advanced by one without
    dividing, channel blocks of a tap before the next tap; `done` when the tile's k-loop wraps."""
    c0 = c0 + BLOCK_K
    wrap_c = c0 >= Ci
    c0 = gl.where(wrap_c, 0, c0)
    s = gl.where(wrap_c, s + 1, s)
    wrap_s = s == S
    s = gl.where(wrap_s, 0, s)
    r = gl.where(wrap_s, r + 1, r)
    done = r == R
    r = gl.where(done, 0, r)
    return c0, r, s, done
