"""The ops: tuned once per (kernel, device class, shape), then launched from the memo.

y = tunecache.ops.conv2d_fprop(x, w, stride=1, padding=1)     # NHWC
gw = tunecache.ops.conv2d_wgrad(x, grad_out, R, S, stride=1, padding=0)
gx = tunecache.ops.conv2d_dgrad(grad_out, w, H, W, stride=1, padding=0)
c = tunecache.ops.matmul(a, b)

With autograd and torch.compile (torch.library custom ops, `tunecache.ops.custom`), in the
calls of torch.nn.functional:

y = tunecache.ops.conv2d(x, weight, bias, stride=1, padding=1)   # NCHW (channels_last: no copies)
y = tunecache.ops.linear(x, weight, bias)
"""

from __future__ import annotations

import torch

from tunecache.key import use_interpreter_without_gpu

# now, before the modules below import Triton (the kernels' host code does; torch's custom ops'
# dispatch may too): Triton must know by then whether it interprets
use_interpreter_without_gpu()

from tunecache.ops.tuned import (  # noqa: E402
    OP_LAUNCHERS,
    clear_memo,
    conv2d_dgrad,
    conv2d_fprop,
    conv2d_wgrad,
    matmul,
)
from tunecache_kernels import problems  # noqa: E402

__all__ = ["OP_LAUNCHERS", "clear_memo", "conv2d", "conv2d_dgrad", "conv2d_fprop", "conv2d_wgrad", "linear", "matmul"]


def conv2d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride=1, padding=0
) -> torch.Tensor:
    """torch.nn.functional.conv2d (NCHW; groups and dilation 1) on the tuned kernels, with
    autograd. The kernels are NHWC: a channels_last input and weight are read in place, others
    are copied once per call."""
    st = problems.pair(stride, "stride", minimum=1)
    pd = problems.pair(padding, "padding", minimum=0)
    if x.dim() != 4 or weight.dim() != 4:
        raise ValueError(
            f"conv2d takes a 4-D input (N, C, H, W) and weight (Co, Ci, R, S), got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    return custom_ops().conv2d(x, weight, bias, st, pd)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch.nn.functional.linear, y = x @ weight.T + bias, on the tuned matmul, with autograd
    (the weight is read transposed in place)."""
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear takes x (..., in_features) and weight (out_features, in_features), got {tuple(x.shape)} "
            f"and {tuple(weight.shape)}"
        )
    return custom_ops().linear(x, weight, bias)


_CUSTOM: list = []


def custom_ops():
    """tunecache.ops.custom, imported on first use (registering the custom ops costs 0.2 s), then
    read from a list: an import statement per call costs a layer's call a microsecond."""
    if not _CUSTOM:
        from tunecache.ops import custom

        _CUSTOM.append(custom)
    return _CUSTOM[0]
