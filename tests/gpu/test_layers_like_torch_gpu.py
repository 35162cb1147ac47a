"""On a GPU (issue 39): float32 computes what torch's does at torch's precision, a tune is never
slower than the vendor's op it times beside its candidates, and a ViT's patch embedding runs as
the matmul it is."""

from __future__ import annotations

import time

import pytest
import torch

from tunecache import ops
from tunecache.key import device_of
from tunecache.tuning.timing import HOST_BOUND_MS
from tunecache.tuning.tuner import VENDOR_MARGIN
from tunecache_kernels import problems
from tunecache_kernels.spaces import is_vendor


@pytest.fixture
def tf32_settings():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.gpu
def test_fp32_matmul_at_highest_precision_is_ieee(db_url, tf32_settings):
    torch.manual_seed(0)
    a64 = torch.randn(512, 512, device="cuda", dtype=torch.float64)
    b64 = torch.randn(512, 512, device="cuda", dtype=torch.float64)
    exact = a64 @ b64
    torch.set_float32_matmul_precision("highest")
    c = ops.matmul(a64.float(), b64.float())
    err = ((c.double() - exact).norm() / exact.norm()).item()
    assert err <= 1e-5, f"precision 'highest': relative error {err:.2e} vs float64 (TF32 gives ~1e-3)"
    torch.set_float32_matmul_precision("high")
    c = ops.matmul(a64.float(), b64.float())
    err = ((c.double() - exact).norm() / exact.norm()).item()
    assert err <= 5e-3, f"precision 'high' (TF32 allowed): relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "op,args",
    [
        ("matmul", lambda: (torch.randn(64, 64, device="cuda").half(), torch.randn(64, 64, device="cuda").half())),
        (
            "conv2d_fprop",
            lambda: (
                torch.randn(1, 7, 7, 64, device="cuda", dtype=torch.bfloat16),
                torch.randn(64, 3, 3, 64, device="cuda", dtype=torch.bfloat16),
                1,
                1,
            ),
        ),
    ],
)
def test_a_tune_is_never_slower_than_the_vendor_it_timed(db_url, op, args):
    from tunecache import backends
    from tunecache.tuning.tuner import tune

    inputs = args()
    mod_problem = {"matmul": problems.matmul_problem, "conv2d_fprop": problems.conv2d_fprop_problem}[op]
    p = mod_problem(*inputs)
    dev = device_of(inputs[0])
    mod = backends.backends_for(op, dev, p)[0]
    result = tune(mod, p, dev)
    assert result.vendor_ms is not None
    loops = result.timeline.get("loop_us_kernel"), result.timeline.get("loop_us_vendor")
    if min(result.median_ms, result.vendor_ms) < HOST_BOUND_MS:  # host-bound: judged by calls back to back
        assert None not in loops, result.timeline
        ours = loops[1] if is_vendor(result.config) else loops[0]
        assert ours <= min(loops) / (1 - VENDOR_MARGIN), (result.config, loops)
    else:
        assert result.median_ms <= result.vendor_ms, (result.config, result.median_ms, result.vendor_ms)
    if is_vendor(result.config):
        assert result.median_ms == result.vendor_ms and not result.binaries


@pytest.mark.gpu
def test_a_vit_patch_embedding_runs_as_a_matmul_and_its_first_call_is_quick(db_url):
    torch.manual_seed(0)
    x = torch.randn(8, 224, 224, 3, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(768, 16, 16, 3, device="cuda", dtype=torch.bfloat16) * 0.05
    t0 = time.perf_counter()
    y = ops.conv2d_fprop(x, w, 16, 0)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    ref = problems.conv2d_fprop_reference(x, w, 16, 0)
    err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 2e-2, err
    assert not ops.OP_LAUNCHERS["conv2d_fprop"].memo, "no conv kernel is tuned for a patch embedding"
    assert first < 15, f"first call {first:.1f} s"


@pytest.mark.gpu
def test_a_converted_model_trains_under_torch_compile_with_cuda_graphs(db_url):
    """torch.compile(mode="reduce-overhead"): the tunecache layers' steps are captured in CUDA
    graphs (none skipped) and replayed, and compute what the eager steps do. The buffers the
    kernels keep across calls are made outside the graphs' memory pool, which a graph's warm-up
    would otherwise find holding tensors that are no output of it."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import tunecache.nn

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        m = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1, bias=False),
            torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(64, 10),
        )
        return tunecache.nn.convert(m).to("cuda", torch.bfloat16, memory_format=torch.channels_last)

    g = torch.Generator(device="cuda").manual_seed(1)
    data = [
        (
            torch.randn(16, 3, 32, 32, device="cuda", dtype=torch.bfloat16, generator=g).contiguous(
                memory_format=torch.channels_last
            ),
            torch.randint(0, 10, (16,), device="cuda", generator=g),
        )
        for _ in range(5)
    ]

    def train(m: torch.nn.Module, run) -> list[float]:
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        losses = []
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(run(x).float(), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    eager_model = model()
    eager = train(eager_model, eager_model)
    torch._dynamo.reset()
    counters.clear()
    graphed_model = model()
    graphed = train(graphed_model, torch.compile(graphed_model, mode="reduce-overhead"))
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=5e-2, atol=5e-2)
