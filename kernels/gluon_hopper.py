"""What only the Hopper (sm_90a, WGMMA) backends share: device helpers their kernels call and
the rules that order and bound their candidates.

Kept apart from the modules the Blackwell backends share (gluon_host, gluon_split_k, ...) so
that a kernel version covers exactly the code its backend runs: an edit here re-keys the Hopper
backends only (tests/unit/test_kernel_versions_scope.py).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .gluon_device import barrier_ring, stage_operands
from .gluon_host import pow2_at_least, ring_shortfall, tap_k_step
from .hardware import HOPPER

# ---- device code -------------------------------------------------------------------------------


@gluon.constexpr_function
def wgmma_acc_layout(BLOCK_M, BLOCK_N, num_warps):
    """Accumulator layout of a [BLOCK_M, BLOCK_N] WGMMA: warps stack along M in warpgroups of
    4 (16 rows each) while M has rows to spare, then split N; the instruction's N is the
    widest multiple of 8 (<= 256) that divides each warp column's share of the tile."""
    warps = [4, 1]
    while warps[0] * warps[1] < num_warps:
        if BLOCK_M > 16 * warps[0]:
            warps[0] *= 2
        else:
            warps[1] *= 2
    max_n = max(BLOCK_N // warps[1], 8)
    n = 256
    while n > max_n or BLOCK_N % n != 0:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, n, 16])


@gluon.jit
def specialized_rings(a_desc, b_desc, c_desc, STAGES: gl.constexpr):
    """The shared memory of a warp-specialized conv kernel (a one-warp TMA loader feeding the
    WGMMA warps), allocated in this order: STAGES stages of a_desc's and b_desc's blocks; one
    block of c_desc, the epilogue's way from the WGMMA layout to the TMA store, allocated here
    so that its size is the kernel's to state (smem_bytes), not the compiler's to choose; the
    `ready` (a stage has landed) and `empty` (its WGMMA has retired) barrier rings. Every
    operand in a_desc's dtype. Returns (a_bufs, b_bufs, c_smem, ready, empty)."""
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
    return a_bufs, b_bufs, c_smem, barrier_ring(STAGES), barrier_ring(STAGES)


@gluon.jit
def wgmma_steps(a_bufs, b_bufs, ready, empty, acc, n, use, A_TRANS: gl.constexpr, B_TRANS: gl.constexpr):
    """The WGMMA warps' side of a specialized_rings ring (the fprop's and the dgrad's): n
    k-steps of WGMMAs into acc (the first overwrites it) from the ring's `use`-th stage on, each
    once its TMA loads have landed, one WGMMA in flight; a stage goes back to the loader (empty)
    once the WGMMA that read it has retired, the last after the final wait, outside the loop,
    so that no WGMMA is in flight across the epilogue's branches. An operand stored K-outer
    (A_TRANS, B_TRANS) is fed through a permuted view. Returns (acc, the next use)."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    for kk in range(n):
        slot = use % STAGES
        mbarrier.wait(ready.index(slot), (use // STAGES) & 1)
        use_acc = kk != 0
        a, b = stage_operands(a_bufs, b_bufs, slot, A_TRANS, B_TRANS)
        acc = warpgroup_mma(a, b, acc, use_acc=use_acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        # the previous k-step's WGMMA has retired: its slot goes back to the loader
        mbarrier.arrive(empty.index((use + STAGES - 1) % STAGES), pred=kk != 0)
        use += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index((use + STAGES - 1) % STAGES), pred=n > 0)
    return acc, use


# ---- candidates ------------------------------------------------------------------------------


def warp_specialized_options(num_warps: int, ctas_per_sm: int = 1) -> dict:
    """Launch options of a warp-specialized kernel (one loader warp beside num_warps WGMMA
    warps): the registers a thread holds at launch, the SM's 65536 over its CTAs' threads (the
    loader pads to a warpgroup), which Triton redistributes, the loader's unused share to the
    WGMMA warps (setmaxnreg). Uncapped, ptxas sized a CTA for the whole SM: no second CTA."""
    return {"maxnreg": HOPPER.registers_per_sm // (ctas_per_sm * (num_warps + 4) * 32) // 8 * 8}


def accumulator_per_thread(c: dict) -> int:
    """The fp32 accumulator's values (registers) each thread of a config's tile holds."""
    return c["BLOCK_M"] * c["BLOCK_N"] // (32 * c["num_warps"])


def wgmma_resources_ok(c: dict, smem_bytes: int) -> bool:
    """What the compiler decides for a WGMMA kernel: shared memory within the limit, the fp32
    accumulator within the register budget (past 128 values per thread it spills)."""
    return smem_bytes <= HOPPER.smem_per_block and accumulator_per_thread(c) <= 128


def _warps_fit(c: dict) -> bool:
    """One warpgroup below a tile of 128x128 elements, two above it, either exactly at it (its
    fp32 accumulator fills a warpgroup's registers: which wins depends on the problem)."""
    area = c["BLOCK_M"] * c["BLOCK_N"]
    return area == 128 * 128 or (c["num_warps"] == 8) == (area > 128 * 128)


def _k_step_first(c: dict, step: int = 64) -> bool:
    """K steps a capped tune times first: `step` (64, or a conv's gluon_host.tap_k_step), and per
    tile the step that keeps one stage of the ring between 24 and 48 KB, halved where two CTAs
    share an SM (CTAS_PER_SM): 128 for tiles of M + N <= 192 (its ring still 4 or more deep), 32
    for M + N >= 384 (a stage of 64 is 48 KB or more there: 3 deep at most; 32 holds the same K
    in twice the stages). H100: 128x256x32 six-stage won ResNet-50's 512-channel 3x3 fprop at
    7x7, 64x128x128 its 1x1 wgrad at 14x14, both past the cap of the 64-only subset; H200:
    128x128x32 two CTAs a SM its strided dgrads."""
    stage_kb = (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * 2 / 1024
    per_cta = c.get("CTAS_PER_SM", 1)
    return c["BLOCK_K"] == step or 24 / per_cta <= stage_kb <= 48 / per_cta


def _lead_k_step(op: str, p: dict) -> int:
    """64, or a conv's tap_k_step (the dgrad's problem comes as the GEMM it is: Ci reduced)."""
    return tap_k_step(p["Ci"]) if op == "conv2d_fprop" else 64


def quick_subset(op: str, configs: list[dict], p: dict, sm_count: int) -> list[dict]:
    """The configs most worth timing first, from configs that fit: per tile shape the deepest
    ring (and one shallower), the K steps of `_k_step_first` (or a whole filter tap for
    small-channel fprop),
    GROUP_M 8, the warps of `_warps_fit`; for wgrad stream-K, the modeled split and the splits
    around the one that fills the GPU, after every tile's unsplit and modeled variants (so that a
    cap cuts splits, not tiles). The tuner times these before the rest of the space, so a capped
    tuning run (TUNECACHE_MAX_CANDIDATES) still sees the likely winners."""
    best: dict[tuple, dict] = {}
    if op == "conv2d_wgrad":
        for c in configs:
            if not _k_step_first(c):
                continue
            k = (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"], c["num_warps"])
            if k not in best or c["num_stages"] > best[k]["num_stages"]:
                best[k] = c
        out = []
        for c in best.values():
            tiles = -(-p["Co"] // c["BLOCK_M"]) * p["R"] * p["S"] * -(-p["Ci"] // c["BLOCK_N"])
            fill = max(1, pow2_at_least(-(-max(1, sm_count) // tiles)))
            if c["SPLIT_K"] in (-1, 0, fill, max(1, fill // 2)) and _warps_fit(c):
                out.append(c)
        return sorted(out, key=lambda c: c["SPLIT_K"] not in (-1, 0))
    step = _lead_k_step(op, p)
    for c in configs:
        if not _k_step_first(c, step) and not (op == "conv2d_fprop" and c["BLOCK_K"] >= pow2_at_least(p["Ci"])):
            continue
        if c.get("GROUP_M", 8) != 8:
            continue
        if not _warps_fit(c):
            continue
        if c.get("SPLIT_K", 1) not in (0, 1):  # matmul: the modeled split and none, not each count
            continue
        k = tuple(
            c.get(n, 1) for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "SPLIT_K", "CTAS_PER_SM", "SWAP_AB")
        )
        if k not in best or c["num_stages"] > best[k]["num_stages"]:
            best[k] = c
    out = list(best.values())
    shallower = [dict(c, num_stages=c["num_stages"] - 1) for c in out if c["num_stages"] > 3]
    return out + [c for c in shallower if c in configs]


def quick_first(op: str, configs: list[dict], p: dict, sm_count: int) -> list[dict]:
    """`configs` reordered with quick_subset() first, then the rest likeliest first: a capped
    tune sees each tile's deepest ring, BLOCK_K of 64 or more and GROUP_M 8 before the shallow
    rings and narrow K steps (the space's own order put 64x64x32 two-stage rings next), and a
    matmul's modeled split before its other split counts."""
    first = quick_subset(op, configs, p, sm_count)
    rest = [c for c in configs if c not in first]
    shortfall = ring_shortfall(configs, "num_stages")
    step = _lead_k_step(op, p)

    def likeliness(c: dict) -> tuple:
        # matmul's split counts other than the model's come after every unsplit candidate
        explicit_split = op == "matmul" and c["SPLIT_K"] not in (0, 1)
        return (explicit_split, c["BLOCK_K"] < step, shortfall(c), c.get("GROUP_M", 8) != 8)

    return first + sorted(rest, key=likeliness)
