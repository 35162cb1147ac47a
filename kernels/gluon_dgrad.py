"""Conv dgrad by output phase (dgrad_phases.py): the geometry both Gluon dgrad kernels walk on
the host (the phases' shared im2col walk, its halo, the epilogue's rules and the kernel's
integers, DgradGeometry) and the dgrad's split rule.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import KernelSpec
from .geometry import is_pointwise
from .gluon_host import (
    cdiv,
    desc_sig,
    im2col_desc,
    im2col_desc_sig,
    im2col_ok,
    padded_channels,
    ptr_sig,
    sm_count_of,
    tiled_desc,
    tma_multiple,
)
from .gluon_split_k import modeled_splits, split_k_reduce_spec
from .problems import dtype_name


def dgrad_halo(taps: int, stride: int, pad: int) -> int:
    """Rows (or columns) of grad_out the shared im2col walk must start before output row 0 so
    that every phase's first tap is a non-negative offset from it."""
    need = 0
    for kr0 in range(min(taps, stride)):
        a = (kr0 - pad) % stride
        kr = -(-(taps - kr0) // stride)
        need = max(need, kr - 1 - (a + pad - kr0) // stride)
    return need


def dgrad_walk(p: dict) -> tuple[int, int, int, int]:
    """(rows, columns) of the walk every phase shares (the largest phase's), and its halo."""
    sh, sw = p["stride_h"], p["stride_w"]
    return -(-p["H"] // sh), -(-p["W"] // sw), dgrad_halo(p["R"], sh, p["pad_h"]), dgrad_halo(p["S"], sw, p["pad_w"])


def dgrad_geometry_ok(p: dict) -> bool:
    """im2col_ok() for a dgrad problem dict: can TMA im2col walk grad_out by the shared walk?"""
    p2, q2, ph, pw = dgrad_walk(p)
    return im2col_ok(p["P"], p["Q"], p2, q2, (1, 1), (ph, pw))


def dgrad_phases(p: dict, zero_phases: bool = False) -> int:
    """Phases a dgrad kernel walks: those some tap reaches (the others, where a filter is smaller
    than its stride, are zeros the host writes), or with zero_phases every one of the stride's
    (the kernel stores those zeros itself)."""
    sh, sw = p["stride_h"], p["stride_w"]
    return sh * sw if zero_phases else min(p["R"], sh) * min(p["S"], sw)


def dgrad_store_vec(ci: int, dtype) -> int:
    """Channels a thread stores at once in the pointer epilogue: up to 16 bytes, as many as
    divide a pixel's row (Ci = 4: 8-byte stores; Ci = 3: 2-byte ones)."""
    v = tma_multiple(dtype)
    while ci % v:
        v //= 2
    return v


def dgrad_tma_store_ok(p: dict) -> bool:
    """Stride 1: one phase, whose walk is grad_x's own pixels, so the epilogue is a TMA store of
    grad_x viewed [N*H*W, Ci] (its rows 16-byte aligned)."""
    return (p["stride_h"], p["stride_w"]) == (1, 1) and p["Ci"] % tma_multiple(p["dtype"]) == 0


# the dgrad kernels' integer arguments, in order (each backend adds its GROUP_M after them)
DGRAD_INT_ARGS = ("M2", "Ci", "Co", "Ciw", "R", "S", "H", "W", "PQ2", "Q2", "stride_h", "stride_w")


DGRAD_INT_ARGS += ("pad_h", "pad_w", "PH", "PW", "PS", "n_phases")


class DgradGeometry:
    """What a dgrad kernel's host derives from grad_out [N, P, Q, Co], w [Co, R, S, Ci] and the
    forward call's H, W, stride and padding, the same for both Gluon backends: the channel
    counts TMA reads (grad_out's Co padded to 16 bytes; w's Ci padded where its rows [R*S*Ci]
    break the 16-byte rule: those extra columns are output channels past Ci, never stored),
    the phases' shared walk, which epilogue and A operand apply, and the kernel's integers."""

    def __init__(self, g_shape, w_shape, H: int, W: int, stride, padding, dtype, zero_phases: bool = False) -> None:
        N, P, Q, Co = (int(v) for v in g_shape)
        _, R, S, Ci = (int(v) for v in w_shape)
        (sh, sw), (ph, pw) = stride, padding
        p = {"H": H, "W": W, "R": R, "S": S, "Ci": Ci, "dtype": dtype_name(dtype)}
        p.update({"stride_h": sh, "stride_w": sw, "pad_h": ph, "pad_w": pw})
        self.N, self.P, self.Q, self.Co, self.R, self.S, self.Ci, self.H, self.W = N, P, Q, Co, R, S, Ci, H, W
        self.stride = (sh, sw)
        self.co = padded_channels(Co, dtype)
        self.ciw = Ci if (R * S * Ci) % tma_multiple(dtype) == 0 else padded_channels(Ci, dtype)
        self.p2, self.q2, self.halo_h, self.halo_w = dgrad_walk(p)
        self.im2col = (R, S, sh, sw, ph, pw) != (1, 1, 1, 1, 0, 0)
        self.tma_store = dgrad_tma_store_ok(p)
        self.vec = dgrad_store_vec(Ci, dtype)
        # phases no tap reaches (a filter smaller than its stride) are zeros: written by the host
        # before the launch, or with zero_phases by the kernel, which then walks every phase
        self.zeros = (R < sh or S < sw) and not zero_phases
        self.phases, ps = dgrad_phases(p, zero_phases), sw if zero_phases else min(S, sw)
        self.m2 = N * self.p2 * self.q2
        self.ints = (self.m2, Ci, self.co, self.ciw, R, S, H, W, self.p2 * self.q2, self.q2, sh, sw, ph, pw)
        self.ints += (self.halo_h, self.halo_w, ps, self.phases)

    def g_desc(self, g: torch.Tensor, block: Sequence[int]):
        """grad_out (channels padded) as the A operand: the phases' im2col walk, or the plain
        [N*P*Q, Co] matrix of a pointwise 1x1."""
        if not self.im2col:
            return tiled_desc(g.view(self.N * self.P * self.Q, self.co), block)
        return im2col_desc(g, block, stride=(1, 1), padding=(self.halo_h, self.halo_w), out_hw=(self.p2, self.q2))

    def w_desc(self, w: torch.Tensor, block: Sequence[int]):
        """w (Ci padded) as [Co, R*S*Ciw], read in [BLOCK_K (Co), BLOCK_N (Ci)] tiles."""
        return tiled_desc(w.view(self.Co, self.R * self.S * self.ciw), block)

    def new_grad_x(self, like: torch.Tensor) -> torch.Tensor:
        shape = (self.N, self.H, self.W, self.Ci)
        return (torch.zeros if self.zeros else torch.empty)(shape, device=like.device, dtype=like.dtype)

    def tiles(self, block_m: int, block_n: int) -> int:
        return self.phases * -(-self.m2 // block_m) * -(-self.Ci // block_n)

    def splits(self, c: dict, sms: int) -> tuple[int, int]:
        """(splits, k-steps per split) of config c's launch (dgrad_splits); unsplit, the k-steps
        cover every phase's."""
        k_steps = self.R * self.S * cdiv(self.co, c["BLOCK_K"])
        out_elems = self.N * self.H * self.W * self.Ci  # grad_x
        return dgrad_splits(c, self.stride, self.tiles(c["BLOCK_M"], c["BLOCK_N"]), k_steps, out_elems, sms)


# ---- split-K ---------------------------------------------------------------------------------


def dgrad_splits(c: dict, stride, tiles: int, k_steps: int, out_elems: int, sms: int) -> tuple[int, int]:
    """(splits, k-steps per split) of a dgrad launch, both backends' rule (modeled_splits): only
    a stride-1 dgrad splits, its one phase's walk being grad_x's own pixels (the partials' layout)."""
    if tuple(stride) != (1, 1):
        return 1, k_steps
    return modeled_splits(c, tiles, k_steps, out_elems, sms)


def dgrad_problem_splits(p: dict, c: dict, sms: int) -> tuple[int, int]:
    """dgrad_splits of config c on problem p (a split launch has one phase: its tiles are the walk's)."""
    k_steps = p["R"] * p["S"] * cdiv(padded_channels(p["Co"], p["dtype"]), c["BLOCK_K"])
    p2, q2, _, _ = dgrad_walk(p)
    tiles = cdiv(p["N"] * p2 * q2, c["BLOCK_M"]) * cdiv(p["Ci"], c["BLOCK_N"])
    st = (p["stride_h"], p["stride_w"])
    return dgrad_splits(c, st, tiles, k_steps, p["N"] * p["H"] * p["W"] * p["Ci"], sms)


def dgrad_specs(fn, p: dict, c: dict, blocks, constexprs, device, options=None) -> list[KernelSpec]:
    """Both Gluon dgrad backends' compile specs: kernel fn (descriptors g, w, y in `blocks`, then
    grad_x and the split workspace; every other non-constexpr parameter an i32) with
    constexprs(c, im2col, tma_store, vec, split), and the split reduction where p splits."""
    dt = p["dtype"]
    g_blk, w_blk, y_blk = blocks
    im2col = not is_pointwise(p)
    sms = sm_count_of(device)
    split = dgrad_problem_splits(p, c, sms)[0] > 1
    ce = constexprs(c, im2col, dgrad_tma_store_ok(p), dgrad_store_vec(p["Ci"], dt), split)
    sig = {
        "g_desc": im2col_desc_sig(dt, g_blk) if im2col else desc_sig(dt, g_blk),
        "w_desc": desc_sig(dt, w_blk),
        "y_desc": desc_sig(dt, y_blk),
        "gx_ptr": ptr_sig(dt),
        "ws_ptr": "*fp32",
    }
    sig.update({k: "i32" for k in fn.arg_names if k not in sig and k not in ce})
    sig.update({k: "constexpr" for k in ce})
    spec = KernelSpec(fn, sig, ce, num_warps=c["num_warps"], options=options or {}, name=fn.__name__)
    numel = p["N"] * p["H"] * p["W"] * p["Ci"]  # grad_x, the reduction's outputs
    return [spec, split_k_reduce_spec(dt, numel, sms)] if split else [spec]
