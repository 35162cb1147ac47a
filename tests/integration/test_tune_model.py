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


def test_a_model_with_tied_weights_gives_its_shapes_and_stays_as_it_was():
    from tunecache.model_shapes import entries

    class Tied(torch.nn.Module):  # an encoder and decoder sharing one weight, as LMs tie embeddings
        def __init__(self) -> None:
            super().__init__()
            self.enc, self.dec = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
            self.dec.weight = self.enc.weight

        def forward(self, x):
            return self.dec(torch.relu(self.enc(x)))

    model = Tied()
    found, left = entries(model, (8,), 4, "bfloat16")
    assert {e.name for e in found} == {"enc_fwd", "enc_dgrad", "enc_wgrad"} and left == []
    assert model.dec.weight is model.enc.weight and model.enc.weight.dtype == torch.float32
