"""A shape typed by hand gives exactly the problem (and so the key) a library call with such
tensors computes: `tunecache.shapes` against the ops' own argument checks on meta tensors."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tunecache.shapes import canonical_problem
from tunecache_kernels import problems as P

DT = st.sampled_from(["float16", "bfloat16", "float32"])
SIZE = st.integers(1, 300)


def meta(*shape, dtype="float32"):
    return torch.empty(shape, dtype=P.DTYPES[dtype], device="meta")


@settings(max_examples=200, deadline=None)
@given(M=SIZE, N=SIZE, K=SIZE, dtype=DT, a=st.sampled_from(["row", "col"]), b=st.sampled_from(["row", "col"]))
def test_matmul_shape_is_the_library_problem(M, N, K, dtype, a, b):
    ta = meta(M, K, dtype=dtype) if a == "row" else meta(K, M, dtype=dtype).t()
    tb = meta(K, N, dtype=dtype) if b == "row" else meta(N, K, dtype=dtype).t()
    if (M == 1 or K == 1) or (K == 1 or N == 1):
        return  # a vector's layout is ambiguous: the library calls it row
    typed = {"M": M, "N": N, "K": K, "dtype": dtype, "a_layout": a, "b_layout": b}
    assert canonical_problem("matmul", typed) == P.matmul_problem(ta, tb)


@settings(max_examples=200, deadline=None)
@given(
    N=st.integers(1, 4),
    H=st.integers(1, 40),
    W=st.integers(1, 40),
    Ci=st.integers(1, 64),
    Co=st.integers(1, 64),
    R=st.integers(1, 7),
    S=st.integers(1, 7),
    sh=st.integers(1, 3),
    sw=st.integers(1, 3),
    ph=st.integers(0, 3),
    pw=st.integers(0, 3),
    dtype=DT,
)
def test_conv_shapes_are_the_library_problems(N, H, W, Ci, Co, R, S, sh, sw, ph, pw, dtype):
    typed = dict(N=N, H=H, W=W, Ci=Ci, Co=Co, R=R, S=S, stride_h=sh, stride_w=sw, pad_h=ph, pad_w=pw, dtype=dtype)
    Pout, Qout = P.out_size(H, R, sh, ph), P.out_size(W, S, sw, pw)
    if Pout <= 0 or Qout <= 0:
        return
    x = meta(N, H, W, Ci, dtype=dtype)
    assert canonical_problem("conv2d_fprop", typed) == P.conv2d_fprop_problem(
        x, meta(Co, R, S, Ci, dtype=dtype), (sh, sw), (ph, pw)
    )
    assert canonical_problem("conv2d_wgrad", typed) == P.conv2d_wgrad_problem(
        x, meta(N, Pout, Qout, Co, dtype=dtype), R, S, (sh, sw), (ph, pw)
    )


def test_the_shape_parser_imports_no_torch():
    import subprocess
    import sys

    code = (
        "import sys; from tunecache.shapes import canonical_problem; "
        "canonical_problem('conv2d_wgrad', dict(N=2, H=9, W=8, Ci=3, Co=4, R=3, S=3, dtype='float16')); "
        "assert 'torch' not in sys.modules and 'triton' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
