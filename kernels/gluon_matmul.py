"""The rules both Gluon matmuls (Hopper, Blackwell) follow: their tiles and split counts, swap-AB
for decode-sized M, the operands' layouts as TMA reads them, which candidates are worth timing,
what a JIT launch sets up before it calls the kernel, and the split epilogue that sums a tile's
partials in the kernel itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from . import KernelSpec
from . import gluon_host as gh
from . import gluon_split_k as sk
from .gluon_host import cdiv, desc_sig, pow2_at_least, ptr_sig, sm_count_of
from .gluon_split_k import auto_splits, no_split_workspace, split_k_plan, split_k_workspace
from .problems import matrix_layout

# ---- split-K ---------------------------------------------------------------------------------


def matmul_tiles(p: dict, c: dict) -> int:
    return cdiv(p["M"], c["BLOCK_M"]) * cdiv(p["N"], c["BLOCK_N"])


def matmul_splits(p: dict, c: dict, sms: int) -> tuple[int, int]:
    """(splits, k-steps per split) of config c's launch on matmul p: SPLIT_K, or for 0 the work
    model's count (auto_splits), as split_k_plan runs it."""
    k_steps = cdiv(p["K"], c["BLOCK_K"])
    tiles = matmul_tiles(p, c)
    if c["SPLIT_K"]:
        want = c["SPLIT_K"]
    elif c.get("SWAP_AB"):
        # a swapped decode GEMM streams its weight: every SM that streams helps, and its
        # partials are a few rows, so the most splits that still run in one wave
        want = max(1, sms // tiles)
    else:
        want = auto_splits(tiles, k_steps, sms, p["M"] * p["N"], c)
    return split_k_plan(k_steps, want)


# ---- swap-AB: decode GEMMs as c^T = b^T a^T ----------------------------------------------------
#
# An MMA tile (WGMMA, tcgen05) is at least 64 rows: with M = 1 a 64-row tile computes 64 times
# the work and fills shared memory with zero rows. Swapped, the weight's N is the MMA's 64-row
# side and M its narrow side (8, 16 or 32 columns, the narrowest N the MMA takes that holds M),
# as cuBLAS runs M = 1 and 16 (64x8 tiles, H100). A config's SWAP_AB = 1 launches so; BLOCK_N
# then does not shape the launch (the narrow tile follows M), so only its 64 is tried.


SWAP_MAX_M = 32


def narrow_tile(M: int) -> int:
    """A swapped launch's tile over M: M rounded up to 8, 16 or 32."""
    return min(SWAP_MAX_M, max(8, pow2_at_least(M)))


def matmul_as_launched(c: dict, p: dict | None) -> tuple[dict, dict | None]:
    """(config, problem) as the kernel runs them: under SWAP_AB, M and N (and the operands)
    swapped and BLOCK_N the narrow tile over M (its widest, 32, without a problem)."""
    if not c.get("SWAP_AB"):
        return c, p
    flip = {"row": "col", "col": "row"}
    if p is None:
        return dict(c, BLOCK_N=SWAP_MAX_M), None
    q = dict(p, M=p["N"], N=p["M"])
    if "a_layout" in p:
        q.update(a_layout=flip[p["b_layout"]], b_layout=flip[p["a_layout"]])
    return dict(c, BLOCK_N=narrow_tile(p["M"])), q


def matmul_operands(a: torch.Tensor, b: torch.Tensor, swap: bool) -> tuple[bool, bool, bool, bool]:
    """(x_t, y_t, trans_a, trans_b) of a matmul launch: the kernel's operands are x, y = (b, a)
    swapped (its a is b^T, its b a^T), else (a, b); TMA tiles the row-major storage of each,
    x.t() if x_t else x (a transposed view, layout "col", is described as its transpose), and
    trans_a / trans_b say whether that storage holds the kernel's operand transposed."""
    a_t = matrix_layout(a, "a") == "col" and a.shape[0] > 1
    b_t = matrix_layout(b, "b") == "col" and b.shape[1] > 1
    if swap:
        return b_t, a_t, not b_t, not a_t
    return a_t, b_t, a_t, b_t


def matmul_views(
    a: torch.Tensor, b: torch.Tensor, swap: bool, x_t: bool, y_t: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The row-major storages the kernel's a and b descriptors tile (matmul_operands' x_t, y_t)."""
    x, y = (b, a) if swap else (a, b)
    return (x.t() if x_t else x), (y.t() if y_t else y)


# ---- candidates worth timing -----------------------------------------------------------------


def matmul_swap_worth_trying(c: dict, p: dict) -> bool:
    """The swap-AB half of a matmul's worth_trying: swapped only for decode-sized M, and once
    per narrow tile (BLOCK_N 64 stands for it)."""
    return not c.get("SWAP_AB") or (p["M"] <= SWAP_MAX_M and c["BLOCK_N"] == 64)


def matmul_split_worth_trying(c: dict, p: dict, sms: int) -> bool:
    """The split-K half of a matmul's worth_trying: no split of a GEMM whose tiles fill the GPU,
    no SPLIT_K=0 where the model does not split (the same launch as 1), no explicit count that
    launches as a smaller one (fewer k-steps than splits) or as the model's own."""
    if c["SPLIT_K"] == 1:
        return True
    if matmul_tiles(p, c) >= sms:
        return False  # the tiles fill the GPU: splitting only adds the partials' round trip
    model = matmul_splits(p, dict(c, SPLIT_K=0), sms)[0]
    if c["SPLIT_K"] == 0:
        return model > 1
    return matmul_splits(p, c, sms)[0] == c["SPLIT_K"] != model


def split_binary(c: dict, splits: int) -> bool:
    """Whether a matmul launch runs its split binary: always for SPLIT_K >= 2 (so the config
    alone decides its binary and its shared memory), for 0 where the model splits."""
    return c["SPLIT_K"] >= 2 or splits > 1


def matmul_compile_specs(fn, p: dict, config: dict, device, block_shapes, constexprs, ints: tuple) -> list[KernelSpec]:
    """compile_specs of a Gluon matmul kernel `fn`, both backends': config as launched on p
    (matmul_as_launched), its split binary where the launch splits on `device`'s SMs. The
    backend's `block_shapes(c, trans_a, trans_b)` and `constexprs(c, trans_a, trans_b, split)`
    shape it; `ints`: the kernel's integer parameters, in order."""
    dt = p["dtype"]
    kc, kp = matmul_as_launched(config, p)
    trans_a, trans_b = kp["a_layout"] == "col", kp["b_layout"] == "col"
    a_blk, b_blk, c_blk = block_shapes(kc, trans_a, trans_b)
    split = split_binary(kc, matmul_splits(kp, kc, sm_count_of(device))[0])
    ce = constexprs(kc, trans_a, trans_b, split)
    sig = {
        "a_desc": desc_sig(dt, a_blk),
        "b_desc": desc_sig(dt, b_blk),
        "c_desc": desc_sig(dt, c_blk),
        "ws_ptr": "*fp32",
        "c_ptr": ptr_sig(dt),
        "cnt_ptr": "*i32",
        **{k: "i32" for k in ints},
    }
    sig.update({k: "constexpr" for k in ce})
    return [KernelSpec(fn=fn, signature=sig, constexprs=ce, num_warps=config["num_warps"], name=fn.__name__)]


# ---- the JIT launch ----------------------------------------------------------------------------


@dataclass
class MatmulLaunch:
    """A matmul's JIT launch as both backends set it up (matmul_launch): the kernel's operands
    (a_view, b_view: the row-major storages its descriptors tile, a_t / b_t as matmul_operands'
    x_t / y_t; a_src, b_src: the same, or copies where TMA cannot read them as they lie), their
    block shapes and descriptors, the output c [M, n_pad] (N columns of it are the product), the
    grid, the split binary's fp32 workspace (a placeholder when unsplit) and tile counters, and
    the kernel's constexprs and integer arguments."""

    swap: bool
    a_t: bool
    b_t: bool
    a_view: torch.Tensor
    b_view: torch.Tensor
    a_src: torch.Tensor
    b_src: torch.Tensor
    blocks: tuple
    descs: tuple
    c: torch.Tensor
    N: int
    n_pad: int
    grid: tuple
    split: bool
    tiles: int
    ws: torch.Tensor
    cnt: torch.Tensor
    constexprs: dict
    scalars: tuple

    def args(self) -> tuple:
        """The kernel's arguments before its constexprs: descriptors, pointers, integers."""
        return (*self.descs, self.ws, self.c, self.cnt, *self.scalars)

    def result(self) -> torch.Tensor:
        """c = a @ b, the padding columns cut."""
        return self.c if self.n_pad == self.N else self.c[:, : self.N].contiguous()


def matmul_launch(config: dict, a: torch.Tensor, b: torch.Tensor, block_shapes, constexprs) -> MatmulLaunch:
    """The set-up of a Gluon matmul's JIT launch of c = a @ b, both backends': the config as
    launched (matmul_as_launched), its split count on this GPU and binary, the grid over its
    (tile, split) units; the backend's `block_shapes(c, trans_a, trans_b)` and
    `constexprs(c, trans_a, trans_b, split)` shape the descriptors and the kernel."""
    M, K = a.shape
    N = b.shape[1]
    swap = bool(config.get("SWAP_AB"))
    x_t, y_t, trans_a, trans_b = matmul_operands(a, b, swap)
    a_view, b_view = matmul_views(a, b, swap, x_t, y_t)
    a_src, b_src = gh.tma_ready(a_view), gh.tma_ready(b_view)
    n_pad = gh.padded_channels(N, a.dtype)
    c = torch.empty((M, n_pad), device=a.device, dtype=a.dtype)
    kc, kp = matmul_as_launched(config, {"M": M, "N": N, "K": K})
    blocks = block_shapes(kc, trans_a, trans_b)
    descs = tuple(gh.tiled_desc(t, blk) for t, blk in zip((a_src, b_src, c), blocks))
    sms = gh.num_sms(a.device)  # through the modules: where a CPU-only test sets the SM count and counters
    splits, per = matmul_splits(kp, kc, sms)
    split = split_binary(kc, splits)
    tiles = matmul_tiles(kp, kc)
    ws = split_k_workspace(splits, M, n_pad, a.device) if split else no_split_workspace(a.device)
    cnt = sk.zeroed_counters(a.device, torch.cuda.current_stream(a.device).cuda_stream, tiles)
    scalars = (kp["M"], kp["N"], K, config["GROUP_M"], splits, per, n_pad)
    grid, ce = gh.persistent_grid(tiles * splits, sms), constexprs(kc, trans_a, trans_b, split)
    views = (a_view, b_view, a_src, b_src)
    return MatmulLaunch(swap, x_t, y_t, *views, blocks, descs, c, N, n_pad, grid, split, tiles, ws, cnt, ce, scalars)


# ---- device ----------------------------------------------------------------------------------


@gluon.jit
def finish_split_tile(
    ws_tile,
    c_tile,
    counter,
    rows_left,
    cols_left,
    LDW,
    split_stride,
    SPLITS,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
):
    """Once this CTA's fp32 partial of a tile is in the workspace (at ws_tile, split s at
    s * split_stride): count in on the tile's counter (zeroed_counters); the split that arrives
    last sums the SPLITS partials in split order (deterministic) into c (at c_tile, c's dtype)
    and zeroes the counter for the next launch. The matmul kernels' split epilogue: one
    launch, where a second reduction kernel cost a decode GEMM of 20 us another 3-4 (H100)."""
    # every warp's partial is out before the CTA counts itself in (release, GPU scope); the
    # last split sees them all (acquire) and reads them past L1 (.cg): other SMs wrote them
    gl.barrier()
    arrived = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLITS - 1:
        # a few rows at a time, coalesced: beside the accumulator, a whole tile's sum, loads
        # and offsets would spill
        # rows a pass: 16 values a thread at 4 warps, no more than the tile's rows
        CHUNK: gl.constexpr = 2048 // BLOCK_N if 2048 // BLOCK_N < BLOCK_M else BLOCK_M
        TN: gl.constexpr = 32 if BLOCK_N >= 128 else BLOCK_N // 4
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TN, TN], [gl.num_warps(), 1], [1, 0])
        rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        col_ok = cols[None, :] < cols_left
        for r0 in range(0, gl.minimum(rows_left, BLOCK_M), CHUNK):
            offs = (r0 + rows)[:, None] * LDW + cols[None, :]
            mask = ((r0 + rows)[:, None] < rows_left) & col_ok
            total = gl.zeros([CHUNK, BLOCK_N], gl.float32, layout)
            for s in range(SPLITS):
                total += gl.load(ws_tile + s * split_stride + offs, mask=mask, other=0.0, cache_modifier=".cg")
            gl.store(c_tile + offs, total.to(c_tile.dtype.element_ty), mask=mask)
        gl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
