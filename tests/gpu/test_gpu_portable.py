"""On a GPU, the three ops tune and run through the portable kernels and match torch."""

from __future__ import annotations

import pytest
import torch

from tunecache import ops
from tunecache.store import default_store
from tunecache_kernels import problems as P

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _portable(db_url, monkeypatch):
    monkeypatch.setenv("TUNECACHE_BACKEND", "portable")
    monkeypatch.setenv("TUNECACHE_MAX_CANDIDATES", "6")  # tuning breadth is the benchmark's job


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def test_each_op_tunes_once_then_runs_from_the_store():
    a = torch.randn(512, 256, device="cuda", dtype=torch.float16)
    b = torch.randn(256, 384, device="cuda", dtype=torch.float16)
    x = torch.randn(8, 20, 20, 32, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(48, 3, 3, 32, device="cuda", dtype=torch.bfloat16)
    y = ops.conv2d_fprop(x, w, stride=1, padding=1)
    g = torch.randn_like(y)
    runs = [
        lambda: ops.matmul(a, b),
        lambda: ops.conv2d_fprop(x, w, stride=1, padding=1),
        lambda: ops.conv2d_wgrad(x, g, 3, 3, stride=1, padding=1),
    ]
    refs = [
        a.float() @ b.float(),
        P.conv2d_fprop_reference(x.float(), w.float(), 1, 1),
        P.conv2d_wgrad_reference(x.float(), g.float(), 3, 3, 1, 1),
    ]
    outs = [run() for run in runs]
    counts = default_store().counts()
    assert counts["tuned_configs"] == 3 and counts["trials"] >= 3
    ops.clear_memo()  # as a fresh process would: memo empty, store warm
    for run, ref, first in zip(runs, refs, outs):
        out = run()
        assert _rel(out, ref) < 2e-2
        assert torch.equal(out, first)
    assert default_store().counts()["trials"] == counts["trials"]


@pytest.fixture
def _defaults(monkeypatch):
    # the correctness grid runs the default configs; tuning is exercised above
    monkeypatch.setenv("TUNECACHE_MISS_POLICY", "default")
    monkeypatch.setenv("TUNECACHE_VENDOR", "0")  # else a miss runs torch's op until tuned: the kernels here


@pytest.mark.usefixtures("_defaults")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,N,K", [(1, 64, 64), (257, 129, 100), (1024, 1024, 1024)])
def test_matmul_matches(dtype, M, N, K):
    a = torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(N, K, device="cuda", dtype=dtype).t()  # column-major b
    assert _rel(ops.matmul(a, b), a.float() @ b.float()) < 1e-2


CONV = [
    (1, 14, 14, 3, 8, 3, 3, 1, 1),
    (128, 28, 28, 64, 64, 3, 3, 2, 1),
    (4, 9, 11, 17, 31, 5, 5, 3, 0),
    (2, 8, 8, 32, 16, 1, 1, 1, 0),
    (2, 10, 12, 8, 24, 2, 3, (1, 2), (0, 1)),
    (1, 7, 7, 5, 3, 4, 4, 2, 1),
]


@pytest.mark.usefixtures("_defaults")
@pytest.mark.parametrize("N,H,W,Ci,Co,R,S,stride,padding", CONV)
def test_conv_fprop_and_wgrad_match(N, H, W, Ci, Co, R, S, stride, padding):
    x = torch.randn(N, H, W, Ci, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(Co, R, S, Ci, device="cuda", dtype=torch.bfloat16)
    y = ops.conv2d_fprop(x, w, stride=stride, padding=padding)
    assert _rel(y, P.conv2d_fprop_reference(x.float(), w.float(), stride, padding)) < 2e-2
    g = torch.randn_like(y)
    gw = ops.conv2d_wgrad(x, g, R, S, stride=stride, padding=padding)
    assert _rel(gw, P.conv2d_wgrad_reference(x.float(), g.float(), R, S, stride, padding)) < 2e-2
