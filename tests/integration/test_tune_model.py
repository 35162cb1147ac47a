"""`tunecache.tune_model(model, example)` tunes every shape a model's training step asks of the
ops before that step: the step then meets no miss (policy `strict` would raise on one), and the
model itself is left as it was (its parameters, device and training mode)."""

from __future__ import annotations

import pytest
import torch

import tunecache
import tunecache.nn as tnn


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 5)
    )


def test_after_tune_model_a_training_step_meets_no_miss_and_the_model_is_untouched(db_url, monkeypatch):
    model = tnn.convert(_model()).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 6, 6)

    report = tunecache.tune_model(model, x)

    assert report.failed == [] and report.tuned >= 4, report  # fprop, wgrad; the linear's 3 GEMMs
    assert model.training and all(p.device.type == "cpu" for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    monkeypatch.setenv("TUNECACHE_MISS_POLICY", "strict")  # a miss now raises MissingConfig
    tunecache.ops.clear_memo()
    model(x).square().mean().backward()
    assert tunecache.tune_model(model, x).already == report.total  # a second call tunes nothing


def test_tune_model_says_what_is_wrong_with_its_arguments():
    with pytest.raises(TypeError, match="example"):
        tunecache.tune_model(_model(), [2, 3, 6, 6])
    with pytest.raises(TypeError, match="float64"):
        tunecache.tune_model(_model().double(), torch.randn(2, 3, 6, 6, dtype=torch.float64))
