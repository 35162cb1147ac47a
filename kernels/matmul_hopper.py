"""Hopper (sm_90a) matmul in Gluon: persistent, TMA-fed, multi-stage, async WGMMA.

c[M, N] = a[M, K] @ b[K, N], fp16 or bf16 in and out, fp32 accumulation, any M, N, K and
either operand row-major or transposed.

Each CTA walks its tiles (grouped order, stride = grid size) as one flat sequence of
k-steps. A ring of `num_stages` shared-memory slots runs `num_stages - 1` TMA loads ahead of
the WGMMA, and the loads run straight across tile boundaries: while a tile's epilogue converts
the accumulator and hands it to an async TMA store, the next tile's first k-steps are already
in flight. One WGMMA stays outstanding behind the one being issued, so the tensor cores never
wait for the issuing warps.

Split-K (SPLIT_K in the space): when the output tiles cannot fill the SMs (decode and
small-batch GEMMs: M = 1 x N = 4096 is 32 tiles of 64x128 on 132 SMs), each tile's K is cut
into `splits` runs of `per` k-steps; a CTA's units are (tile, split) pairs, each writes an fp32
partial, and the tile's last split to arrive sums them in split order into c
(gluon_matmul.finish_split_tile: one launch, deterministic). A split launch runs its own binary
(SPLIT): the unsplit one is the kernel without split-K, which a runtime branch in every tile's
epilogue slowed by up to 2.5% on large GEMMs (H100).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import KernelSpec, problems
from . import gluon_device as gdev
from . import gluon_hopper as ghop
from . import gluon_host as gh
from . import gluon_launch as direct
from . import gluon_matmul as gmm
from . import gluon_split_k as sk
from .gluon_hopper import wgmma_acc_layout
from .spaces.hopper import SPACES

OP, BACKEND, KERNEL, problem, inputs, reference, flops = problems.backend_names("matmul", "hopper")


# ---- device code -------------------------------------------------------------------------------


@gluon.jit
def _issue_load(
    step,
    total,
    off_m,
    off_n,
    k,
    a_desc,
    b_desc,
    a_bufs,
    b_bufs,
    ready,
    TRANS_A: gl.constexpr,
    TRANS_B: gl.constexpr,
    STAGES: gl.constexpr,
):
    """TMA-load the operands of flat k-step `step` of this CTA into ring slot step % STAGES."""
    pred = step < total
    slot = step % STAGES
    bar = ready.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred)
    if TRANS_A:
        tma.async_load(a_desc, [k, off_m], bar, a_bufs.index(slot), pred)
    else:
        tma.async_load(a_desc, [off_m, k], bar, a_bufs.index(slot), pred)
    if TRANS_B:
        tma.async_load(b_desc, [off_n, k], bar, b_bufs.index(slot), pred)
    else:
        tma.async_load(b_desc, [k, off_n], bar, b_bufs.index(slot), pred)


@gluon.jit
def _unit(
    u, SPLITS, K_PER, num_pid_m, num_pid_n, GROUP_M, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SPLIT: gl.constexpr
):
    """Work unit u -> (first row, first column, first k-step) of its tile and split."""
    if SPLIT:
        pid_m, pid_n = gdev.grouped_tile(u // SPLITS, num_pid_m, num_pid_n, GROUP_M)
        k0 = (u % SPLITS) * K_PER
    else:
        pid_m, pid_n = gdev.grouped_tile(u, num_pid_m, num_pid_n, GROUP_M)
        k0 = 0
    return pid_m * BLOCK_M, pid_n * BLOCK_N, k0


@gluon.jit(do_not_specialize=["M", "N", "K", "GROUP_M", "SPLITS", "K_PER", "LDW"])
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
    GROUP_M,
    SPLITS,
    K_PER,
    LDW,
    TRANS_A: gl.constexpr,
    TRANS_B: gl.constexpr,
    SPLIT: gl.constexpr,
    SWAP: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """a_desc tiles a [M, K] ([K, M] when TRANS_A), b_desc b [K, N] ([N, K] when TRANS_B).
    SWAP: the kernel computes c^T = b^T a^T (the host passes b^T as a, a^T as b and swaps M
    and N), and c_ptr [N, LDW] receives the transpose of each tile from registers (c_desc,
    then, only gives the tile's shape).
    SPLIT False: c_desc receives c (SPLITS, K_PER, LDW, ws_ptr, c_ptr and cnt_ptr unused: the
    unsplit binary is the kernel without split-K). SPLIT True: ws_ptr [SPLITS, M, LDW] fp32
    receives the partials, each split K_PER k-steps (the last one's past K read TMA's zeros),
    cnt_ptr holds a zeroed int32 counter per tile (left zeroed), and the last split to arrive
    writes c_ptr [M, LDW]; c_desc only gives the tile's shape."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[0] if TRANS_A else a_desc.block_type.shape[1]
    dtype: gl.constexpr = c_desc.dtype

    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    if SPLIT:
        my_units = gl.cdiv(num_pid_m * num_pid_n * SPLITS - pid, nprog)
        steps = K_PER
    else:
        my_units = gl.cdiv(num_pid_m * num_pid_n - pid, nprog)
        steps = gl.cdiv(K, BLOCK_K)
    total = my_units * steps

    acc_layout: gl.constexpr = wgmma_acc_layout(BLOCK_M, BLOCK_N, num_warps)
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)

    # the producer's position, STAGES - 1 k-steps ahead of the WGMMAs, carried across units
    # (tile, split); unit coordinates are recomputed once per unit, not per k-step
    pt = gl.to_tensor(0)
    pm, pn, ps = _unit(pid, SPLITS, K_PER, num_pid_m, num_pid_n, GROUP_M, BLOCK_M, BLOCK_N, SPLIT)
    pj = gl.to_tensor(0)
    for i in gl.static_range(STAGES - 1):
        _issue_load(
            i, total, pm, pn, (ps + pj) * BLOCK_K, a_desc, b_desc, a_bufs, b_bufs, ready, TRANS_A, TRANS_B, STAGES
        )
        pj += 1
        wrap = pj >= steps
        pj = gl.where(wrap, 0, pj)
        if wrap:
            pt += 1
            pm, pn, ps = _unit(pid + pt * nprog, SPLITS, K_PER, num_pid_m, num_pid_n, GROUP_M, BLOCK_M, BLOCK_N, SPLIT)

    step = 0
    for t in range(my_units):
        for kk in range(steps):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            a, b = gdev.stage_operands(a_bufs, b_bufs, slot, TRANS_A, TRANS_B)
            acc = warpgroup_mma(a, b, acc, use_acc=kk != 0, is_async=True)
            # the previous step's WGMMA has retired: its slot is free for the next load, which
            # runs on into the next tile's k-steps near the end of this one
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            _issue_load(
                step + STAGES - 1,
                total,
                pm,
                pn,
                (ps + pj) * BLOCK_K,
                a_desc,
                b_desc,
                a_bufs,
                b_bufs,
                ready,
                TRANS_A,
                TRANS_B,
                STAGES,
            )
            pj += 1
            wrap = pj >= steps
            pj = gl.where(wrap, 0, pj)
            if wrap:
                pt += 1
                pm, pn, ps = _unit(
                    pid + pt * nprog, SPLITS, K_PER, num_pid_m, num_pid_n, GROUP_M, BLOCK_M, BLOCK_N, SPLIT
                )
            step += 1
        # epilogue outside the k-loop: no WGMMA is in flight across a branch, so ptxas keeps
        # the accumulator in place instead of serializing the WGMMAs
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        om, on, ok = _unit(pid + t * nprog, SPLITS, K_PER, num_pid_m, num_pid_n, GROUP_M, BLOCK_M, BLOCK_N, SPLIT)
        if not SPLIT and not SWAP:
            out = acc.to(dtype)
            tma.store_wait(pendings=0)  # the previous tile's store has left c_smem
            c_smem.store(out)
            fence_async_shared()
            tma.async_store(c_desc, [om, on], c_smem)
        else:
            # stores from registers, in c's coordinates: the tile's [C_M, C_N] block of c at
            # (c_m0, c_n0) (transposed under SWAP), its element (i, j) at offs
            rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
            cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
            mask = (rows[:, None] < M - om) & (cols[None, :] < N - on)
            if SWAP:
                C_M: gl.constexpr = BLOCK_N
                C_N: gl.constexpr = BLOCK_M
                c_m0, c_n0, c_rows, c_cols = on, om, N, M
                offs = cols[None, :] * LDW + rows[:, None]
            else:
                C_M: gl.constexpr = BLOCK_M
                C_N: gl.constexpr = BLOCK_N
                c_m0, c_n0, c_rows, c_cols = om, on, M, N
                offs = rows[:, None] * LDW + cols[None, :]
            corner = c_m0.to(gl.int64) * LDW + c_n0
            if not SPLIT:
                gl.store(c_ptr + corner + offs, acc.to(dtype), mask=mask)
            else:
                split_stride = c_rows.to(gl.int64) * LDW
                ws_tile = ws_ptr + corner
                gl.store(ws_tile + (ok // K_PER) * split_stride + offs, acc, mask=mask)
                gmm.finish_split_tile(
                    ws_tile,
                    c_ptr + corner,
                    cnt_ptr + (pid + t * nprog) // SPLITS,
                    c_rows - c_m0,
                    c_cols - c_n0,
                    LDW,
                    split_stride,
                    SPLITS,
                    C_M,
                    C_N,
                )

    tma.store_wait(pendings=0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


JIT_FUNCTIONS = (matmul_kernel,)


# ---- configs -------------------------------------------------------------------------------------


def supports(p: dict, device) -> bool:
    return device.capability == (9, 0) and p.get("dtype") in gh.MMA_DTYPES


def config_space(p: dict, device) -> list[dict]:
    """The space, less configs that would run but cannot help on this problem (too-large
    tiles, narrow two-warpgroup tiles, splits of a GEMM whose tiles fill the GPU). Resource
    limits are left to prune(), which must agree with the compiler."""
    sms = gh.sm_count_of(device)
    return [c for c in SPACES[OP] if not resources_ok(c, p, sms) or worth_trying(c, p, sms)]


def resources_ok(c: dict, p: dict | None = None, sms: int | None = None) -> bool:
    """The resource rule (prune() applies it; it must agree with the compiler): shared memory
    and the accumulator's registers of the binary c launches on p (SPLIT_K 0 runs the split
    binary where the work model splits: gluon_matmul.split_binary)."""
    k, q = gmm.matmul_as_launched(c, p)
    split = q is not None and sms is not None and gmm.split_binary(k, gmm.matmul_splits(q, k, sms)[0])
    return ghop.wgmma_resources_ok(k, smem_bytes(k, split=split))


def smem_bytes(c: dict, itemsize: int = 2, split: bool = False) -> int:
    """The ring, the output tile TMA stores from (not in a split or swapped binary: they store
    from registers), the barriers; c as launched."""
    ring = c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * itemsize
    from_registers = split or c.get("SPLIT_K", 1) >= 2 or c.get("SWAP_AB")
    c_tile = 0 if from_registers else c["BLOCK_M"] * c["BLOCK_N"] * itemsize
    return ring + c_tile + 8 * c["num_stages"] + 1024


def worth_trying(c: dict, p: dict, sms: int) -> bool:
    """The performance rule (config_space() applies it): could this config win on this problem
    on `sms` SMs? Whether it fits the device is resources_ok()'s question."""
    if not gmm.matmul_swap_worth_trying(c, p):
        return False
    c, p = gmm.matmul_as_launched(c, p)
    # two warpgroups on a 64-row tile split N; below 128 columns each gets a sliver
    if c["num_warps"] == 8 and c["BLOCK_M"] == 64 and c["BLOCK_N"] < 128:
        return False
    # tiles far larger than the matrix compute mostly padding
    if c["BLOCK_M"] > max(64, gh.pow2_at_least(p["M"])) or c["BLOCK_N"] > max(64, gh.pow2_at_least(p["N"])):
        return False
    if c["BLOCK_K"] > max(32, gh.pow2_at_least(p["K"])):
        return False
    return gmm.matmul_split_worth_trying(c, p, sms)


def prune(configs: list[dict], p: dict, device) -> list[dict]:
    """Configs that fit the device, the likeliest winners first."""
    sms = gh.sm_count_of(device)
    return ghop.quick_first(OP, [c for c in configs if resources_ok(c, p, sms)], p, sms)


def default_config(p: dict, device) -> dict:
    sms = gh.sm_count_of(device)
    tiles_big = triton.cdiv(p["M"], 128) * triton.cdiv(p["N"], 256)
    if tiles_big >= sms:
        c = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
    elif triton.cdiv(p["M"], 128) * triton.cdiv(p["N"], 128) >= sms // 2:
        c = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}
    else:
        c = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 5}
    c["SWAP_AB"] = 0
    c["SPLIT_K"] = 0  # the work model's split count where the tiles leave SMs idle
    if p["M"] <= 16:
        # decode: swapped 64-row tiles over N, unsplit, a deep ring of 128-wide K steps won
        # every Llama-3 and MoE decode layer it was tuned on (H100, M = 1 and 16)
        c = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 6}
        c |= {"SWAP_AB": 1, "SPLIT_K": 1}
    if not worth_trying(c, p, sms):
        c["SPLIT_K"] = 1
    if not (resources_ok(c, p, sms) and worth_trying(c, p, sms)):
        fitting = prune(config_space(p, device), p, device)
        if fitting:
            c = max(fitting, key=lambda x: (x["BLOCK_M"] * x["BLOCK_N"], x["BLOCK_K"], x["num_stages"]))
    return {k: c[k] for k in SPACES[OP].params}  # the space's order


# ---- host side -----------------------------------------------------------------------------------


def _block_shapes(c: dict, trans_a: bool, trans_b: bool):
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    return ([bk, bm] if trans_a else [bm, bk]), ([bn, bk] if trans_b else [bk, bn]), [bm, bn]


def _constexprs(c: dict, trans_a: bool, trans_b: bool, split: bool) -> dict:
    return {
        "TRANS_A": trans_a,
        "TRANS_B": trans_b,
        "SPLIT": split,
        "SWAP": bool(c.get("SWAP_AB")),
        "STAGES": c["num_stages"],
        "num_warps": c["num_warps"],
    }


class _Plan:
    """One (config, a/b shapes and strides, dtype, device) launch, precomputed: see
    gluon_launch.DirectLauncher."""

    __slots__ = (
        "launcher",
        "maps",
        "grid0",
        "tail",
        "swap",
        "a_t",
        "b_t",
        "a_ok",
        "b_ok",
        "a_blk",
        "b_blk",
        "c_blk",
        "c_shape",
        "N",
        "n_pad",
        "ws_shape",
        "tiles",
        "idle",
    )

    def run(self, a: torch.Tensor, b: torch.Tensor, stream: int, out_shape: tuple | None = None):
        """c = a @ b, or None where the JIT path must launch it. Pointers go to the launcher as
        ints: a tensor costs it a data_ptr() call and a driver query each. `out_shape`: the
        output's shape where it is not (M, N) (a pointwise conv's NHWC, the same bytes; only
        where `reshapeable`); a and b then need only be tensors on the matmul operands' storage,
        and a call whose operand descriptors are not cached yet returns None."""
        x, y = (b, a) if self.swap else (a, b)
        pa, pb = x.data_ptr(), y.data_ptr()
        maps, ld = self.maps, self.launcher
        # a_ok/b_ok: the strides suit TMA, so only the base address can force tma_ready's copy
        am = maps.get((0, pa)) if self.a_ok and not pa & 15 else None
        bm = maps.get((1, pb)) if self.b_ok and not pb & 15 else None
        if am is None or bm is None:
            if out_shape is not None:
                return None
            av, bv = gmm.matmul_views(a, b, self.swap, self.a_t, self.b_t)
            if am is None:
                av = av if self.a_ok and not pa & 15 else gh.tma_ready(av)
                pa = av.data_ptr()
                am = maps.get((0, pa)) or maps.put((0, pa), ld.expand_desc(0, gh.tiled_desc(av, self.a_blk)))
            if bm is None:
                bv = bv if self.b_ok and not pb & 15 else gh.tma_ready(bv)
                pb = bv.data_ptr()
                bm = maps.get((1, pb)) or maps.put((1, pb), ld.expand_desc(1, gh.tiled_desc(bv, self.b_blk)))
        c = a.new_empty(self.c_shape if out_shape is None else out_shape)
        pc = c.data_ptr()
        if pc & 15:
            return None  # pointer arguments were specialized 16-byte aligned: the JIT path
        cm = maps.get((2, pc))
        if cm is None:
            cv = c if out_shape is None else c.view(self.c_shape)
            cm = maps.put((2, pc), ld.expand_desc(2, gh.tiled_desc(cv, self.c_blk)))
        if self.ws_shape is None:  # the unsplit binary reads neither the workspace nor the counters
            ld(self.grid0, stream, [*am, *bm, *cm, self.idle, pc, self.idle, *self.tail])
        else:
            ws = direct.stream_workspace(a, stream, self.ws_shape)
            cnt = sk.zeroed_counters(a.device, stream, self.tiles)
            ld(self.grid0, stream, [*am, *bm, *cm, ws.data_ptr(), pc, cnt.data_ptr(), *self.tail])
        return c if self.n_pad == self.N else c[:, : self.N].contiguous()

    @property
    def reshapeable(self) -> bool:
        """Whether run() can write an output of another shape (no padded columns to cut)."""
        return self.n_pad == self.N


_PLANS = direct.PlanCache()


def _plan_key(dev: int, config: dict, a: torch.Tensor, b: torch.Tensor) -> tuple:
    return (direct.config_key(config), a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, dev)


def plan_for(config: dict, *args):
    """(plan, device) of a call whose first launch made one, else None: gluon_launch.plan_for."""
    return direct.plan_for(_PLANS, _plan_key, config, args)


def launch(config: dict, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    key = None
    if direct.direct_launch_enabled():
        key, plan, _, stream = direct.look_up(_PLANS, _plan_key, config, (a, b))
        if plan is not None:
            c = plan.run(a, b, stream)
            if c is not None:
                return c
    return _launch_jit(config, a, b, key)


def _launch_jit(config: dict, a: torch.Tensor, b: torch.Tensor, key) -> torch.Tensor:
    run = gmm.matmul_launch(config, a, b, _block_shapes, _constexprs)
    compiled = matmul_kernel[run.grid](*run.args(), **run.constexprs)
    aligned = not (run.c.data_ptr() | run.ws.data_ptr()) & 15
    plan = direct.new_plan(
        _Plan, key if aligned else None, compiled, matmul_kernel, 6, run.scalars, run.constexprs, run.grid[0]
    )
    if plan is not None:
        plan.swap, plan.a_t, plan.b_t = run.swap, run.a_t, run.b_t
        plan.a_ok, plan.b_ok = run.a_src is run.a_view, run.b_src is run.b_view
        plan.a_blk, plan.b_blk, plan.c_blk = run.blocks
        plan.c_shape, plan.N, plan.n_pad = tuple(run.c.shape), run.N, run.n_pad
        plan.ws_shape, plan.tiles = (tuple(run.ws.shape) if run.split else None), run.tiles
        plan.idle = sk.no_split_workspace(a.device).data_ptr()  # held for the process: a fixed address
        # this launch's descriptors: the next call at these addresses (a pointwise conv's
        # launch through launcher.AsMatmul needs them cached) builds none
        owned = (plan.a_ok, plan.b_ok, True)  # not a copy tma_ready made for this call alone
        for slot, (t, desc, own) in enumerate(zip((run.a_src, run.b_src, run.c), run.descs, owned)):
            if own:
                plan.maps.put((slot, t.data_ptr()), plan.launcher.expand_desc(slot, desc))
        _PLANS.put(key, plan)
    return run.result()


_INTS = ("M", "N", "K", "GROUP_M", "SPLITS", "K_PER", "LDW")  # matmul_kernel's integer parameters, in order


def compile_specs(p: dict, config: dict, device) -> list[KernelSpec]:
    return gmm.matmul_compile_specs(matmul_kernel, p, config, device, _block_shapes, _constexprs, _INTS)
