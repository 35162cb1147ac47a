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
    monkeypatch.setenv("TUNECACHE_VENDOR", "0")  # else a miss runs torch's op until tuned: the kernels here
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


@pytest.mark.gpu
def test_a_calls_later_launches_run_the_plan_its_first_made_on_any_stream(untuned):
    """The memo entry keeps the backend's direct-launch plan (tunecache.ops.launcher._Launch): the
    second call on runs it, with new data, on another stream, and gives torch's answer."""
    ops.clear_memo()
    dt, cl = torch.bfloat16, torch.channels_last
    x = torch.randn(4, 32, 12, 12, device="cuda", dtype=dt).to(memory_format=cl)
    w = torch.randn(48, 32, 3, 3, device="cuda", dtype=dt).to(memory_format=cl)
    a, b = torch.randn(256, 96, device="cuda", dtype=dt), torch.randn(96, 160, device="cuda", dtype=dt)
    xn, wn = x.permute(0, 2, 3, 1), w.permute(0, 2, 3, 1)
    g = torch.randn(4, 6, 6, 48, device="cuda", dtype=dt)
    calls = {
        "conv2d_fprop": (
            lambda: ops.conv2d_fprop(xn, wn, 2, 1),
            lambda: torch.nn.functional.conv2d(x.float(), w.float(), stride=2, padding=1).permute(0, 2, 3, 1),
        ),
        "conv2d_dgrad": (
            lambda: ops.conv2d_dgrad(g, wn, 12, 12, 2, 1),
            lambda: torch.nn.grad.conv2d_input(
                x.shape, w.float(), g.permute(0, 3, 1, 2).float(), stride=2, padding=1
            ).permute(0, 2, 3, 1),
        ),
        "conv2d_wgrad": (
            lambda: ops.conv2d_wgrad(xn, g, 3, 3, 2, 1),
            lambda: torch.nn.grad.conv2d_weight(
                x.float(), w.shape, g.permute(0, 3, 1, 2).float(), stride=2, padding=1
            ).permute(0, 2, 3, 1),
        ),
        "matmul": (lambda: ops.matmul(a, b), lambda: a.float() @ b.float()),
    }
    side = torch.cuda.Stream()
    for name, (ours, torchs) in calls.items():
        ours(), ours()
        (entry,) = ops.OP_LAUNCHERS[name].memo.values()
        assert entry.kernel.endswith(".hopper"), entry.kernel
        assert entry.run.plan is not None, f"{name}: no plan kept after two launches"
        for t in (x, g, a):
            t.normal_()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            got = ours()
        side.synchronize()
        want = torchs()
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-1 * want.abs().max().item() / 10)


@pytest.mark.gpu
def test_a_pointwise_convs_later_calls_launch_on_the_matmuls_plan(untuned, monkeypatch):
    """A 1x1 conv runs as a matmul; once that matmul's entry has a plan, the conv's calls launch
    on it under the conv's own key (launcher.AsMatmul: no views, no matmul key), with new data
    at the same addresses; at new addresses, or once the matmul's entry is replaced, they take
    the views' path again, and every answer is torch's."""
    import dataclasses

    ops.clear_memo()
    dt = torch.bfloat16
    x = torch.randn(1, 14, 14, 96, device="cuda", dtype=dt)
    w = torch.randn(64, 1, 1, 96, device="cuda", dtype=dt)
    g = torch.randn(1, 14, 14, 64, device="cuda", dtype=dt)
    xn, wn, gn = (t.permute(0, 3, 1, 2).float() for t in (x, w, g))
    F = torch.nn.functional
    calls = {
        "conv2d_fprop": (
            lambda: ops.conv2d_fprop(x, w),
            lambda: F.conv2d(xn, wn).permute(0, 2, 3, 1),
        ),
        "conv2d_wgrad": (
            lambda: ops.conv2d_wgrad(x, g, 1, 1),
            lambda: torch.nn.grad.conv2d_weight(xn, wn.shape, gn).permute(0, 2, 3, 1),
        ),
        "conv2d_dgrad": (
            lambda: ops.conv2d_dgrad(g, w, 14, 14),
            lambda: torch.nn.grad.conv2d_input(xn.shape, wn, gn).permute(0, 2, 3, 1),
        ),
    }
    from tunecache.ops import tuned

    real_run, views = tuned._run_matmul, []

    def counted(raw, a, b):  # the views' path runs the matmul's memo entry through this
        views.append(1)
        return real_run(raw, a, b)

    monkeypatch.setattr(tuned, "_run_matmul", counted)

    def check(got, want):
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())

    for name, (ours, torchs) in calls.items():
        check(ours(), torchs())  # the first call: through the views, makes the plan
        assert len(ops.OP_LAUNCHERS[name].as_matmul) == 1, f"{name}: no launch on the matmul's plan kept"
        views.clear()
        for t in (x, w, g):
            t.normal_()  # new data, the same addresses
        xn, wn, gn = (t.permute(0, 3, 1, 2).float() for t in (x, w, g))
        check(ours(), torchs())
        assert not views, f"{name}: a later call took the views' path"
    # new addresses: the views' path (it caches their descriptors), then the plan again
    x, w, g = x.clone(), w.clone(), g.clone()
    for name, (ours, torchs) in calls.items():
        views.clear()
        check(ours(), torchs())
        assert views, f"{name}: new addresses launched on descriptors of the old ones"
        views.clear()
        check(ours(), torchs())
        assert not views, name
    # the matmul's entry replaced (as a recheck or a fallback does): the conv follows it
    mm = ops.OP_LAUNCHERS["matmul"].memo
    for raw in list(mm):
        mm[raw] = dataclasses.replace(mm[raw])
    for name, (ours, torchs) in calls.items():
        views.clear()
        check(ours(), torchs())
        assert views, f"{name}: kept launching on a matmul entry the memo no longer holds"
