"""Small models for the tests that read shapes from a model (`tunecache manifest --from-model
support.models:tiny_convnet`, with tests/ on the import path)."""

from __future__ import annotations

import torch


def tiny_convnet() -> torch.nn.Module:
    """For an input of (N, 3, 8, 8): a strided stem, a 3x3 that widens, a grouped conv (left to
    torch), a 1x1 that narrows, a strided 1x1 (a downsample), a head."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, padding=1),
        torch.nn.Conv2d(16, 16, 3, padding=1, groups=2),
        torch.nn.Conv2d(16, 8, 1),
        torch.nn.Conv2d(8, 8, 1, stride=2),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 2 * 2, 10),
    )


def asymmetric_convnet() -> torch.nn.Module:
    """For an input of (N, 4, 9, 8): Inception's 1xk / kx1 pair (per-axis padding) and a
    conv strided on one axis (its input gradient splits into output phases)."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(4, 6, (1, 3), padding=(0, 1)),
        torch.nn.Conv2d(6, 6, (3, 1), stride=(2, 1), padding=(1, 0)),
        torch.nn.Conv2d(6, 5, 3, stride=2, padding=1),
        torch.nn.Flatten(),
    )
