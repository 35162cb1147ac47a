"""Device-side Gluon building blocks shared by the Blackwell (sm_100a) kernels.

Every Blackwell kernel here has the same shape: a persistent grid, three warp-specialized
partitions (TMA loads, tcgen05 MMA, epilogue) talking through mbarrier rings, an operand
ring of `NUM_BUFFERS` shared-memory stages and an accumulator ring of `NUM_ACC` tensor
memory buffers, so the epilogue of one tile overlaps the main loop of the next.

Ring protocol (one producer, one consumer, `n` slots):
  the i-th use of a ring is slot i % n with phase (i // n) & 1;
  the consumer waits `ready[slot]` on that phase; the producer waits `empty[slot]` on the
  flipped phase, which returns at once on a fresh barrier, so the first lap needs no
  pre-arrival.

The host side (descriptors, grids, split-K workspace and the reduction) is shared with the
Hopper backend (gluon_host, gluon_split_k and the op modules gluon_matmul, gluon_dgrad,
gluon_wgrad, gluon_packed_taps); what lives here runs on the device, and the one host rule only
the Blackwell backends follow: which devices they run on, their resource rule (the shared
memory of the rings above, tensor memory) and the order their pruned candidates are timed in.
The limits of the hardware (shared and tensor memory, registers) are in hardware.py.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (
    TensorMemoryLayout,
    allocate_tensor_memory,
    fence_async_shared,
    mbarrier,
    tcgen05_commit,
    tcgen05_mma,
    tma,
)

from .gluon_device import barrier_ring, grouped_tile, stage_operands
from .gluon_host import ITEMSIZE, ring_shortfall, sm_count_of
from .hardware import BLACKWELL

# Registers per thread the one-warp load and MMA partitions keep (setmaxnreg); the epilogue
# warps get the rest of the register file.
WORKER_REGS = gl.constexpr(40)


@gluon.jit
def ring_slot(use, NUM: gl.constexpr):
    """(slot, phase) of the `use`-th use of a ring of NUM slots."""
    return use % NUM, (use // NUM) & 1


@gluon.jit
def free_stage(use, empty, ready, nbytes: gl.constexpr):
    """The producer's side of the operand ring (a load partition's): once the MMA has released
    the ring's `use`-th stage (its slot's `empty` barrier, on the flipped phase), that slot's
    `ready` barrier set to expect `nbytes` of TMA loads. Returns (slot, its ready barrier)."""
    NUM: gl.constexpr = empty.shape[0]
    slot, phase = ring_slot(use, NUM)
    mbarrier.wait(empty.index(slot), phase ^ 1)
    bar = ready.index(slot)
    mbarrier.expect(bar, nbytes)
    return slot, bar


@gluon.jit
def pipeline_rings(
    a_desc, b_desc, NUM_BUFFERS: gl.constexpr, NUM_ACC: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr
):
    """The rings every persistent kernel here runs on, allocated and initialized: the operand
    ring (NUM_BUFFERS stages of a_desc's and b_desc's blocks, `ready` and `empty` barriers) and
    the accumulator ring (NUM_ACC fp32 [BLOCK_M, BLOCK_N] buffers in tensor memory, `acc_ready`
    and `acc_empty`). Returns (a_bufs, b_bufs, ready, empty, acc_ready, acc_empty, acc_tmem)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUFFERS] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_BUFFERS] + b_desc.block_type.shape, b_desc.layout)
    ready = barrier_ring(NUM_BUFFERS)
    empty = barrier_ring(NUM_BUFFERS)
    acc_ready = barrier_ring(NUM_ACC)
    acc_empty = barrier_ring(NUM_ACC)
    tmem_layout: gl.constexpr = TensorMemoryLayout(block=(BLOCK_M, BLOCK_N), col_stride=1)
    acc_tmem = allocate_tensor_memory(gl.float32, [NUM_ACC, BLOCK_M, BLOCK_N], tmem_layout)
    return a_bufs, b_bufs, ready, empty, acc_ready, acc_empty, acc_tmem


# ---- one tile per CTA, one operand gathered in registers (the packed-taps and few-Co kernels) ----


@gluon.jit
def gather_rings(NUM_BUFFERS: gl.constexpr, ACC_BARS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The barriers and the accumulator of a kernel that TMA-loads one operand and gathers the
    other: `ready` (a TMA stage has landed), `done` (the MMA that read a stage of both rings has
    completed), ACC_BARS barriers for the accumulator, and the fp32 [BLOCK_M, BLOCK_N]
    accumulator in tensor memory. Returns (ready, done, acc_bar, acc)."""
    ready = barrier_ring(NUM_BUFFERS)
    done = barrier_ring(NUM_BUFFERS)
    acc_bar = barrier_ring(ACC_BARS)
    acc = allocate_tensor_memory(gl.float32, [BLOCK_M, BLOCK_N], TensorMemoryLayout((BLOCK_M, BLOCK_N), col_stride=1))
    return ready, done, acc_bar, acc


@gluon.jit
def store_gathered(tile, bufs, done, use):
    """The gathered operand's `use`-th k-step tile into its stage of `bufs`, once the MMA that
    last read that stage is done; returns the stage's (slot, phase)."""
    slot, phase = ring_slot(use, bufs.shape[0])
    mbarrier.wait(done.index(slot), phase ^ 1)
    bufs.index(slot).store(tile)
    fence_async_shared()
    return slot, phase


@gluon.jit
def mma_when_loaded(a_bufs, b_bufs, acc, slot, phase, ready, done, use, A_TRANS: gl.constexpr, B_TRANS: gl.constexpr):
    """Once stage `slot`'s TMA operand has landed, the `use`-th k-step's MMA into `acc` (the
    first one overwrites it), which arrives on done[slot] when complete (an operand stored
    K-outer is fed through a permuted view)."""
    mbarrier.wait(ready.index(slot), phase)
    a, b = stage_operands(a_bufs, b_bufs, slot, A_TRANS, B_TRANS)
    tcgen05_mma(a, b, acc, use_acc=use > 0, mbarriers=[done.index(slot)])


@gluon.jit
def wait_acc(acc_bar):
    """Every MMA issued so far has completed: the accumulator holds its final value."""
    tcgen05_commit(acc_bar.index(0))
    mbarrier.wait(acc_bar.index(0), 0)


@gluon.jit
def split_k_range(work_id, tiles_per_split, total_k, k_per_split):
    """(split, first K iteration, number of K iterations) of work item `work_id`.

    Work items are numbered split-major: the CTAs running at the same time work on the same
    split, i.e. the same slab of the reduction, which they then share in L2. Without split-K
    (tiles_per_split = all tiles, k_per_split = total_k) this is (0, 0, total_k)."""
    split = work_id // tiles_per_split
    k_start = split * k_per_split
    return split, k_start, gl.minimum(k_per_split, total_k - k_start)


@gluon.jit
def mma_chain(a_bufs, b_bufs, ready, empty, acc, k_count, use, A_TRANS: gl.constexpr, B_TRANS: gl.constexpr):
    """k_count tcgen05 MMAs into `acc` from the operand ring's stages `use`.. on; returns the
    ring's new use count. Every MMA releases its operand stage (arrives on `empty`) when the
    tensor core is done with it. An operand stored K-outer ([BLOCK_K, rows]) is fed through a
    permuted view (mma_when_loaded)."""
    NUM_BUFFERS: gl.constexpr = a_bufs.shape[0]
    for ki in range(k_count):
        slot, phase = ring_slot(use, NUM_BUFFERS)
        mma_when_loaded(a_bufs, b_bufs, acc, slot, phase, ready, empty, ki, A_TRANS, B_TRANS)
        use += 1
    return use


@gluon.jit
def mma_partition(rings, num_work, tiles_per_split, total_k, k_per_split, A_TRANS: gl.constexpr, B_TRANS: gl.constexpr):
    """The MMA warp: for each work item, chain tcgen05 MMAs over its K range into the next
    free accumulator (mma_chain); a commit after the last one hands the accumulator to the
    epilogue. rings: pipeline_rings' (mma_into_next_acc)."""
    use = 0
    acc_use = 0
    for work_id in range(gl.program_id(0), num_work, gl.num_programs(0)):
        _, _, k_count = split_k_range(work_id, tiles_per_split, total_k, k_per_split)
        use, acc_use = mma_into_next_acc(rings, 0, k_count, use, acc_use, A_TRANS, B_TRANS)


@gluon.jit
def mma_into_next_acc(rings, k_from, k_to, use, acc_use, A_TRANS: gl.constexpr, B_TRANS: gl.constexpr):
    """One work item of an MMA warp: once the epilogue has freed the next accumulator of the
    acc_tmem ring (acc_use-th), the MMAs of its k-steps [k_from, k_to) chained into it (mma_chain,
    from ring use `use`), then a commit that hands it to the epilogue; returns the next
    (use, acc_use). rings: what pipeline_rings returns, (a_bufs, b_bufs, ready, empty,
    acc_ready, acc_empty, acc_tmem), as the kernel passes it to its MMA partition."""
    a_bufs, b_bufs, ready, empty, acc_ready, acc_empty, acc_tmem = rings
    NUM_ACC: gl.constexpr = acc_tmem.shape[0]
    acc_slot, acc_phase = ring_slot(acc_use, NUM_ACC)
    mbarrier.wait(acc_empty.index(acc_slot), acc_phase ^ 1)
    use = mma_chain(a_bufs, b_bufs, ready, empty, acc_tmem.index(acc_slot), k_to - k_from, use, A_TRANS, B_TRANS)
    # arrives when every MMA issued so far, this tile's last one included, is complete
    tcgen05_commit(acc_ready.index(acc_slot))
    return use, acc_use + 1


@gluon.jit
def tma_store_epilogue(c_desc, c_smem, acc_tmem, acc_ready, acc_empty, num_pid_m, num_pid_n, group_m):
    """The epilogue partition of a GEMM whose output is a row-major [rows, cols] tensor:
    tensor memory -> registers -> shared memory -> TMA store, in slices of c_desc's block
    width through two staging buffers, so one slice's store overlaps the next one's load.
    The accumulator goes back to the MMA warp as soon as its last slice is in registers."""
    NUM_ACC: gl.constexpr = acc_tmem.shape[0]
    BLOCK_M: gl.constexpr = acc_tmem.shape[1]
    BLOCK_N: gl.constexpr = acc_tmem.shape[2]
    EPI_N: gl.constexpr = c_desc.block_type.shape[1]
    SLICES: gl.constexpr = BLOCK_N // EPI_N
    acc_use = 0
    store_use = 0
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, group_m)
        acc_slot, acc_phase = ring_slot(acc_use, NUM_ACC)
        mbarrier.wait(acc_ready.index(acc_slot), acc_phase)
        acc = acc_tmem.index(acc_slot)
        for j in gl.static_range(SLICES):
            part = acc.slice(j * EPI_N, EPI_N).load().to(c_desc.dtype)
            if j == SLICES - 1:
                # the whole accumulator is in registers (the conversion above consumed it):
                # the MMA warp may start the next tile in it
                mbarrier.arrive(acc_empty.index(acc_slot))
            buf = c_smem.index(store_use % 2)
            tma.store_wait(1)  # the store issued from this buffer two slices ago has read it
            buf.store(part)
            fence_async_shared()
            tma.async_store(c_desc, [pid_m * BLOCK_M, pid_n * BLOCK_N + j * EPI_N], buf)
            store_use += 1
        acc_use += 1
    tma.store_wait(0)


@gluon.jit
def store_acc_masked(acc, acc_free, base, row0, n_rows, row_stride, col0, n_cols, partials=None, first=0, last=0):
    """An accumulator's rows row0.. and columns col0.. stored from registers, one epilogue
    slice at a time, to base[row * row_stride + col] (cast to base's element type) where row <
    n_rows and col < n_cols: an epilogue whose output TMA cannot store (fp32 split partials, a
    tile that overhangs into a neighbour's columns). With `partials`, the fp32 tiles
    partials[first..last) ([BLOCK_M, BLOCK_N] each) are added first, in that order
    (deterministic). `acc_free` is arrived on once the last slice is in registers, handing the
    accumulator back to the MMA warp."""
    BLOCK_M: gl.constexpr = acc.shape[0]
    BLOCK_N: gl.constexpr = acc.shape[1]
    EPI_N: gl.constexpr = epilogue_width(BLOCK_N)
    SLICES: gl.constexpr = BLOCK_N // EPI_N
    slice_layout: gl.constexpr = acc.slice(0, EPI_N).get_reg_layout()
    r = gl.arange(0, BLOCK_M, gl.SliceLayout(1, slice_layout))
    c = gl.arange(0, EPI_N, gl.SliceLayout(0, slice_layout))
    rows = row0 + r
    row_ptrs = base + rows.to(gl.int64)[:, None] * row_stride
    row_ok = rows[:, None] < n_rows
    for j in gl.static_range(SLICES):
        part = acc.slice(j * EPI_N, EPI_N).load(slice_layout)
        if j == SLICES - 1:
            mbarrier.arrive(acc_free)
        if partials is not None:
            offs = r[:, None] * BLOCK_N + (j * EPI_N + c)[None, :]
            for k in range(first, last):
                part += gl.load(partials + k.to(gl.int64) * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
        cols = col0 + j * EPI_N + c
        gl.store(row_ptrs + cols[None, :], part.to(base.dtype.element_ty), mask=row_ok & (cols[None, :] < n_cols))


@gluon.jit
def partial_epilogue(ws_ptr, acc_tmem, acc_ready, acc_empty, num_pid_m, num_pid_n, group_m, num_work, M, LDW):
    """The epilogue of a conv's split binary (fprop; a stride-1 dgrad): work items are (split,
    tile) pairs numbered split-major, and each one's fp32 partial goes from tensor memory into
    its split's slab of ws [splits, M, LDW] (rows of M pixels), summed afterwards in split order
    by gluon_split_k.split_k_reduce (the Hopper convs' deterministic second pass)."""
    NUM_ACC: gl.constexpr = acc_tmem.shape[0]
    BLOCK_M: gl.constexpr = acc_tmem.shape[1]
    BLOCK_N: gl.constexpr = acc_tmem.shape[2]
    tiles = num_pid_m * num_pid_n
    acc_use = 0
    for work_id in range(gl.program_id(0), num_work, gl.num_programs(0)):
        split = work_id // tiles
        pid_m, pid_n = grouped_tile(work_id - split * tiles, num_pid_m, num_pid_n, group_m)
        acc_slot, acc_phase = ring_slot(acc_use, NUM_ACC)
        mbarrier.wait(acc_ready.index(acc_slot), acc_phase)
        base = ws_ptr + split.to(gl.int64) * M * LDW
        store_acc_masked(
            acc_tmem.index(acc_slot), acc_empty.index(acc_slot), base, pid_m * BLOCK_M, M, LDW, pid_n * BLOCK_N, LDW
        )
        acc_use += 1


@gluon.constexpr_function
def epilogue_width(block_n):
    """Columns per epilogue slice: 64 fp32 registers per thread at 4 warps and BLOCK_M=128."""
    return min(block_n, 64)


# ---- candidate order (host side) -------------------------------------------------------------


def likeliest_first(configs: list[dict], k_step: int = 64) -> list[dict]:
    """`configs` (those that fit the device) with the likeliest winners first, for a capped tune
    (TUNECACHE_MAX_CANDIDATES, 48 by default, times the first ones): every tile at the deepest
    ring that fits it (the seeds' persistent kernels still gained at 4 stages), GROUP_M 8 and a
    K step of `k_step` (64, or a conv's gluon_host.tap_k_step; then longer, then shorter steps)
    before shallower rings; the unsplit and modeled schedules
    (SPLIT_K 1 and 0) before explicit split counts and stream-K. In the spaces' own order, a
    capped tune of a 4096^3 matmul timed 46 configs of 64-row tiles and 2 of 128 rows."""

    shortfall = ring_shortfall(configs, "NUM_BUFFERS")

    def likeliness(c: dict) -> tuple:
        step = 0 if c["BLOCK_K"] == k_step else 1 if c["BLOCK_K"] > k_step else 2
        return (
            c.get("SPLIT_K", 1) not in (0, 1),
            shortfall(c),
            c.get("GROUP_M", 8) != 8,
            step,
        )

    return sorted(configs, key=likeliness)


# ---- the host rules every Blackwell backend follows ----------------------------------------------


def on_blackwell(device) -> bool:
    """Whether a DeviceClass is a data-center Blackwell (sm_100: compute capability 10.x)."""
    cap = getattr(device, "capability", None)
    return cap is not None and cap[0] == 10


def space_worth_trying(space, p: dict, device, worth_trying) -> list[dict]:
    """A backend's config_space(): `space` less the configs that cannot help on this problem
    (its worth_trying(c, p, sms)). Resource limits are left to prune(), which must agree with
    the compiler."""
    sms = sm_count_of(device)
    return [c for c in space if worth_trying(c, p, sms)]


def epilogue_n(c: dict) -> int:
    """A config's epilogue slice width (epilogue_width), the TMA store's block width."""
    return epilogue_width(c["BLOCK_N"])


# bytes the compiler adds beyond the buffers (the tensor-memory base address and alignment),
# measured over the whole spaces with `tunecache compile --all`
SMEM_OVERHEAD = 256


def smem_bytes(c: dict, p: dict, staged: bool) -> int:
    """Shared memory a persistent kernel here allocates (pipeline_rings), as the compiler reports
    it to within its few bytes of bookkeeping (SMEM_OVERHEAD): the operand ring, two epilogue
    staging slices where `staged` (a TMA-store epilogue; one from registers has none) and the
    operand and accumulator rings' barriers; c as launched."""
    item = ITEMSIZE[p["dtype"]]
    ring = c["NUM_BUFFERS"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * item
    staging = 2 * c["BLOCK_M"] * epilogue_n(c) * item if staged else 0
    return ring + staging + 8 * (2 * c["NUM_BUFFERS"] + 2 * c["NUM_ACC"]) + SMEM_OVERHEAD


def tmem_columns(c: dict) -> int:
    """Tensor-memory columns of the accumulator ring: NUM_ACC fp32 [BLOCK_M, BLOCK_N] buffers."""
    return c["NUM_ACC"] * c["BLOCK_N"]


def fits(c: dict, smem: int) -> bool:
    """The resource rule of a config (a backend's prune() applies it; it must agree with the
    compiler): `smem` bytes of shared memory within the per-block limit and the accumulator ring
    within tensor memory."""
    return smem <= BLACKWELL.smem_per_block and tmem_columns(c) <= BLACKWELL.tmem_columns
