"""Blackwell (sm_100a) conv2d weight gradient in Gluon: split-K GEMM on TMA im2col and tcgen05.

grad_w[Co, R*S*Ci] = grad_out^T[Co, N*P*Q] @ im2col(x)[N*P*Q, R*S*Ci], NHWC, fp16 or bf16.

An output tile is BLOCK_M output channels x BLOCK_N input channels of one filter tap (r, s);
its reduction runs over the N*P*Q output pixels, BLOCK_K at a time. The reduction is split
SPLIT_K ways so that few output tiles (small filters, few channels) still fill the GPU; each
split writes an fp32 partial into a workspace and a second kernel (gluon_host.split_k_reduce,
shared with the Hopper backend) sums them in split order: deterministic, the same bits on
every run, unlike atomics. With one active split the kernel writes grad_w directly.

Persistent and warp-specialized (building blocks in gluon_blackwell):
  load partition (1 warp)   grad_out rows by tiled TMA ([pixels, Co] blocks, K-outer) and x by
                            TMA im2col at tap (r, s) ([pixels, channels] blocks, already the
                            [K, N] B operand);
  MMA partition (1 warp)    tcgen05 MMAs into a double-buffered fp32 accumulator in tensor
                            memory, the grad_out tile fed through a permuted view (M-major A);
  epilogue (num_warps)      tensor memory -> registers -> masked stores of the tile's rows and
                            of the tap's real channels only (a channel block that overhangs
                            Ci must not write into the next tap's columns).
Work items are numbered split-major, so the CTAs running together read the same pixel slab
of grad_out and x, which stays in L2.

SPLIT_K is a runtime argument (the launch passes the K-iterations per split): configs that
differ only in it share one compiled kernel, as long as they agree on whether the kernel
writes the fp32 workspace (several splits) or grad_w itself (one).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (
    TensorMemoryLayout,
    allocate_tensor_memory,
    mbarrier,
    tma,
)

from . import KernelSpec, problems
from . import gluon_host as gh
from .geometry import is_pointwise
from .gluon_blackwell import (
    TMEM_COLUMNS,
    WORKER_REGS,
    init_ring,
    invalidate_ring,
    mma_partition,
    ring_slot,
    split_k_range,
    store_acc_masked,
)
from .spaces.blackwell import SPACES

OP, BACKEND = "conv2d_wgrad", "blackwell"
KERNEL = f"{OP}.{BACKEND}"

problem = problems.conv2d_wgrad_problem
inputs = problems.conv2d_wgrad_inputs
reference = problems.conv2d_wgrad_reference
flops = problems.conv2d_flops

_DTYPES = ("float16", "bfloat16")


# ---- device code ---------------------------------------------------------------------------


@gluon.jit
def _tile_coords(tile, co_blocks, ci_blocks):
    """Output tile -> (Co block, channel block, filter tap); Co blocks vary fastest, so
    neighbouring CTAs share the same im2col columns."""
    pid_co = tile % co_blocks
    rest = tile // co_blocks
    return pid_co, rest % ci_blocks, rest // ci_blocks


@gluon.jit
def _load_partition(
    g_desc,
    x_desc,
    a_bufs,
    b_bufs,
    ready,
    empty,
    num_work,
    tiles_per_split,
    total_k,
    k_per_split,
    co_blocks,
    ci_blocks,
    S,
    PQ,
    Q,
    stride_h,
    stride_w,
    pad_h,
    pad_w,
    IM2COL: gl.constexpr,
):
    NUM_BUFFERS: gl.constexpr = a_bufs.shape[0]
    BLOCK_K: gl.constexpr = g_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = g_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = x_desc.block_type.shape[1]
    nbytes: gl.constexpr = g_desc.block_type.nbytes + x_desc.block_type.nbytes
    use = 0
    for work_id in range(gl.program_id(0), num_work, gl.num_programs(0)):
        _, k_start, k_count = split_k_range(work_id, tiles_per_split, total_k, k_per_split)
        pid_co, cb, rs = _tile_coords(work_id % tiles_per_split, co_blocks, ci_blocks)
        r = (rs // S).to(gl.int16)
        s = (rs % S).to(gl.int16)
        off_co = pid_co * BLOCK_M
        c0 = cb * BLOCK_N
        for ki in range(k_count):
            # BLOCK_K output pixels from pixel m on (TMA wraps rows and images by itself)
            m = (k_start + ki) * BLOCK_K
            slot, phase = ring_slot(use, NUM_BUFFERS)
            mbarrier.wait(empty.index(slot), phase ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, nbytes)
            tma.async_load(g_desc, [m, off_co], bar, a_bufs.index(slot))
            if IM2COL:
                n = m // PQ
                pq = m % PQ
                h = (pq // Q) * stride_h - pad_h
                w = (pq % Q) * stride_w - pad_w
                tma.async_load_im2col(x_desc, [n, h, w, c0], [r, s], bar, b_bufs.index(slot))
            else:  # 1x1, stride 1, no padding: im2col(x) is x as [N*H*W, Ci]
                tma.async_load(x_desc, [m, c0], bar, b_bufs.index(slot))
            use += 1


@gluon.jit
def _epilogue_partition(
    out_ptr, acc_tmem, acc_ready, acc_empty, num_work, tiles_per_split, co_blocks, ci_blocks, Co, Ci, RS
):
    """Masked stores of each tile into out[split, Co, RS * Ci] (split 0 only: grad_w itself)."""
    NUM_ACC: gl.constexpr = acc_tmem.shape[0]
    BLOCK_M: gl.constexpr = acc_tmem.shape[1]
    BLOCK_N: gl.constexpr = acc_tmem.shape[2]
    row_stride = RS * Ci
    acc_use = 0
    for work_id in range(gl.program_id(0), num_work, gl.num_programs(0)):
        split = work_id // tiles_per_split
        pid_co, cb, rs = _tile_coords(work_id % tiles_per_split, co_blocks, ci_blocks)
        base = out_ptr + split.to(gl.int64) * Co * row_stride + rs * Ci
        acc_slot, acc_phase = ring_slot(acc_use, NUM_ACC)
        mbarrier.wait(acc_ready.index(acc_slot), acc_phase)
        # only the tap's real channels: a channel block that overhangs Ci must not write into
        # the next tap's columns
        store_acc_masked(
            acc_tmem.index(acc_slot),
            acc_empty.index(acc_slot),
            base,
            pid_co * BLOCK_M,
            Co,
            row_stride,
            cb * BLOCK_N,
            Ci,
        )
        acc_use += 1


# the kernel's shape arguments: unspecialized i32, so one compile per config serves every shape
_SHAPE_ARGS = (
    "Co",
    "Ci",
    "RS",
    "S",
    "PQ",
    "Q",
    "stride_h",
    "stride_w",
    "pad_h",
    "pad_w",
    "total_k",
    "k_per_split",
    "num_splits",
)


@gluon.jit(do_not_specialize=list(_SHAPE_ARGS))
def conv2d_wgrad_kernel(
    g_desc,
    x_desc,
    out_ptr,
    Co,
    Ci,
    RS,
    S,
    PQ,
    Q,
    stride_h,
    stride_w,
    pad_h,
    pad_w,
    total_k,
    k_per_split,
    num_splits,
    NUM_BUFFERS: gl.constexpr,
    NUM_ACC: gl.constexpr,
    IM2COL: gl.constexpr,
):
    """g_desc: tiles of grad_out as [N*P*Q, Co] ([BLOCK_K, BLOCK_M] blocks); x_desc: im2col over
    x [N, H, W, Ci] (or tiles of x as [N*H*W, Ci]) in [BLOCK_K, BLOCK_N] blocks; out_ptr: grad_w
    [Co, R*S*Ci] (one split) or the fp32 workspace [num_splits, Co, R*S*Ci]. The reduction
    is total_k = cdiv(N*P*Q, BLOCK_K) iterations, k_per_split of them per split."""
    BLOCK_K: gl.constexpr = g_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = g_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = x_desc.block_type.shape[1]
    dtype: gl.constexpr = g_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_K, BLOCK_M], g_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_K, BLOCK_N], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    acc_ready = gl.allocate_shared_memory(gl.int64, [NUM_ACC, 1], mbarrier.MBarrierLayout())
    acc_empty = gl.allocate_shared_memory(gl.int64, [NUM_ACC, 1], mbarrier.MBarrierLayout())
    init_ring(ready)
    init_ring(empty)
    init_ring(acc_ready)
    init_ring(acc_empty)
    tmem_layout: gl.constexpr = TensorMemoryLayout(block=(BLOCK_M, BLOCK_N), col_stride=1)
    acc_tmem = allocate_tensor_memory(gl.float32, [NUM_ACC, BLOCK_M, BLOCK_N], tmem_layout)

    co_blocks = gl.cdiv(Co, BLOCK_M)
    ci_blocks = gl.cdiv(Ci, BLOCK_N)
    tiles_per_split = co_blocks * ci_blocks * RS
    num_work = tiles_per_split * num_splits
    gl.warp_specialize(
        [
            (
                _epilogue_partition,
                (out_ptr, acc_tmem, acc_ready, acc_empty, num_work, tiles_per_split, co_blocks, ci_blocks, Co, Ci, RS),
            ),
            (
                mma_partition,
                (
                    a_bufs,
                    b_bufs,
                    ready,
                    empty,
                    acc_tmem,
                    acc_ready,
                    acc_empty,
                    num_work,
                    tiles_per_split,
                    total_k,
                    k_per_split,
                    True,
                    False,
                ),
            ),
            (
                _load_partition,
                (
                    g_desc,
                    x_desc,
                    a_bufs,
                    b_bufs,
                    ready,
                    empty,
                    num_work,
                    tiles_per_split,
                    total_k,
                    k_per_split,
                    co_blocks,
                    ci_blocks,
                    S,
                    PQ,
                    Q,
                    stride_h,
                    stride_w,
                    pad_h,
                    pad_w,
                    IM2COL,
                ),
            ),
        ],
        [1, 1],
        [WORKER_REGS, WORKER_REGS],
    )

    invalidate_ring(ready)
    invalidate_ring(empty)
    invalidate_ring(acc_ready)
    invalidate_ring(acc_empty)


JIT_FUNCTIONS = (conv2d_wgrad_kernel,)


# ---- configs ---------------------------------------------------------------------------------


def supports(p: dict, device) -> bool:
    cap = getattr(device, "capability", None)
    return cap is not None and cap[0] == 10 and p.get("dtype") in _DTYPES and gh.conv_geometry_ok(p)


def splits_of(p: dict, c: dict, sms: int) -> tuple[int, int]:
    """(active splits, K iterations per split) of config c on problem p on `sms` SMs: SPLIT_K,
    or for 0 the count gluon_host's work model finds fastest (the Hopper wgrad's model)."""
    k_steps = triton.cdiv(p["N"] * p["P"] * p["Q"], c["BLOCK_K"])
    out_elems = p["Co"] * p["R"] * p["S"] * gh.padded_channels(p["Ci"], p["dtype"])
    want = c["SPLIT_K"] or gh.auto_splits(output_tiles(p, c), k_steps, sms, out_elems, c)
    return gh.split_k_plan(k_steps, want)


def output_tiles(p: dict, c: dict) -> int:
    ci = gh.padded_channels(p["Ci"], p["dtype"])
    return triton.cdiv(p["Co"], c["BLOCK_M"]) * p["R"] * p["S"] * triton.cdiv(ci, c["BLOCK_N"])


def config_space(p: dict, device) -> list[dict]:
    """The space less configs that cannot help on this problem (worth_trying). Resource limits
    are left to prune(), which must agree with the compiler."""
    sms = gh.sm_count_of(device)
    return [c for c in SPACES[OP] if worth_trying(c, p, sms)]


def worth_trying(c: dict, p: dict, sms: int) -> bool:
    """The performance rule (config_space() applies it): no channel block wider than the tap's
    channels, no Co block beyond Co; SPLIT_K=0 only where the work model splits (else the same
    launch as 1); no explicit count that launches as fewer splits (more splits than the
    reduction has iterations) or as the model's own; and no splitting further once the output
    tiles alone fill every SM twice (only adds reduction traffic). Whether it fits the device
    is resources_ok()'s question."""
    ci = gh.padded_channels(p["Ci"], p["dtype"])
    if c["BLOCK_N"] > max(64, gh.pow2_at_least(ci)) or c["BLOCK_M"] > max(64, gh.pow2_at_least(p["Co"])):
        return False
    if c["SPLIT_K"] == 1:
        return True
    model, _ = splits_of(p, dict(c, SPLIT_K=0), sms)
    if c["SPLIT_K"] == 0:
        return model > 1
    active, _ = splits_of(p, c, sms)
    if active < c["SPLIT_K"] or active == model:
        return False
    return output_tiles(p, c) * c["SPLIT_K"] // 2 < 2 * sms


# bytes the compiler adds beyond the buffers (tensor-memory base address, alignment),
# measured over the whole space with `tunecache compile --all`
_SMEM_OVERHEAD = 256


def smem_bytes(c: dict, p: dict) -> int:
    """Operand ring + barriers (+ the compiler's few bytes); the epilogue stores from registers."""
    item = gh.ITEMSIZE[p["dtype"]]
    ring = c["NUM_BUFFERS"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * item
    return ring + 8 * (2 * c["NUM_BUFFERS"] + 2 * c["NUM_ACC"]) + _SMEM_OVERHEAD


def tmem_columns(c: dict) -> int:
    return c["NUM_ACC"] * c["BLOCK_N"]


def resources_ok(c: dict, p: dict) -> bool:
    """The resource rule (prune() applies it; it must agree with the compiler): shared and
    tensor memory."""
    return smem_bytes(c, p) <= gh.SMEM_LIMIT_BYTES and tmem_columns(c) <= TMEM_COLUMNS


def prune(configs: list[dict], p: dict, device) -> list[dict]:
    return [c for c in configs if resources_ok(c, p)]


def default_config(p: dict, device) -> dict:
    """128 x 128 tiles, 4 stages, and the work model's split count (SPLIT_K=0) where it splits."""
    sms = gh.sm_count_of(device)
    c = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "NUM_BUFFERS": 4, "NUM_ACC": 2, "SPLIT_K": 0, "num_warps": 4}
    if not worth_trying(c, p, sms):
        c["SPLIT_K"] = 1
    space = config_space(p, device)
    if c not in space or not resources_ok(c, p):
        fitting = prune(space, p, device)
        c = max(fitting, key=lambda x: (x["BLOCK_M"] * x["BLOCK_N"], x["NUM_BUFFERS"], x["SPLIT_K"] in (0, 1)))
    return c


# ---- host side ---------------------------------------------------------------------------------


def _constexprs(c: dict, im2col: bool) -> dict:
    return {"NUM_BUFFERS": c["NUM_BUFFERS"], "NUM_ACC": c["NUM_ACC"], "IM2COL": im2col}


def launch(config: dict, x: torch.Tensor, grad_out: torch.Tensor, R: int, S: int, stride=1, padding=0) -> torch.Tensor:
    (sh, sw) = problems.pair(stride, "stride", minimum=1)
    (ph, pw) = problems.pair(padding, "padding", minimum=0)
    N, H, W, Ci0 = x.shape
    _, P, Q, Co = grad_out.shape
    xp, gp = gh.pad_channels(x), gh.pad_channels(grad_out)
    Ci = xp.shape[-1]
    npq = N * P * Q
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    total_k = triton.cdiv(npq, bk)
    sms = gh.num_sms(x.device)
    shape = {"N": N, "P": P, "Q": Q, "Co": Co, "R": R, "S": S, "Ci": Ci, "dtype": problems.dtype_name(x.dtype)}
    active, per = splits_of(shape, config, sms)
    out = torch.empty((Co, R, S, Ci), device=x.device, dtype=x.dtype)
    target = out if active == 1 else gh.split_k_workspace(active, Co, R * S * Ci, x.device)
    g_desc = gh.tiled_desc(gp.view(npq, gp.shape[-1]), [bk, bm])
    im2col = (R, S, sh, sw, ph, pw) != (1, 1, 1, 1, 0, 0)
    if im2col:
        x_desc = gh.im2col_desc(xp, [bk, bn], stride=(sh, sw), padding=(ph, pw), out_hw=(P, Q))
    else:
        x_desc = gh.tiled_desc(xp.view(npq, Ci), [bk, bn])
    tiles = triton.cdiv(Co, bm) * R * S * triton.cdiv(Ci, bn)
    grid = gh.persistent_grid(tiles * active, sms)
    conv2d_wgrad_kernel[grid](
        g_desc,
        x_desc,
        target,
        Co,
        Ci,
        R * S,
        S,
        P * Q,
        Q,
        sh,
        sw,
        ph,
        pw,
        total_k,
        per,
        active,
        num_warps=config["num_warps"],
        **_constexprs(config, im2col),
    )
    if active > 1:
        gh.split_k_reduce(target, out)
    return out if Ci == Ci0 else out[..., :Ci0].contiguous()


def compile_specs(p: dict, config: dict, device) -> list[KernelSpec]:
    dt = p["dtype"]
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    active, _ = splits_of(p, config, gh.sm_count_of(device))
    im2col = not is_pointwise(p)
    ce = _constexprs(config, im2col)
    sig = {
        "g_desc": gh.desc_sig(dt, [bk, bm]),
        "x_desc": gh.im2col_desc_sig(dt, [bk, bn]) if im2col else gh.desc_sig(dt, [bk, bn]),
        "out_ptr": "*fp32" if active > 1 else gh.ptr_sig(dt),
    }
    sig.update({k: "i32" for k in _SHAPE_ARGS})
    sig.update({k: "constexpr" for k in ce})
    specs = [
        KernelSpec(
            fn=conv2d_wgrad_kernel,
            signature=sig,
            constexprs=ce,
            num_warps=config["num_warps"],
            name="conv2d_wgrad_kernel",
        )
    ]
    if active > 1:
        specs.append(gh.split_k_reduce_spec(dt))
    return specs
