"""Blackwell (sm_100a) matmul in Gluon: c[M, N] = a[M, K] @ b[K, N].

Persistent and warp-specialized (the building blocks are in gluon_blackwell.py):
  load partition (1 warp)   TMA tiles of a and b into a ring of NUM_BUFFERS stages;
  MMA partition (1 warp)    tcgen05 MMAs into a ring of NUM_ACC fp32 accumulators in tensor
                            memory; each MMA releases its operand stage when it completes;
  epilogue (num_warps)      tensor memory -> registers -> shared memory -> TMA store, in
                            64-column slices, handing the accumulator back to the MMA warp as
                            soon as it is read, so tile i's epilogue overlaps tile i+1's loop.
fp16 or bf16 in and out, fp32 accumulation, any M, N, K, either operand row-major or a
transpose of a row-major matrix (loaded as tiles of the row-major storage and fed to the MMA
through a permuted shared-memory view).

GROUP_M is a runtime argument: it changes the tile order, not the code, so configs that
differ only in it share one compiled kernel.

Split-K (SPLIT_K in the space, the rules the Hopper matmul follows, gluon_matmul.matmul_splits):
when the output tiles cannot fill the SMs (decode GEMMs), each tile's K is cut into `splits`
runs; work items are (split, tile) pairs numbered split-major, as in the wgrad kernel; the
epilogue writes each item's fp32 partial from registers, and the tile's last split to arrive
sums them in split order into c (gluon_matmul.finish_split_tile: one launch, deterministic). A
split launch runs its own binary (SPLIT): the unsplit one keeps the TMA-store epilogue and no
workspace traffic.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import mbarrier, tma

from . import KernelSpec, problems
from . import gluon_blackwell as gbw
from . import gluon_device as gdev
from . import gluon_host as gh
from . import gluon_matmul as gmm
from . import gluon_split_k as sk  # noqa: F401 (its launch runs it, through gluon_matmul: in the version)
from .gluon_blackwell import (
    WORKER_REGS,
    free_stage,
    likeliest_first,
    mma_partition,
    pipeline_rings,
    ring_slot,
    split_k_range,
    store_acc_masked,
    tma_store_epilogue,
)
from .spaces.blackwell import SPACES

OP, BACKEND, KERNEL, problem, inputs, reference, flops = problems.backend_names("matmul", "blackwell")


# ---- device code ---------------------------------------------------------------------------


@gluon.jit
def _load_partition(
    a_desc,
    b_desc,
    a_bufs,
    b_bufs,
    ready,
    empty,
    num_work,
    tiles,
    num_pid_n,
    total_k,
    k_per_split,
    group_m,
    A_TRANS: gl.constexpr,
    B_TRANS: gl.constexpr,
):
    """TMA tiles of each work item's K range (the whole of K without split-K)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[1] if A_TRANS else a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[0] if A_TRANS else a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0] if B_TRANS else b_desc.block_type.shape[1]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    num_pid_m = tiles // num_pid_n
    use = 0
    for work_id in range(gl.program_id(0), num_work, gl.num_programs(0)):
        _, k_start, k_count = split_k_range(work_id, tiles, total_k, k_per_split)
        pid_m, pid_n = gdev.grouped_tile(work_id % tiles, num_pid_m, num_pid_n, group_m)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        for ki in range(k_count):
            slot, bar = free_stage(use, empty, ready, nbytes)
            off_k = (k_start + ki) * BLOCK_K
            if A_TRANS:
                tma.async_load(a_desc, [off_k, off_m], bar, a_bufs.index(slot))
            else:
                tma.async_load(a_desc, [off_m, off_k], bar, a_bufs.index(slot))
            if B_TRANS:
                tma.async_load(b_desc, [off_n, off_k], bar, b_bufs.index(slot))
            else:
                tma.async_load(b_desc, [off_k, off_n], bar, b_bufs.index(slot))
            use += 1


@gluon.jit
def _register_epilogue(acc_tmem, acc_ready, acc_empty, out, walk, SPLIT: gl.constexpr, SWAP: gl.constexpr):
    """The epilogue of the split and swapped binaries, from registers (out, walk: _epilogue's).
    SPLIT: each work item's fp32 partial into ws[split, rows of c, LDW], and the tile's last
    split to arrive sums them into c (gluon_matmul.finish_split_tile). SWAP: the tile is c^T's
    ([BLOCK_M over c's columns, BLOCK_N over its rows], BLOCK_N 32 at most: it is loaded whole)
    and goes out transposed."""
    ws_ptr, c_ptr, cnt_ptr, M, N, LDW, SPLITS = out
    num_work, tiles, _, num_pid_n, group_m = walk
    BLOCK_M: gl.constexpr = acc_tmem.shape[1]
    BLOCK_N: gl.constexpr = acc_tmem.shape[2]
    NUM_ACC: gl.constexpr = acc_tmem.shape[0]
    num_pid_m = tiles // num_pid_n
    acc_use = 0
    for work_id in range(gl.program_id(0), num_work, gl.num_programs(0)):
        tile = work_id % tiles
        pid_m, pid_n = gdev.grouped_tile(tile, num_pid_m, num_pid_n, group_m)
        om = pid_m * BLOCK_M
        on = pid_n * BLOCK_N
        acc_slot, acc_phase = ring_slot(acc_use, NUM_ACC)
        mbarrier.wait(acc_ready.index(acc_slot), acc_phase)
        acc = acc_tmem.index(acc_slot)
        if SWAP:
            layout: gl.constexpr = acc.get_reg_layout()
            part = acc.load(layout)
            mbarrier.arrive(acc_empty.index(acc_slot))
            rows = gl.arange(0, BLOCK_M, gl.SliceLayout(1, layout))
            cols = gl.arange(0, BLOCK_N, gl.SliceLayout(0, layout))
            mask = (rows[:, None] < M - om) & (cols[None, :] < N - on)
            offs = cols[None, :] * LDW + rows[:, None]
            corner = on.to(gl.int64) * LDW + om
            c_rows = N
            if SPLIT:
                split_stride = c_rows.to(gl.int64) * LDW
                gl.store(ws_ptr + corner + (work_id // tiles) * split_stride + offs, part, mask=mask)
                gmm.finish_split_tile(
                    ws_ptr + corner,
                    c_ptr + corner,
                    cnt_ptr + tile,
                    N - on,
                    M - om,
                    LDW,
                    split_stride,
                    SPLITS,
                    BLOCK_N,
                    BLOCK_M,
                )
            else:
                gl.store(c_ptr + corner + offs, part.to(c_ptr.dtype.element_ty), mask=mask)
        else:
            split_stride = M.to(gl.int64) * LDW
            base = ws_ptr + (work_id // tiles).to(gl.int64) * split_stride
            store_acc_masked(acc, acc_empty.index(acc_slot), base, om, M, LDW, on, N)
            corner = om.to(gl.int64) * LDW + on
            gmm.finish_split_tile(
                ws_ptr + corner,
                c_ptr + corner,
                cnt_ptr + tile,
                M - om,
                N - on,
                LDW,
                split_stride,
                SPLITS,
                BLOCK_M,
                BLOCK_N,
            )
        acc_use += 1


@gluon.jit
def _epilogue(c_desc, c_smem, acc_tmem, acc_ready, acc_empty, out, walk, SPLIT: gl.constexpr, SWAP: gl.constexpr):
    """The binary's epilogue: from registers (split, swapped), else the TMA store. out: what the
    register epilogue writes (ws_ptr, c_ptr, cnt_ptr, M, N, LDW, SPLITS); walk: (work items,
    tiles, tile rows, tile columns, group_m)."""
    if SPLIT or SWAP:
        _register_epilogue(acc_tmem, acc_ready, acc_empty, out, walk, SPLIT, SWAP)
    else:
        _, _, num_pid_m, num_pid_n, group_m = walk
        tma_store_epilogue(c_desc, c_smem, acc_tmem, acc_ready, acc_empty, num_pid_m, num_pid_n, group_m)


@gluon.jit(do_not_specialize=["M", "N", "K", "group_m", "SPLITS", "K_PER", "LDW"])
def matmul_kernel(
    a_desc,
    b_desc,
    c_desc,
    ws_ptr,
    c_ptr,
    cnt_ptr,
    M,
    N,
    K,
    group_m,
    SPLITS,
    K_PER,
    LDW,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    NUM_BUFFERS: gl.constexpr,
    NUM_ACC: gl.constexpr,
    A_TRANS: gl.constexpr,
    B_TRANS: gl.constexpr,
    SPLIT: gl.constexpr,
    SWAP: gl.constexpr,
):
    """a_desc tiles a [M, K] ([K, M] storage when A_TRANS), b_desc b [K, N] ([N, K] when
    B_TRANS). SWAP: the kernel computes c^T = b^T a^T (the host passes b^T as a, a^T as b and
    swaps M and N) and c_ptr [N, LDW] receives each tile transposed. Else, SPLIT False: c_desc
    receives c [M, N] in [BLOCK_M, epilogue slice] blocks (SPLITS, K_PER, LDW, ws_ptr, c_ptr
    and cnt_ptr unused). SPLIT True: ws_ptr [SPLITS, M, LDW]
    fp32 receives the partials, K_PER k-steps per split, cnt_ptr holds a zeroed int32 counter
    per tile (left zeroed), and the last split of a tile to arrive writes c_ptr [M, LDW]."""
    rings = pipeline_rings(a_desc, b_desc, NUM_BUFFERS, NUM_ACC, BLOCK_M, BLOCK_N)
    a_bufs, b_bufs, ready, empty, acc_ready, acc_empty, acc_tmem = rings
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    tiles = num_pid_m * num_pid_n
    total_k = gl.cdiv(K, BLOCK_K)
    if SPLIT:
        num_work = tiles * SPLITS
        k_per_split = K_PER
    else:
        num_work = tiles
        k_per_split = total_k
    if SPLIT or SWAP:
        c_smem = a_bufs  # unused: the split and swapped binaries store from registers
    else:
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    out = (ws_ptr, c_ptr, cnt_ptr, M, N, LDW, SPLITS)
    walk = (num_work, tiles, num_pid_m, num_pid_n, group_m)
    # the partitions' argument lists written out: a tuple kept in a variable would carry A_TRANS
    # and B_TRANS as values, not constexprs
    # fmt: off
    gl.warp_specialize(
        [
            (_epilogue, (c_desc, c_smem, acc_tmem, acc_ready, acc_empty, out, walk, SPLIT, SWAP)),
            (mma_partition, (rings, num_work, tiles, total_k, k_per_split, A_TRANS, B_TRANS)),
            (_load_partition, (
                a_desc, b_desc, a_bufs, b_bufs, ready, empty, num_work, tiles, num_pid_n, total_k, k_per_split,
                group_m, A_TRANS, B_TRANS,
            )),
        ],
        [1, 1],
        [WORKER_REGS, WORKER_REGS],
    )
    # fmt: on
    gdev.invalidate_rings(ready, empty, acc_ready, acc_empty)


JIT_FUNCTIONS = (matmul_kernel,)


# ---- configs ---------------------------------------------------------------------------------


def supports(p: dict, device) -> bool:
    return gbw.on_blackwell(device) and p.get("dtype") in gh.MMA_DTYPES


def config_space(p: dict, device) -> list[dict]:
    return gbw.space_worth_trying(SPACES[OP], p, device, worth_trying)


def worth_trying(c: dict, p: dict, sms: int) -> bool:
    """The performance rule (config_space() applies it): no tile far larger than the matrix
    (it would compute mostly padding), and the split counts of gluon_host's matmul rule. Whether
    it fits the device is resources_ok()'s question."""
    if not gmm.matmul_swap_worth_trying(c, p):
        return False
    c, p = gmm.matmul_as_launched(c, p)
    return (
        c["BLOCK_M"] <= max(64, gh.pow2_at_least(p["M"]))
        and c["BLOCK_N"] <= max(64, gh.pow2_at_least(p["N"]))
        and c["BLOCK_K"] <= max(64, gh.pow2_at_least(p["K"]))
        and gmm.matmul_split_worth_trying(c, p, sms)
    )


def smem_bytes(c: dict, p: dict) -> int:
    """gluon_blackwell.smem_bytes, c as launched: a split or swapped binary stores from registers."""
    return gbw.smem_bytes(c, p, staged=not (c["SPLIT_K"] >= 2 or c.get("SWAP_AB")))


def resources_ok(c: dict, p: dict) -> bool:
    """gluon_blackwell.fits, of the binary c launches."""
    k, _ = gmm.matmul_as_launched(c, p)
    return gbw.fits(k, smem_bytes(k, p))


def prune(configs: list[dict], p: dict, device) -> list[dict]:
    """Configs that fit the device, the likeliest winners first (gluon_blackwell.likeliest_first)."""
    return likeliest_first([c for c in configs if resources_ok(c, p)])


def default_config(p: dict, device) -> dict:
    sms = gh.sm_count_of(device)
    c = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "NUM_BUFFERS": 4, "NUM_ACC": 2, "GROUP_M": 8, "num_warps": 4}
    if triton.cdiv(p["M"], 128) * triton.cdiv(p["N"], 256) < sms:
        # too few big tiles to fill the SMs: smaller tiles, deeper ring
        c.update(BLOCK_N=128, NUM_BUFFERS=5)
        if triton.cdiv(p["M"], 128) * triton.cdiv(p["N"], 128) < sms // 2:
            c.update(BLOCK_M=64, NUM_BUFFERS=6)
    c["SPLIT_K"] = 0  # the work model's split count where the tiles leave SMs idle
    c["SWAP_AB"] = 0  # swapped decode GEMMs won on an H100 (the Hopper default); unmeasured here
    if not worth_trying(c, p, sms):
        c["SPLIT_K"] = 1
    space = config_space(p, device)
    c = {k: c[k] for k in SPACES[OP].params}  # the space's order
    if c not in space or not resources_ok(c, p):
        fitting = prune(space, p, device)
        c = max(fitting, key=lambda x: (x["BLOCK_M"] * x["BLOCK_N"], x["BLOCK_K"], x["NUM_BUFFERS"], -x["SPLIT_K"]))
    return c


# ---- host side ---------------------------------------------------------------------------------


def _block_shapes(c: dict, trans_a: bool, trans_b: bool):
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    return ([bk, bm] if trans_a else [bm, bk]), ([bn, bk] if trans_b else [bk, bn]), [bm, gbw.epilogue_n(c)]


def _constexprs(c: dict, trans_a: bool, trans_b: bool, split: bool) -> dict:
    return {
        "BLOCK_M": c["BLOCK_M"],
        "BLOCK_N": c["BLOCK_N"],
        "BLOCK_K": c["BLOCK_K"],
        "NUM_BUFFERS": c["NUM_BUFFERS"],
        "NUM_ACC": c["NUM_ACC"],
        "A_TRANS": trans_a,
        "B_TRANS": trans_b,
        "SPLIT": split,
        "SWAP": bool(c.get("SWAP_AB")),
    }


def launch(config: dict, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    run = gmm.matmul_launch(config, a, b, _block_shapes, _constexprs)
    matmul_kernel[run.grid](*run.args(), num_warps=config["num_warps"], **run.constexprs)
    return run.result()


_INTS = ("M", "N", "K", "group_m", "SPLITS", "K_PER", "LDW")  # matmul_kernel's integer parameters, in order


def compile_specs(p: dict, config: dict, device) -> list[KernelSpec]:
    return gmm.matmul_compile_specs(matmul_kernel, p, config, device, _block_shapes, _constexprs, _INTS)
