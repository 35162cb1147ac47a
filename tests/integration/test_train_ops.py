"""Train with it (CPU, on Triton's interpreter): `tunecache.ops.conv2d` / `linear` and the
custom ops under them give torch's gradients, pass `torch.library.opcheck`, and
`torch.compile(fullgraph=True)` captures a model built on `tunecache.nn` layers."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import tunecache.nn as tnn
from tunecache import ops  # noqa: F401  (custom_ops registers torch.ops.tunecache.*)
from tunecache.ops import custom as custom_ops


@pytest.fixture
def untuned(db_url, monkeypatch):
    """Policy `default`: each shape runs the backend's default config at once (no tuning on
    the interpreter), which is what the ops compute with until a worker has tuned them."""
    monkeypatch.setenv("TUNECACHE_MISS_POLICY", "default")
    yield


def _grads(fn, *inputs, grad_out_seed=1):
    out = fn(*inputs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_out_seed))
    return (out, *torch.autograd.grad(out, inputs, g))


@pytest.mark.parametrize("stride", [1, 2, 3])
@pytest.mark.parametrize("padding", [0, 1, 2])
def test_conv2d_gives_torchs_output_and_gradients(untuned, stride, padding):
    torch.manual_seed(stride * 10 + padding)
    x = torch.randn(2, 3, 9, 8, requires_grad=True)  # 3 input channels, odd sizes
    w = torch.randn(5, 3, 3, 3, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    ours = _grads(lambda x, w, b: ops.conv2d(x, w, b, stride, padding), x, w, b)
    torchs = _grads(lambda x, w, b: F.conv2d(x, w, b, stride, padding), x, w, b)
    for name, o, t in zip(("y", "grad_x", "grad_w", "grad_b"), ours, torchs):
        torch.testing.assert_close(o, t, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    "kernel,stride,padding", [(1, 2, 0), (1, 3, 0), (3, 2, 1), (7, 2, 3), (2, 3, 0)], ids=lambda v: str(v)
)
def test_a_strided_convs_input_gradient_is_tunecaches_own(untuned, monkeypatch, kernel, stride, padding):
    """Its input's gradient is the dgrad kernel over every output phase, PyTorch's dgrad never
    called: ResNet's stem (7x7/2), its strided 3x3s and 1x1s, and a filter smaller than its
    stride (phases no tap reaches are zeros)."""

    def refuse(*args, **kwargs):
        raise AssertionError("torch.nn.grad.conv2d_input was called")

    monkeypatch.setattr(torch.nn.grad, "conv2d_input", refuse)
    torch.manual_seed(kernel * 10 + stride)
    x = torch.randn(2, 5, 11, 10, requires_grad=True)
    w = torch.randn(4, 5, kernel, kernel, requires_grad=True)
    ours = _grads(lambda x, w: ops.conv2d(x, w, stride=stride, padding=padding), x, w)
    torchs = _grads(lambda x, w: F.conv2d(x, w, stride=stride, padding=padding), x, w)
    for name, o, t in zip(("y", "grad_x", "grad_w"), ours, torchs):
        torch.testing.assert_close(o, t, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_conv2d_reads_channels_last_tensors_in_place(untuned):
    x = torch.randn(2, 4, 6, 6).to(memory_format=torch.channels_last)
    w = torch.randn(8, 4, 1, 1).to(memory_format=torch.channels_last)
    y = ops.conv2d(x, w, stride=2)
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, F.conv2d(x, w, stride=2), rtol=1e-4, atol=1e-4)


def test_linear_and_matmul_give_torchs_output_and_gradients(untuned):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 7, requires_grad=True)  # a batch of sequences: the leading dims are flattened
    w = torch.randn(6, 7, requires_grad=True)
    b = torch.randn(6, requires_grad=True)
    for o, t in zip(_grads(ops.linear, x, w, b), _grads(F.linear, x, w, b)):
        torch.testing.assert_close(o, t, rtol=1e-4, atol=1e-4)
    a, c = torch.randn(9, 4, requires_grad=True), torch.randn(4, 11, requires_grad=True)
    mm = torch.ops.tunecache.matmul
    for o, t in zip(_grads(mm, a, c), _grads(torch.mm, a, c)):
        torch.testing.assert_close(o, t, rtol=1e-4, atol=1e-4)


def test_the_custom_ops_pass_opcheck(untuned):
    torch.manual_seed(0)
    x = torch.randn(2, 7, 7, 3, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    g = torch.randn(2, 4, 4, 4)
    for op, args in (
        (torch.ops.tunecache.matmul.default, (torch.randn(5, 6, requires_grad=True), torch.randn(6, 3))),
        (torch.ops.tunecache.conv2d_nhwc.default, (x, w, [2, 2], [1, 1])),
        (torch.ops.tunecache.conv2d_wgrad_nhwc.default, (x.detach(), g, 3, 3, [2, 2], [1, 1])),
        (torch.ops.tunecache.conv2d_dgrad_nhwc.default, (g, w.detach(), 7, 7, [2, 2], [1, 1])),
    ):
        torch.library.opcheck(op, args)


def test_nn_layers_are_torchs_with_the_same_state_and_convert_leaves_what_they_cannot_take(untuned, caplog):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, groups=2),  # grouped: torch keeps it
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 4 * 4, 10),
    )
    before = {k: v for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 6, 6)
    expected = model(x)
    with caplog.at_level(logging.WARNING, logger="tunecache"):
        assert tnn.convert(model) is model
    assert [type(m) for m in model] == [tnn.Conv2d, torch.nn.ReLU, torch.nn.Conv2d, torch.nn.Flatten, tnn.Linear]
    assert isinstance(model[0], torch.nn.Conv2d) and isinstance(model[4], torch.nn.Linear)
    assert "convert left 1 convolution(s) to torch: 2: groups=2" in caplog.text
    after = model.state_dict()
    assert list(after) == list(before) and all(after[k] is before[k] or after[k].equal(before[k]) for k in before)
    torch.testing.assert_close(model(x), expected, rtol=1e-4, atol=1e-4)
    # a layer built directly takes torch.nn's arguments and loads torch.nn's state dict
    conv = tnn.Conv2d(3, 8, 3, padding=1)
    conv.load_state_dict(model[0].state_dict())
    torch.testing.assert_close(conv(x), model[0](x))


def test_a_layer_falls_back_to_torch_with_one_warning_for_what_the_kernels_do_not_take(untuned, caplog):
    conv = tnn.Conv2d(3, 4, 3).double()
    x = torch.randn(1, 3, 5, 5, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="tunecache"):
        torch.testing.assert_close(conv(x), F.conv2d(x, conv.weight, conv.bias))
        conv(x)
    assert caplog.text.count("dtype torch.float64") == 1


def test_torch_compile_captures_a_model_built_on_them_in_one_graph(untuned, tmp_path, monkeypatch):
    # Inductor's caches of its own: a shared one may hold graphs another version of these ops
    # compiled (their backward is cached with the forward's key)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    model = tnn.convert(
        torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3, stride=2, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(36, 5)
        )
    )
    x = torch.randn(2, 3, 6, 6)
    eager = _grads(lambda x: model(x), x.requires_grad_())
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)  # inductor; a graph break raises here
    got = _grads(lambda x: compiled(x), x)
    for o, t in zip(got, eager):
        torch.testing.assert_close(o, t, rtol=1e-4, atol=1e-4)


def test_eager_training_skips_the_custom_ops_dispatch(untuned, monkeypatch):
    """Outside torch.compile a layer's forward and backward call the ops directly (a custom
    op's dispatch costs more host time than a launch); the gradients are the same."""

    def refuse(*args, **kwargs):
        raise AssertionError("a custom op was dispatched in eager mode")

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, stride=2, padding=1), torch.nn.Flatten(), torch.nn.Linear(36, 5)
    )
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    g = torch.randn(2, 5)

    def grads():
        model.zero_grad()
        x.grad = None
        model(x).backward(g)
        return [x.grad] + [p.grad for p in model.parameters()]

    torchs = grads()
    tnn.convert(model)
    for name in ("conv2d_nhwc", "conv2d_dgrad_nhwc", "conv2d_wgrad_nhwc", "matmul"):
        monkeypatch.setattr(custom_ops, name, refuse)
    for o, t in zip(grads(), torchs, strict=True):
        torch.testing.assert_close(o, t, rtol=1e-4, atol=1e-4)


def test_an_eager_layer_is_one_autograd_node(untuned):
    """A converted conv or linear layer records one node (its permutes, reshapes and bias run
    inside it: each view or add would be a node of its own for the backward pass to visit), whose
    inputs are the layer's parameters and input themselves."""
    torch.manual_seed(0)
    conv = tnn.convert(torch.nn.Conv2d(3, 4, 3, padding=1)).to(memory_format=torch.channels_last)
    lin = tnn.convert(torch.nn.Linear(6, 5))
    x = torch.randn(2, 3, 6, 6, requires_grad=True).to(memory_format=torch.channels_last)
    for layer, inp in ((conv, x), (lin, torch.randn(2, 7, 6, requires_grad=True))):
        node = layer(inp).grad_fn
        inputs = [fn for fn, _ in node.next_functions]
        leaves = [getattr(fn, "variable", None) for fn in inputs]
        assert leaves[1] is layer.weight and leaves[2] is layer.bias, [type(fn).__name__ for fn in inputs]
        assert inputs[0] is inp.grad_fn or leaves[0] is inp, [type(fn).__name__ for fn in inputs]


def test_under_autocast_the_layers_run_in_its_precision_as_torchs_do(untuned):
    """Mixed precision training (fp32 parameters, `torch.autocast`): a converted model's conv and
    linear layers take autocast's dtype as torch's do, and the parameters get fp32 gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(4, 8, 3, stride=2, padding=1), torch.nn.Flatten(), torch.nn.Linear(8 * 3 * 3, 5)
    )
    x = torch.randn(2, 4, 6, 6)

    def run(m):
        m.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = [m[0](x), m(x)]
            outs[1].float().square().sum().backward()
        return outs, [p.grad for p in m.parameters()]

    (t_conv, t_out), t_grads = run(model)
    (o_conv, o_out), o_grads = run(tnn.convert(model))
    assert (o_conv.dtype, o_out.dtype) == (t_conv.dtype, t_out.dtype) == (torch.bfloat16, torch.bfloat16)
    torch.testing.assert_close(o_out, t_out, rtol=2e-2, atol=2e-2)
    for o, t in zip(o_grads, t_grads, strict=True):
        assert o.dtype == t.dtype == torch.float32
        torch.testing.assert_close(o, t, rtol=5e-2, atol=5e-2)


TRAIN_SCRIPT = """
import torch
import tunecache.nn
model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 1, stride=2),
                            torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 5))
tunecache.nn.convert(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
for step in range(2):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
print("trained")
"""


def _plain_script(tmp_path, code: str):
    """A user's script: a file with no __main__ guard, run fresh with default settings on a
    CPU-only machine (no TRITON_INTERPRET, the default store in its own cache dir)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TUNECACHE_", "TRITON_INTERPRET"))}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)


def test_a_plain_training_script_runs_the_kernels_on_a_cpu_only_machine(tmp_path):
    """torch may import Triton inside the custom ops' dispatch, before the first launch: the
    interpreter must be chosen when tunecache.ops is imported, or every launch falls back."""
    proc = _plain_script(tmp_path, TRAIN_SCRIPT)
    assert proc.returncode == 0 and "trained" in proc.stdout, proc.stderr[-3000:]
    assert "falls back" not in proc.stderr and "raised" not in proc.stderr, proc.stderr[-3000:]


def test_a_script_that_imports_triton_first_is_told_why_the_ops_run_torchs(tmp_path):
    proc = _plain_script(tmp_path, "import triton\n" + TRAIN_SCRIPT)
    assert proc.returncode == 0 and "trained" in proc.stdout, proc.stderr[-3000:]
    assert "Triton was imported before tunecache chose its CPU interpreter" in proc.stderr, proc.stderr[-3000:]


def _pairs(lo: int, hi: int):
    return st.tuples(st.integers(lo, hi), st.integers(lo, hi))


@settings(max_examples=60, deadline=None)
@given(size=_pairs(1, 9), kernel=_pairs(1, 5), stride=_pairs(1, 4), padding=_pairs(0, 3), ci=st.integers(1, 9))
def test_the_dgrad_kernels_phases_add_up_to_torchs_for_any_geometry(size, kernel, stride, padding, ci):
    """The phase plan every dgrad kernel walks (which taps reach which rows and columns of
    grad_x, where each phase starts, the phases no tap reaches), run by the portable kernel on
    the interpreter: any size, filter, stride, padding and channel count a forward convolution takes."""
    from tunecache_kernels import conv2d_dgrad_portable as dgrad

    (h, w), (r, s), (sh, sw), (ph, pw) = size, kernel, stride, padding
    assume(h + 2 * ph >= r and w + 2 * pw >= s)
    x = torch.randn(2, ci, h, w)
    wt = torch.randn(3, ci, r, s)
    g = torch.randn_like(F.conv2d(x, wt, stride=(sh, sw), padding=(ph, pw)))
    want = torch.nn.grad.conv2d_input(x.shape, wt, g, stride=(sh, sw), padding=(ph, pw))
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    got = dgrad.launch(
        config, g.permute(0, 2, 3, 1).contiguous(), wt.permute(0, 2, 3, 1).contiguous(), h, w, (sh, sw), (ph, pw)
    )
    torch.testing.assert_close(got.permute(0, 3, 1, 2), want, rtol=1e-4, atol=1e-4)
