"""Hopper (sm_90a) conv2d weight gradient in Gluon: split-K GEMM on TMA im2col and WGMMA.

grad_w[Co, R*S*Ci] = grad_out^T[Co, N*P*Q] @ im2col(x)[N*P*Q, R*S*Ci], NHWC, fp16 or bf16.

A tile is (BLOCK_M output channels) x (BLOCK_N input channels of one filter tap (r, s)); its
reduction runs over the N*P*Q output pixels, BLOCK_K at a time: grad_out rows by tiled TMA
(read as [pixels, Co] and fed to WGMMA transposed), x by TMA im2col at offset (r, s). The
reduction is split SPLIT_K ways so that small filters still fill the GPU; each split writes an
fp32 partial and a second kernel (gluon_host.split_k_reduce) sums them in a fixed order, so
the result is deterministic. With one active split the kernel writes grad_w directly.

The pipeline is matmul_hopper's: persistent CTAs, a `num_stages` ring of TMA loads running
ahead across tiles, one WGMMA in flight. Tiles are numbered split-major so the CTAs running
together share the same pixel range of grad_out and x in L2.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import KernelSpec, problems
from . import gluon_host as gh
from .matmul_hopper import wgmma_acc_layout
from .spaces.hopper import SPACES

OP, BACKEND = "conv2d_wgrad", "hopper"
KERNEL = f"{OP}.{BACKEND}"

problem = problems.conv2d_wgrad_problem
inputs = problems.conv2d_wgrad_inputs
reference = problems.conv2d_wgrad_reference
flops = problems.conv2d_flops

_DTYPES = ("float16", "bfloat16")


# ---- device code -------------------------------------------------------------------------------


@gluon.jit
def _tile(tile_id, co_blocks, ci_blocks, RS):
    """tile id -> (split, rs, ci block, co block), split slowest."""
    co_blk = tile_id % co_blocks
    rest = tile_id // co_blocks
    ci_blk = rest % ci_blocks
    rest = rest // ci_blocks
    return rest // RS, rest % RS, ci_blk, co_blk


@gluon.jit
def _tile_origin(t, pid, nprog, co_blocks, ci_blocks, RS, S, k_per_split,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """This CTA's t-th tile -> (first pixel of its split, first Co, first Ci, tap r, tap s)."""
    split, rs, ci_blk, co_blk = _tile(pid + t * nprog, co_blocks, ci_blocks, RS)
    return split * k_per_split * BLOCK_K, co_blk * BLOCK_M, ci_blk * BLOCK_N, rs // S, rs % S


@gluon.jit
def _issue_load(step, total, m0, co0, ci0, r, s, g_desc, x_desc, a_bufs, b_bufs, ready,
                PQ, Q, stride_h, stride_w, pad_h, pad_w, STAGES: gl.constexpr, IM2COL: gl.constexpr):
    """TMA-load pixels m0... of grad_out (channels co0...) and of im2col(x) at tap (r, s)."""
    pred = step < total
    slot = step % STAGES
    bar = ready.index(slot)
    mbarrier.expect(bar, g_desc.block_type.nbytes + x_desc.block_type.nbytes, pred)
    tma.async_load(g_desc, [m0, co0], bar, a_bufs.index(slot), pred)
    if IM2COL:
        pq = m0 % PQ
        tma.async_load_im2col(x_desc, [m0 // PQ, (pq // Q) * stride_h - pad_h, (pq % Q) * stride_w - pad_w, ci0],
                              [r.to(gl.int16), s.to(gl.int16)], bar, b_bufs.index(slot), pred)
    else:  # 1x1, stride 1, no padding: x as it lies, [N*H*W, Ci]
        tma.async_load(x_desc, [m0, ci0], bar, b_bufs.index(slot), pred)


@gluon.jit(do_not_specialize=["Co", "Ci", "RS", "S", "PQ", "Q", "stride_h", "stride_w", "pad_h", "pad_w",
                              "k_per_split", "num_splits"])
def conv2d_wgrad_kernel(g_desc, x_desc, out_ptr, Co, Ci, RS, S, PQ, Q, stride_h, stride_w, pad_h, pad_w,
                        k_per_split, num_splits, STAGES: gl.constexpr, IM2COL: gl.constexpr,
                        num_warps: gl.constexpr):
    """g_desc: tiles of grad_out [N*P*Q, Co]; x_desc: im2col over x [N, H, W, Ci];
    out_ptr: [num_splits, Co, RS*Ci] (fp32 partials, or grad_w itself when num_splits == 1)."""
    BLOCK_K: gl.constexpr = g_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = g_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = x_desc.block_type.shape[1]
    dtype: gl.constexpr = g_desc.dtype

    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + g_desc.block_type.shape, g_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    co_blocks = gl.cdiv(Co, BLOCK_M)
    ci_blocks = gl.cdiv(Ci, BLOCK_N)
    num_tiles = co_blocks * RS * ci_blocks * num_splits
    my_tiles = gl.cdiv(num_tiles - pid, nprog)
    total = my_tiles * k_per_split
    row_len = RS * Ci

    acc_layout: gl.constexpr = wgmma_acc_layout(BLOCK_M, BLOCK_N, num_warps)
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
    rows0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))

    # the producer's position, STAGES - 1 k-steps ahead of the WGMMAs, carried across tiles;
    # the tile's coordinates are decoded once per tile
    pt = gl.to_tensor(0)
    pkk = gl.to_tensor(0)
    pbase, pco, pci, pr, ps = _tile_origin(pt, pid, nprog, co_blocks, ci_blocks, RS, S, k_per_split, BLOCK_M, BLOCK_N,
                                           BLOCK_K)
    for i in gl.static_range(STAGES - 1):
        _issue_load(i, total, pbase + pkk * BLOCK_K, pco, pci, pr, ps, g_desc, x_desc, a_bufs, b_bufs, ready, PQ, Q,
                    stride_h, stride_w, pad_h, pad_w, STAGES, IM2COL)
        pkk += 1
        wrap = pkk == k_per_split
        pkk = gl.where(wrap, 0, pkk)
        if wrap:
            pt += 1
            pbase, pco, pci, pr, ps = _tile_origin(pt, pid, nprog, co_blocks, ci_blocks, RS, S, k_per_split, BLOCK_M,
                                                   BLOCK_N, BLOCK_K)

    step = 0
    for t in range(my_tiles):
        for kk in range(k_per_split):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(slot).permute((1, 0)), b_bufs.index(slot), acc, use_acc=kk != 0,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            _issue_load(step + STAGES - 1, total, pbase + pkk * BLOCK_K, pco, pci, pr, ps, g_desc, x_desc, a_bufs,
                        b_bufs, ready, PQ, Q, stride_h, stride_w, pad_h, pad_w, STAGES, IM2COL)
            pkk += 1
            wrap = pkk == k_per_split
            pkk = gl.where(wrap, 0, pkk)
            if wrap:
                pt += 1
                pbase, pco, pci, pr, ps = _tile_origin(pt, pid, nprog, co_blocks, ci_blocks, RS, S, k_per_split,
                                                       BLOCK_M, BLOCK_N, BLOCK_K)
            step += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        split, rs, ci_blk, co_blk = _tile(pid + t * nprog, co_blocks, ci_blocks, RS)
        rows = co_blk * BLOCK_M + rows0
        ci = ci_blk * BLOCK_N + cols0
        # a Ci block may run past this tap's channels into the next tap's: mask it off
        mask = (rows < Co)[:, None] & (ci < Ci)[None, :]
        base = (split.to(gl.int64) * Co + rows.to(gl.int64)) * row_len + rs * Ci
        ptrs = out_ptr + base[:, None] + ci[None, :]
        gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


JIT_FUNCTIONS = (conv2d_wgrad_kernel, gh.split_k_reduce_kernel)


# ---- configs -------------------------------------------------------------------------------------


def supports(p: dict, device) -> bool:
    return device.capability == (9, 0) and p.get("dtype") in _DTYPES and gh.conv_geometry_ok(p)


def config_space(p: dict, device) -> list[dict]:
    """The space, less configs that would run but cannot help on this problem (too-large
    tiles, narrow two-warpgroup tiles, splits past what fills the GPU). Resource limits are left to
    prune(), which must agree with the compiler."""
    return [c for c in SPACES[OP] if not resources_ok(c) or fits(c, p, (getattr(device, "sm_count", 0) or 132))]


def resources_ok(c: dict) -> bool:
    return gh.wgmma_resources_ok(c, smem_bytes(c))


def smem_bytes(c: dict, itemsize: int = 2) -> int:
    return c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * itemsize + 8 * c["num_stages"] + 1024


def output_tiles(p: dict, c: dict) -> int:
    ci = gh.padded_channels(p["Ci"], p["dtype"])
    return triton.cdiv(p["Co"], c["BLOCK_M"]) * p["R"] * p["S"] * triton.cdiv(ci, c["BLOCK_N"])


def requested_splits(p: dict, c: dict, sms: int) -> int:
    """SPLIT_K, with 0 meaning: as many splits as keep one wave of CTAs within the SMs."""
    if c["SPLIT_K"] == 0:
        return max(1, sms // output_tiles(p, c))
    return c["SPLIT_K"]


def splits_of(p: dict, c: dict, sms: int = 132) -> tuple[int, int]:
    """(active splits, k-steps per split) of config c on problem p."""
    return gh.split_k_plan(triton.cdiv(p["N"] * p["P"] * p["Q"], c["BLOCK_K"]), requested_splits(p, c, sms))


def fits(c: dict, p: dict | None = None, sms: int = 132) -> bool:
    if smem_bytes(c) > gh.SMEM_LIMIT_BYTES:
        return False
    if c["BLOCK_M"] * c["BLOCK_N"] // (32 * c["num_warps"]) > 128:
        return False
    # two warpgroups split a 64-row tile along N: only worth it on wide tiles
    if c["num_warps"] == 8 and c["BLOCK_M"] == 64 and c["BLOCK_N"] < 128:
        return False
    if p is not None:
        ci = gh.padded_channels(p["Ci"], p["dtype"])
        if c["BLOCK_N"] > max(16, gh.pow2_at_least(ci)) or c["BLOCK_M"] > max(64, gh.pow2_at_least(p["Co"])):
            return False
        npq = p["N"] * p["P"] * p["Q"]
        if c["BLOCK_K"] > max(32, gh.pow2_at_least(npq)):
            return False
        active, _ = splits_of(p, c, sms)
        if c["SPLIT_K"] > 0 and active < c["SPLIT_K"]:
            return False  # the same launch as a smaller SPLIT_K
        tiles = output_tiles(p, c)
        # splitting further once the output tiles alone fill the GPU twice only adds reduction
        if c["SPLIT_K"] > 1 and tiles * c["SPLIT_K"] // 2 >= 2 * sms:
            return False
    return True


def prune(configs: list[dict], p: dict, device) -> list[dict]:
    """Configs that fit the device, the likeliest winners first."""
    kept = [c for c in configs if resources_ok(c)]
    return gh.quick_first(OP, kept, p, getattr(device, "sm_count", 0) or 132)


def default_config(p: dict, device) -> dict:
    sms = getattr(device, "sm_count", 0) or 132
    ci = gh.padded_channels(p["Ci"], p["dtype"])
    bm = 128 if p["Co"] >= 128 else 64
    bn = min(128, max(16, gh.pow2_at_least(ci)))
    warps = 8 if bm == 128 and bn >= 128 else 4
    c = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "SPLIT_K": 0, "num_warps": warps, "num_stages": 4}
    if not fits(c, p, sms):
        fitting = prune(config_space(p, device), p, device)
        if fitting:
            c = max(fitting, key=lambda x: (x["BLOCK_M"] * x["BLOCK_N"], x["BLOCK_K"], -x["SPLIT_K"]))
    return c


# ---- host side -----------------------------------------------------------------------------------


def is_pointwise(p: dict) -> bool:
    """1x1 filter, stride 1, no padding: im2col(x) is x itself."""
    return (p["R"], p["S"], p["stride_h"], p["stride_w"], p["pad_h"], p["pad_w"]) == (1, 1, 1, 1, 0, 0)


def _constexprs(c: dict, im2col: bool) -> dict:
    return {"STAGES": c["num_stages"], "IM2COL": im2col, "num_warps": c["num_warps"]}


class _Plan:
    """One (config, x/grad_out shapes and strides, dtype, filter, stride, padding, device) launch,
    precomputed: see gluon_host.DirectLauncher."""

    __slots__ = ("launcher", "reduce", "maps", "grid0", "tail", "g_desc", "x_desc", "ci", "pad_x", "pad_g",
                 "ci_g", "out_shape", "active", "ws_shape", "reduce_grid0", "reduce_tail", "Ci0")

    def run(self, x: torch.Tensor, g: torch.Tensor, stream: int) -> torch.Tensor | None:
        xp = gh.pad_last_dim(x, self.ci) if self.pad_x else x
        gp = gh.pad_last_dim(g, self.ci_g) if self.pad_g else g
        out = torch.empty(self.out_shape, device=x.device, dtype=x.dtype)
        active = self.active
        target = out if active == 1 else torch.empty(self.ws_shape, device=x.device, dtype=torch.float32)
        if (target.data_ptr() | out.data_ptr()) & 15:
            return None  # pointer arguments were specialized 16-byte aligned: the JIT path
        px, pg = xp.data_ptr(), gp.data_ptr()
        maps, ld = self.maps, self.launcher
        gm = maps.get((0, pg)) or maps.put((0, pg), ld.expand_desc(0, self.g_desc(gp)))
        xm = maps.get((1, px)) or maps.put((1, px), ld.expand_desc(1, self.x_desc(xp)))
        ld(self.grid0, stream, [*gm, *xm, target, *self.tail])
        if active > 1:
            self.reduce(self.reduce_grid0, stream, (target, out, *self.reduce_tail))
        return out if self.ci == self.Ci0 else out[..., :self.Ci0].contiguous()


_PLANS = gh.PlanCache()


def launch(config: dict, x: torch.Tensor, grad_out: torch.Tensor, R: int, S: int, stride=1, padding=0) -> torch.Tensor:
    key = None
    if gh.direct_launch_enabled() and type(R) is int and type(S) is int:
        st, pd = gh.int_pair_key(stride), gh.int_pair_key(padding)
        if st is not None and pd is not None:
            dev, stream = gh.current_device_and_stream()
            key = (gh.config_key(config), x.shape, x.stride(), grad_out.shape, grad_out.stride(), x.dtype,
                   grad_out.dtype, R, S, st, pd, dev)
            plan = _PLANS.get(key)
            if plan is not None:
                out = plan.run(x, grad_out, stream)
                if out is not None:
                    return out
    return _launch_jit(config, x, grad_out, R, S, stride, padding, key)


def _launch_jit(config: dict, x: torch.Tensor, grad_out: torch.Tensor, R: int, S: int, stride, padding,
                key) -> torch.Tensor:
    (sh, sw) = problems.pair(stride, "stride", minimum=1)
    (ph, pw) = problems.pair(padding, "padding", minimum=0)
    N, H, W, Ci0 = x.shape
    _, P, Q, Co = grad_out.shape
    xp, gp = gh.pad_channels(x), gh.pad_channels(grad_out)
    Ci = xp.shape[-1]
    npq = N * P * Q
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    sms = gh.num_sms(x.device)
    split = config["SPLIT_K"] or max(1, sms // (triton.cdiv(Co, bm) * R * S * triton.cdiv(Ci, bn)))
    active, per = gh.split_k_plan(triton.cdiv(npq, bk), split)
    out = torch.empty((Co, R, S, Ci), device=x.device, dtype=x.dtype)
    target = out if active == 1 else gh.split_k_workspace(active, Co, R * S * Ci, x.device)
    gc = gp.shape[-1]

    def g_desc_of(t):
        return gh.tiled_desc(t.view(npq, gc), [bk, bm])

    im2col = (R, S, sh, sw, ph, pw) != (1, 1, 1, 1, 0, 0)
    if im2col:
        def x_desc_of(t):
            return gh.im2col_desc(t, [bk, bn], stride=(sh, sw), padding=(ph, pw), out_hw=(P, Q))
    else:
        def x_desc_of(t):
            return gh.tiled_desc(t.view(npq, Ci), [bk, bn])

    g_desc, x_desc = g_desc_of(gp), x_desc_of(xp)
    tiles = triton.cdiv(Co, bm) * R * S * triton.cdiv(Ci, bn) * active
    grid = gh.persistent_grid(tiles, sms)
    ce = _constexprs(config, im2col)
    scalars = (Co, Ci, R * S, S, P * Q, Q, sh, sw, ph, pw, per, active)
    compiled = conv2d_wgrad_kernel[grid](g_desc, x_desc, target, *scalars, **ce)
    reduce = None
    if active > 1:
        reduce = gh.split_k_reduce_jit(target, out)
    if key is not None and not (target.data_ptr() | out.data_ptr()) & 15:
        ld = gh.DirectLauncher.of(compiled)
        rd = gh.DirectLauncher.of(reduce) if active > 1 else None
        if ld is not None and (active == 1 or rd is not None):
            plan = _Plan()
            plan.launcher, plan.reduce, plan.maps, plan.grid0 = ld, rd, gh.DescMaps(), grid[0]
            plan.tail = gh.kernel_args(conv2d_wgrad_kernel, (None, None, None) + scalars, ce)[3:]
            plan.g_desc, plan.x_desc = g_desc_of, x_desc_of
            plan.ci, plan.ci_g, plan.pad_x, plan.pad_g = Ci, gc, xp is not x, gp is not grad_out
            plan.out_shape, plan.active, plan.ws_shape, plan.Ci0 = (Co, R, S, Ci), active, (active, Co, R * S * Ci), Ci0
            numel = out.numel()
            plan.reduce_grid0 = gh.split_k_reduce_grid(numel)[0]
            plan.reduce_tail = (numel, active) + gh.split_k_reduce_tail()
            _PLANS.put(key, plan)
    return out if Ci == Ci0 else out[..., :Ci0].contiguous()


def compile_specs(p: dict, config: dict, device) -> list[KernelSpec]:
    dt = p["dtype"]
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    active, _ = splits_of(p, config)
    im2col = not is_pointwise(p)
    ce = _constexprs(config, im2col)
    sig = {"g_desc": gh.desc_sig(dt, [bk, bm]),
           "x_desc": gh.im2col_desc_sig(dt, [bk, bn]) if im2col else gh.desc_sig(dt, [bk, bn]),
           "out_ptr": "*fp32" if active > 1 else gh.ptr_sig(dt)}
    sig.update({k: "i32" for k in ("Co", "Ci", "RS", "S", "PQ", "Q", "stride_h", "stride_w", "pad_h", "pad_w",
                                   "k_per_split", "num_splits")})
    sig.update({k: "constexpr" for k in ce})
    specs = [KernelSpec(fn=conv2d_wgrad_kernel, signature=sig, constexprs=ce, num_warps=config["num_warps"],
                        num_stages=config["num_stages"], name="conv2d_wgrad_kernel")]
    if active > 1:
        specs.append(gh.split_k_reduce_spec(dt))
    return specs
