"""Portable conv2d dgrad in `triton.language` (NHWC; any stride, padding and channel count).

grad_x by output phase, as conv2d_dgrad_hopper: at stride sh x sw the rows a::sh, columns b::sw
of grad_x are reached only by the taps r0::sh, s0::sw, so each program computes one tile of
one phase (program ids phase-major) over that phase's taps alone: M = the phase's pixels,
N = Ci, K = its taps * Co, w read in place ([Co, R, S, Ci]: the flip and transpose are
addressing). Phases no tap reaches are zeroed by the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import dgrad_phases as dph
from . import portable_rules as rules
from . import portable_tiles as tiles
from . import problems

OP, BACKEND, KERNEL, problem, inputs, reference, flops = problems.backend_names("conv2d_dgrad", "portable")


@triton.jit
def conv2d_dgrad_kernel(
    g_ptr,
    w_ptr,
    gx_ptr,
    N,
    H,
    W,
    Ci,
    Co,
    P,
    Q,
    R,
    S,
    stride_h,
    stride_w,
    pad_h,
    pad_w,
    P2,
    Q2,
    PS,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    M2 = N * P2 * Q2
    num_pid_m = tl.cdiv(M2, BLOCK_M)
    num_pid_n = tl.cdiv(Ci, BLOCK_N)
    per_phase = num_pid_m * num_pid_n
    phase = pid // per_phase
    pid_m, pid_n = tiles.grouped_tile(pid % per_phase, num_pid_m, num_pid_n, GROUP_M)
    kr0, ks0, a, b, kr, ks, ca, cb, rows, cols = dph.tl_dgrad_phase(
        phase, PS, R, S, H, W, stride_h, stride_w, pad_h, pad_w
    )

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_ci = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_K)
    n = offs_m // (P2 * Q2)
    i = (offs_m % (P2 * Q2)) // Q2
    j = offs_m % Q2
    m_ok = (offs_m < M2) & (i < rows) & (j < cols)
    ci_ok = offs_ci < Ci
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(kr):
        gh = i + ca - t
        r = kr0 + stride_h * t
        for u in range(ks):
            gw = j + cb - u
            s = ks0 + stride_w * u
            pix_ok = m_ok & (gh >= 0) & (gh < P) & (gw >= 0) & (gw < Q)
            g_row = ((n.to(tl.int64) * P + gh) * Q + gw) * Co
            w_col = (r * S + s) * Ci + offs_ci.to(tl.int64)
            for c0 in range(0, Co, BLOCK_K):
                c = c0 + offs_c
                c_ok = c < Co
                x = tl.load(g_ptr + g_row[:, None] + c[None, :], mask=pix_ok[:, None] & c_ok[None, :], other=0.0)
                y = tl.load(
                    w_ptr + c[:, None].to(tl.int64) * (R * S * Ci) + w_col[None, :],
                    mask=c_ok[:, None] & ci_ok[None, :],
                    other=0.0,
                )
                if UPCAST:
                    x, y = x.to(tl.float32), y.to(tl.float32)
                acc = tl.dot(x, y, acc, input_precision=INPUT_PRECISION)
    out = ((n.to(tl.int64) * H + a + stride_h * i) * W + b + stride_w * j) * Ci
    tl.store(
        gx_ptr + out[:, None] + offs_ci[None, :],
        acc.to(gx_ptr.dtype.element_ty),
        mask=m_ok[:, None] & ci_ok[None, :],
    )


def _extents(p: dict) -> tuple:
    """A phase's pixels, Ci and Co (the tile dimensions' extents), and the GEMM's (M, N, K)."""
    m = p["N"] * -(-p["H"] // p["stride_h"]) * -(-p["W"] // p["stride_w"])
    return (m, p["Ci"], p["Co"]), (m, p["Ci"], p["gemm_K"])


JIT_FUNCTIONS = (conv2d_dgrad_kernel,)
supports, config_space, prune, default_config = rules.host_rules(
    OP, _extents, cpu=(32, 32, 16, 4), gpu=(128, 64, 32, 4)
)


def launch(config: dict, grad_out: torch.Tensor, w: torch.Tensor, H: int, W: int, stride=1, padding=0):
    N, P, Q, Co = grad_out.shape
    _, R, S, Ci = w.shape
    (sh, sw), (ph, pw) = problems.stride_padding(stride, padding)
    P2, Q2 = triton.cdiv(H, sh), triton.cdiv(W, sw)
    phases = min(R, sh) * min(S, sw)
    zeros = R < sh or S < sw  # phases no tap reaches are zeros
    gx = (torch.zeros if zeros else torch.empty)((N, H, W, Ci), device=grad_out.device, dtype=grad_out.dtype)
    grid = (phases * triton.cdiv(N * P2 * Q2, config["BLOCK_M"]) * triton.cdiv(Ci, config["BLOCK_N"]),)
    conv = (N, H, W, Ci, Co, P, Q, R, S, sh, sw, ph, pw)
    conv2d_dgrad_kernel[grid](
        grad_out, w, gx, *conv, P2, Q2, min(S, sw), **rules.launch_options(config, grad_out, "conv")
    )
    return gx
