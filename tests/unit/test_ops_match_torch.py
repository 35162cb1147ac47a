"""Results match torch across strides, paddings, odd channel counts, batch 1 and layouts."""

from __future__ import annotations

import pytest
import torch

from tunecache import ops
from tunecache_kernels import problems as P


@pytest.fixture(autouse=True)
def _default_policy(db_url, monkeypatch):
    # default configs (no tuning per shape) keep the interpreter grid fast; tuning itself is
    # covered by test_tune_once
    monkeypatch.setenv("TUNECACHE_MISS_POLICY", "default")


@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (17, 33, 9), (64, 48, 70), (5, 130, 31)])
@pytest.mark.parametrize("layout", ["nn", "tn", "nt", "tt"])
def test_matmul(M, N, K, layout):
    a = torch.randn(M, K) if layout[0] == "n" else torch.randn(K, M).t()
    b = torch.randn(K, N) if layout[1] == "n" else torch.randn(N, K).t()
    torch.testing.assert_close(ops.matmul(a, b), a @ b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matmul_half(dtype):
    a, b = torch.randn(33, 40, dtype=dtype), torch.randn(40, 25, dtype=dtype)
    torch.testing.assert_close(ops.matmul(a, b), P.matmul_reference(a, b), atol=2e-2, rtol=2e-2)


CONV_CASES = [
    # N, H, W, Ci, Co, R, S, stride, padding
    (1, 8, 8, 3, 5, 3, 3, 1, 1),
    (2, 9, 7, 5, 7, 3, 3, 2, 1),
    (1, 11, 11, 6, 4, 5, 5, 3, 0),
    (3, 6, 6, 17, 9, 1, 1, 1, 0),
    (2, 7, 9, 4, 6, 2, 3, (1, 2), (1, 0)),
    (1, 5, 5, 1, 1, 5, 5, 1, 1),
]


@pytest.mark.parametrize("N,H,W,Ci,Co,R,S,stride,padding", CONV_CASES)
def test_conv2d_fprop(N, H, W, Ci, Co, R, S, stride, padding):
    x, w = torch.randn(N, H, W, Ci), torch.randn(Co, R, S, Ci)
    y = ops.conv2d_fprop(x, w, stride=stride, padding=padding)
    ref = P.conv2d_fprop_reference(x, w, stride, padding)
    assert y.shape == ref.shape
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("N,H,W,Ci,Co,R,S,stride,padding", CONV_CASES)
def test_conv2d_wgrad(N, H, W, Ci, Co, R, S, stride, padding):
    x = torch.randn(N, H, W, Ci, requires_grad=True)
    w = torch.randn(Co, R, S, Ci, requires_grad=True)
    st = stride if isinstance(stride, tuple) else (stride, stride)
    pd = padding if isinstance(padding, tuple) else (padding, padding)
    y = torch.nn.functional.conv2d(x.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2), stride=st, padding=pd)
    g = torch.randn_like(y)
    y.backward(g)  # autograd's weight gradient is the reference
    grad_out = g.permute(0, 2, 3, 1).contiguous()
    gw = ops.conv2d_wgrad(x.detach(), grad_out, R, S, stride=stride, padding=padding)
    torch.testing.assert_close(gw, w.grad, atol=1e-3, rtol=1e-4)


def test_stride_and_padding_as_lists():
    x, w = torch.randn(1, 7, 7, 3), torch.randn(4, 3, 3, 3)
    torch.testing.assert_close(
        ops.conv2d_fprop(x, w, stride=[2, 1], padding=[1, 0]),
        P.conv2d_fprop_reference(x, w, (2, 1), (1, 0)),
        atol=1e-4,
        rtol=1e-4,
    )
