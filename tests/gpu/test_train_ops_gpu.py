"""On a GPU: a converted model trains through the tuned ops (bf16, channels_last) with torch's
gradients, torch.compile captures it in one graph, and a CUDA graph captures a tuned call."""

from __future__ import annotations

import pytest
import torch

import tunecache.nn as tnn
from tunecache import ops


@pytest.fixture
def untuned(db_url, monkeypatch):
    monkeypatch.setenv("TUNECACHE_MISS_POLICY", "default")  # the default configs: no tuning in a test
    yield


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(64 * 8 * 8, 128),
    )


@pytest.mark.gpu
def test_a_converted_model_gives_torchs_loss_and_gradients_and_compiles_to_one_graph(untuned):
    ref = _net().to("cuda", torch.bfloat16, memory_format=torch.channels_last)
    ours = tnn.convert(_net()).to("cuda", torch.bfloat16, memory_format=torch.channels_last)
    x = torch.randn(32, 16, 16, 16, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    for model in (ours, torch.compile(ours, fullgraph=True)):
        for m in (ref, model):
            m.zero_grad()
        loss_ref, loss = ref(x).float().square().mean(), model(x).float().square().mean()
        loss_ref.backward()
        loss.backward()
        torch.testing.assert_close(loss, loss_ref, rtol=2e-2, atol=1e-3)
        for (name, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
            err = ((p.grad.float() - q.grad.float()).norm() / q.grad.float().norm()).item()
            assert err < 3e-2, f"{name}: relative gradient error {err}"


@pytest.mark.gpu
def test_a_cuda_graph_captures_a_tuned_call(untuned):
    a = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, 32, 16, 16, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    w = torch.randn(64, 32, 3, 3, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    ops.matmul(a, b), ops.conv2d(x, w, padding=1)  # decided (and compiled) before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c = ops.matmul(a, b)
        y = ops.conv2d(x, w, padding=1)
    a.normal_(), x.normal_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(c.float(), (a.float() @ b.float()), rtol=2e-2, atol=2e-1)
    torch.testing.assert_close(
        y.float(), torch.nn.functional.conv2d(x.float(), w.float(), padding=1), rtol=2e-2, atol=2e-1
    )
