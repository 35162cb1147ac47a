"""The model-layer benchmark's suite (benchmarks/bench_models.py) holds what it says: every
distinct convolution of ResNet-50 at batch 1, 32 and 128, the SD VAE's (3-channel input and
output), Inception's 1x7 / 7x1, and the Llama-3-8B / 70B and MoE-expert GEMMs at M = 1, 16,
128, 4096 in fp16 and bf16; every layer is a problem the ops accept."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tunecache.shapes import canonical_problem

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_models.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_models", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_models"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_the_suite_holds_the_named_models(bench):
    layers = bench.suite()
    by_model = {}
    for lay in layers:
        by_model.setdefault(lay.model, []).append(lay)
    for batch in (1, 32, 128):
        convs = by_model[f"resnet50-b{batch}"]
        assert len({tuple(sorted(lay.shape.items())) for lay in convs}) == len(convs) == 23
        assert any(lay.shape["R"] == 7 and lay.shape["stride"] == 2 for lay in convs)  # the stem
    vae = by_model["sd-vae"]
    assert any(lay.shape["Ci"] == 3 for lay in vae) and any(lay.shape["Co"] == 3 for lay in vae)
    assert {(lay.shape["R"], lay.shape["S"]) for lay in by_model["inception-v3"]} == {(1, 7), (7, 1)}
    for model in ("llama3-8b", "llama3-70b", "moe-expert"):
        gemms = by_model[model]
        assert {lay.shape["M"] for lay in gemms} == {1, 16, 128, 4096}
        assert {lay.dtype for lay in gemms} == {"float16", "bfloat16"}
    # training layers time all three convolutions, dgrad included
    assert set(by_model["resnet50-b128"][0].ops) == {"conv2d_fprop", "conv2d_wgrad", "conv2d_dgrad"}


def test_every_layer_is_a_problem_the_ops_take(bench):
    for lay in bench.suite():
        if lay.op == "matmul":
            canonical_problem("matmul", {**lay.shape, "dtype": lay.dtype})
        else:
            for op in ("conv2d_fprop", "conv2d_wgrad"):
                canonical_problem(op, {**lay.shape, "dtype": lay.dtype})


def test_list_prints_the_suite_and_a_gpu_run_says_what_it_needs(bench, capsys):
    assert bench.main(["--list", "--only", "inception"]) == 0
    out = capsys.readouterr().out
    assert "Mixed_6b.branch7x7_2" in out and "4 layers" in out
    with pytest.raises(SystemExit):
        bench.main(["--shard", "3/2"])
