"""Layers never slower than torch's, and computing what torch's compute (issue 39):

- float32 follows torch's precision settings: `torch.backends.cuda.matmul.allow_tf32` (what
  `torch.set_float32_matmul_precision` sets) for matmuls, `torch.backends.cudnn.allow_tf32` for
  convolutions; the precision is part of the key, and the kernel's dot is told it.
- the vendor's op (cuBLAS / cuDNN, as torch calls them) is a config of every space: a stored
  vendor winner runs torch's op, called as a layer's own would (a pointwise conv straight on it,
  a linear or conv layer's bias in the same call).
- the vendor's op wins a tune by GPU time, or, where either takes under HOST_BOUND_MS, by the
  time of calls back to back (each one's host launch included).
- a patch embedding (filter = stride, no padding) runs as the matmul it is.
"""

from __future__ import annotations

import pytest
import torch

from tunecache import ops, shapes
from tunecache.store import default_store
from tunecache_kernels import portable_rules, problems
from tunecache_kernels.spaces import VENDOR, space_for

# these run the kernels on the CPU interpreter (tests/gpu/test_layers_like_torch_gpu.py: on a GPU)
interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU interpreter's (a GPU runs the gpu twin)"
)


@pytest.fixture
def tf32_settings():
    """torch's TF32 switches, restored after the test."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _memo_problems(op: str) -> list[dict]:
    return [e.problem for e in ops.OP_LAUNCHERS[op].memo.values()]


@interpreter_only
def test_fp32_matmul_is_ieee_by_default_and_tf32_only_when_torch_allows_it(db_url, tf32_settings):
    a, b = torch.randn(96, 160, dtype=torch.float64), torch.randn(160, 48, dtype=torch.float64)
    exact = a @ b
    torch.set_float32_matmul_precision("highest")
    c = ops.matmul(a.float(), b.float())
    assert ((c.double() - exact).norm() / exact.norm()).item() <= 1e-5, "IEEE fp32: within 1e-5 of float64"
    torch.set_float32_matmul_precision("high")
    ops.matmul(a.float(), b.float())
    precisions = sorted(p["precision"] for p in _memo_problems("matmul"))
    assert precisions == ["ieee", "tf32"], "one key per precision: a tf32 winner never runs an ieee call"
    digests = {r.key.problem.get("precision") for r in default_store().list_configs()}
    assert digests == {"ieee", "tf32"}


def test_the_dot_is_told_the_precision(tf32_settings):
    config = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}
    a32, a16 = torch.randn(4, 4), torch.randn(4, 4).half()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = True
    assert portable_rules.launch_options(config, a32, "matmul")["INPUT_PRECISION"] == "ieee"
    assert portable_rules.launch_options(config, a32, "conv")["INPUT_PRECISION"] == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = False
    assert portable_rules.launch_options(config, a32, "matmul")["INPUT_PRECISION"] == "tf32"
    assert portable_rules.launch_options(config, a32, "conv")["INPUT_PRECISION"] == "ieee"
    assert portable_rules.launch_options(config, a16, "matmul")["INPUT_PRECISION"] == "tf32"  # unused for halves


def test_conv_precision_follows_cudnn_allow_tf32(tf32_settings):
    x, w = torch.randn(1, 6, 6, 4), torch.randn(8, 3, 3, 4)
    torch.backends.cudnn.allow_tf32 = True
    assert problems.conv2d_fprop_problem(x, w, 1, 1)["precision"] == "tf32"
    torch.backends.cudnn.allow_tf32 = False
    assert problems.conv2d_fprop_problem(x, w, 1, 1)["precision"] == "ieee"
    assert "precision" not in problems.conv2d_fprop_problem(x.half(), w.half(), 1, 1), "halves keep their keys"


def test_a_typed_shape_names_its_precision():
    p = shapes.canonical_problem("matmul", {"M": 8, "N": 8, "K": 8, "dtype": "float32"})
    assert p["precision"] == "ieee", "as torch's matmuls by default"
    p = shapes.canonical_problem("matmul", {"M": 8, "N": 8, "K": 8, "dtype": "float32", "precision": "tf32"})
    assert p["precision"] == "tf32" and shapes.shape_text(p) == "8x8x8 f32/tf32"
    with pytest.raises(ValueError, match="precision is a float32 shape's"):
        shapes.canonical_problem("matmul", {"M": 8, "N": 8, "K": 8, "dtype": "bfloat16", "precision": "tf32"})
    with pytest.raises(ValueError, match="precision must be one of ieee, tf32"):
        shapes.canonical_problem("matmul", {"M": 8, "N": 8, "K": 8, "dtype": "float32", "precision": "fp64"})


def test_the_vendor_is_a_config_of_every_op_space():
    for kernel in ("matmul.hopper", "conv2d_fprop.portable", "conv2d_wgrad.blackwell", "conv2d_dgrad.hopper"):
        space_for(kernel).check(VENDOR)
        assert VENDOR not in list(space_for(kernel)), "it is timed as the vendor, not as a grid point"
    for bad in ({"vendor": False}, {"vendor": True, "BLOCK_M": 64}, {"vendor": 1}):
        with pytest.raises(ValueError):
            space_for("matmul.hopper").check(bad)


def _vendor_won(op: str, *args) -> object:
    """The store holds the vendor's op as the winner of `op`'s key for these arguments (on the
    interpreter's device class); its backend module."""
    from tunecache import backends
    from tunecache.key import interpreter_device
    from tunecache.store.records import ConfigRecord
    from tunecache.tuning.tuner import make_key

    dev, p = interpreter_device(), problems.OP_FUNCTIONS[op].problem(*args)
    mod = backends.backends_for(op, dev, p)[0]
    rec = ConfigRecord(key=make_key(mod, p, dev), config=dict(VENDOR), median_ms=0.01, tflops=None, candidates=5)
    default_store().put_config(rec, [])
    return mod


@interpreter_only
def test_a_stored_vendor_winner_runs_torchs_op(db_url):
    a, b = torch.randn(40, 24), torch.randn(24, 36)
    mod = _vendor_won("matmul", a, b)
    torch.testing.assert_close(ops.matmul(a, b), a @ b)
    (entry,) = ops.OP_LAUNCHERS["matmul"].memo.values()
    assert entry.config == VENDOR and entry.run == mod.reference
    assert default_store().counts()["trials"] == 0, "nothing was tuned"


@pytest.fixture
def views_counted(monkeypatch) -> list:
    """Each call that reaches the matmul's memo through views and its key (not the fast path)."""
    from tunecache.ops import tuned

    real, calls = tuned._run_matmul, []

    def counted(raw, a, b):
        calls.append(raw)
        return real(raw, a, b)

    monkeypatch.setattr(tuned, "_run_matmul", counted)
    return calls


@interpreter_only
def test_a_pointwise_conv_whose_matmul_the_vendor_won_runs_it_without_the_views_path(db_url, views_counted):
    torch.manual_seed(0)
    x, w = torch.randn(2, 5, 6, 24), torch.randn(36, 1, 1, 24)
    _vendor_won("matmul", x.view(60, 24), w.view(36, 24).t())
    torch.testing.assert_close(ops.conv2d_fprop(x, w), problems.conv2d_fprop_reference(x, w))
    assert len(ops.OP_LAUNCHERS["conv2d_fprop"].as_matmul) == 1, "the conv's later calls were not kept"
    views_counted.clear()
    x.normal_(), w.normal_()  # new data at the same addresses
    torch.testing.assert_close(ops.conv2d_fprop(x, w), problems.conv2d_fprop_reference(x, w))
    assert not views_counted, "a later call took the views' path"
    assert default_store().counts()["trials"] == 0, "nothing was tuned"


def _second_call(layer, x: torch.Tensor, grad: bool, counted: list) -> torch.Tensor:
    """The layer's second call on x (the first reads the winner from the store), with `counted`
    emptied between them, autograd recording both where `grad`."""
    with torch.set_grad_enabled(grad):
        layer(x)
        counted.clear()
        return layer(x)


@interpreter_only
@pytest.mark.parametrize("grad", [False, True])
def test_a_linear_layer_whose_matmul_the_vendor_won_adds_its_bias_in_the_same_launch(db_url, views_counted, grad):
    import tunecache.nn

    torch.manual_seed(0)
    ref = torch.nn.Linear(24, 36)
    lin = tunecache.nn.convert(torch.nn.Linear(24, 36))
    lin.load_state_dict(ref.state_dict())
    x = torch.randn(10, 24, requires_grad=grad)
    _vendor_won("matmul", x, lin.weight.t())
    y = _second_call(lin, x, grad, views_counted)
    torch.testing.assert_close(y, ref(x))
    assert not views_counted, "the product and its bias ran apart (the tuned matmul, then an add)"
    if grad:
        y.sum().backward()
        torch.testing.assert_close(lin.bias.grad, torch.full((36,), 10.0))


@interpreter_only
@pytest.mark.parametrize("grad", [False, True])
def test_a_conv_layer_whose_conv_the_vendor_won_runs_torchs_conv_with_its_bias(db_url, monkeypatch, grad):
    import tunecache.nn
    from tunecache.ops import tuned

    torch.manual_seed(0)
    ref = torch.nn.Conv2d(6, 10, 3, padding=1)
    conv = tunecache.nn.convert(torch.nn.Conv2d(6, 10, 3, padding=1))
    conv.load_state_dict(ref.state_dict())
    x = torch.randn(2, 6, 5, 7).to(memory_format=torch.channels_last).requires_grad_(grad)
    xn, wn = x.detach().permute(0, 2, 3, 1), conv.weight.detach().permute(0, 2, 3, 1).contiguous()
    _vendor_won("conv2d_fprop", xn, wn, 1, 1)
    real, ours = tuned._conv2d_fprop, []  # the NHWC conv of a layer's call
    monkeypatch.setattr(tuned, "_conv2d_fprop", lambda *a: ours.append(1) or real(*a))
    y = _second_call(conv, x, grad, ours)
    torch.testing.assert_close(y, ref(x))
    assert not ours, "the layer ran the NHWC conv and its bias apart, not torch's conv"
    if grad:
        y.sum().backward()
        torch.testing.assert_close(conv.bias.grad, torch.full((10,), 2.0 * 5 * 7))


@pytest.mark.parametrize("hw", [(8, 12), (9, 14)])  # whole patches, and a border no patch reaches
def test_a_patch_embedding_runs_as_the_matmul_it_is(db_url, hw):
    torch.manual_seed(0)
    H, W = hw
    x, w = torch.randn(2, H, W, 3), torch.randn(5, 4, 4, 3)
    y = ops.conv2d_fprop(x, w, 4, 0)
    torch.testing.assert_close(y, problems.conv2d_fprop_reference(x, w, 4, 0), rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    gw = ops.conv2d_wgrad(x, g, 4, 4, 4, 0)
    torch.testing.assert_close(gw, problems.conv2d_wgrad_reference(x, g, 4, 4, 4, 0), rtol=1e-5, atol=1e-5)
    gx = ops.conv2d_dgrad(g, w, H, W, 4, 0)
    torch.testing.assert_close(gx, problems.conv2d_dgrad_reference(g, w, H, W, 4, 0), rtol=1e-5, atol=1e-5)
    tuned = {op: len(o.memo) for op, o in ops.OP_LAUNCHERS.items()}
    assert tuned["conv2d_fprop"] == tuned["conv2d_wgrad"] == tuned["conv2d_dgrad"] == 0, tuned
    assert tuned["matmul"] == 3, "fprop, wgrad and dgrad each one matmul"


class _Timed:
    """A trial runner's answers: GPU times given, loop times (calls back to back) as given."""

    def __init__(self, kernel_loop_ms: float, vendor_loop_ms: float) -> None:
        self.kernel_loop_ms, self.vendor_loop_ms = kernel_loop_ms, vendor_loop_ms

    def run(self, config, timing, check=True):
        assert timing.get("loop_calls"), timing
        return {"status": "ok", "median_ms": self.kernel_loop_ms}

    def vendor_ms(self, timing):
        assert timing.get("loop_calls"), timing
        return self.vendor_loop_ms


@pytest.mark.parametrize(
    "kernel_ms,vendor_ms,loops,vendor_wins",
    [
        (1.0, 0.9, None, True),  # GPU-bound: the faster GPU time wins
        (0.99, 1.0, None, True),  # a kernel faster by less than VENDOR_MARGIN: the vendor, the safe side
        (0.96, 1.0, None, False),  # beyond it: the kernel
        (0.010, 0.008, (0.012, 0.038), False),  # host-bound: cuBLAS faster on the GPU, slower in a loop
        (0.010, 0.012, (0.030, 0.015), True),  # host-bound: the kernel's launch costs more
    ],
)
def test_the_vendor_wins_by_gpu_time_or_where_the_host_bounds_by_calls_back_to_back(
    kernel_ms, vendor_ms, loops, vendor_wins
):
    from tunecache.store.records import TrialRecord
    from tunecache.tuning.tuner import _vendor_wins

    runner = _Timed(*(loops or (float("nan"), float("nan"))))
    timeline: dict = {}
    best = TrialRecord({"BLOCK_M": 64}, "ok", median_ms=kernel_ms)
    assert _vendor_wins(runner, best, vendor_ms, timeline) is vendor_wins
    assert ("loop_us_kernel" in timeline) is (loops is not None)
