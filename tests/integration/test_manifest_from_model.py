"""`tunecache manifest --from-model` writes the shapes a model's training step asks of the ops:
pre-tuning that manifest leaves no miss in the step (the keys are the ones the step looks up)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from support import ROOT, TESTS


def manifest_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "tunecache.cli", "manifest", *args], env=env, capture_output=True, text=True, cwd=ROOT
    )


def test_the_manifest_of_a_model_holds_exactly_the_keys_its_training_step_looks_up(db_url, tmp_path, monkeypatch):
    path = tmp_path / "tiny.toml"
    proc = manifest_cli(
        "--from-model",
        "support.models:tiny_convnet",
        "--batch",
        "2",
        "--input",
        "3,8,8",
        "--dtype",
        "float32",
        "-o",
        str(path),
    )
    assert proc.returncode == 0, proc.stderr
    # 4 convs: fprop and wgrad each, and dgrad for the 3 whose input needs a gradient (the
    # pointwise 1x1's fprop, dgrad and (over few pixels) wgrad are the matmuls they are, entries
    # of their own); 3 GEMMs
    assert "9 distinct problem(s), 14 tuning job(s)" in proc.stderr, proc.stderr
    assert "left to torch: 1 layer(s) (3: groups=2" in proc.stderr, proc.stderr

    from tunecache.fleet.pretune import load_manifest, plan
    from tunecache.key import local_device

    planned = {p.key.digest for p in plan(load_manifest(path), local_device())}

    # a training step of the converted model, policy default: every miss is queued in the store
    monkeypatch.setenv("TUNECACHE_MISS_POLICY", "default")
    import tunecache.nn as tnn
    from support.models import tiny_convnet
    from tunecache.store import default_store

    model = tnn.convert(tiny_convnet())
    x = torch.randn(2, 3, 8, 8)
    model(x).square().mean().backward()
    queued = {j.key.digest for j in default_store().list_jobs()}
    assert queued == planned


def test_per_axis_strides_and_paddings_and_phased_input_gradients_are_in_the_manifest(db_url, tmp_path, monkeypatch):
    path = tmp_path / "asym.toml"
    proc = manifest_cli(
        "--from-model", "support.models:asymmetric_convnet", "--batch", "2", "--input", "4,9,8", "--dtype",
        "float32", "-o", str(path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    text = path.read_text()
    assert "pad_w = 1" in text and "stride_h = 2" in text

    from tunecache.fleet.pretune import load_manifest, plan
    from tunecache.key import local_device

    planned = {p.key.digest for p in plan(load_manifest(path), local_device())}
    monkeypatch.setenv("TUNECACHE_MISS_POLICY", "default")
    import tunecache.nn as tnn
    from support.models import asymmetric_convnet
    from tunecache.store import default_store

    model = tnn.convert(asymmetric_convnet())
    x = torch.randn(2, 4, 9, 8)
    model(x).square().mean().backward()
    assert {j.key.digest for j in default_store().list_jobs()} == planned


def test_a_model_that_cannot_be_built_or_run_is_a_clear_error(tmp_path):
    bad = manifest_cli("--from-model", "support.models")
    assert bad.returncode == 2 and "MODULE:FACTORY" in bad.stderr
    bad = manifest_cli("--from-model", "support.models:nope")
    assert bad.returncode == 2 and "has no callable 'nope'" in bad.stderr
    bad = manifest_cli("--from-model", "support.models:tiny_convnet", "--input", "5,8,8")
    assert bad.returncode == 2 and "meta device" in bad.stderr and "(1, 5, 8, 8)" not in bad.stderr
