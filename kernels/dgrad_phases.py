"""The phase arithmetic of every dgrad kernel, portable and Gluon.

One definition of plain integer arithmetic, jitted for each frontend: a Gluon kernel may not
reference a @triton.jit function where TRITON_INTERPRET=1 makes it an interpreted one.
At stride sh x sw, grad_x's rows a::sh, columns b::sw (one output phase) are reached only by
the filter taps r0::sh, s0::sw; a phase is named by its first taps (kr0, ks0), kr0 < min(R, sh).
"""

from __future__ import annotations

import triton
from triton import language as tl  # noqa: F401 (the interpreter looks for it among a jit function's globals)
from triton.experimental import gluon


def dgrad_phase(phase, PS, R, S, H, W, stride_h, stride_w, pad_h, pad_w):
    """Phase `phase` (its first taps (kr0, ks0) = divmod(phase, PS)) -> (kr0, ks0, the grad_x row
    and column it starts at (a, b), its taps (kr, ks), the grad_out row and column its first tap
    reads for output (0, 0) (ca, cb), its rows and columns of grad_x)."""
    kr0 = phase // PS
    ks0 = phase % PS
    a = ((kr0 - pad_h) % stride_h + stride_h) % stride_h
    b = ((ks0 - pad_w) % stride_w + stride_w) % stride_w
    kr = (R - kr0 + stride_h - 1) // stride_h
    ks = (S - ks0 + stride_w - 1) // stride_w
    ca = (a + pad_h - kr0) // stride_h
    cb = (b + pad_w - ks0) // stride_w
    rows = (H - a + stride_h - 1) // stride_h
    cols = (W - b + stride_w - 1) // stride_w
    return kr0, ks0, a, b, kr, ks, ca, cb, rows, cols


tl_dgrad_phase = triton.jit(dgrad_phase)
gl_dgrad_phase = gluon.jit(dgrad_phase)
