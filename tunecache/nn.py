"""torch.nn layers on tunecache's kernels: `Conv2d`, `Linear`, and `convert(model)`.

They are `torch.nn.Conv2d` and `torch.nn.Linear` (subclasses: the same arguments, parameters,
state dict, hooks and `isinstance`), whose forward runs what `tunecache.ops.conv2d` / `linear`
run (tuned, with autograd, torch.compile and autocast). What the kernels do not take runs torch's own
forward with one warning that says why: groups, dilation, a padding mode other than zeros,
float64, an unbatched input. Activations are fastest channels_last
(`model.to(memory_format=torch.channels_last)`): the kernels are NHWC, and other inputs are
copied once per call.

    model = tunecache.nn.convert(torchvision.models.resnet50()).to("cuda", torch.bfloat16,
                                 memory_format=torch.channels_last)
"""

from __future__ import annotations

import logging

import torch

from tunecache.ops import custom_ops
from tunecache_kernels import problems

log = logging.getLogger("tunecache")

_WARNED: set[str] = set()


def _warn_once(what: str) -> None:
    if what not in _WARNED:
        _WARNED.add(what)
        log.warning("tunecache: %s; torch's own op runs it", what)


class Conv2d(torch.nn.Conv2d):
    """torch.nn.Conv2d whose forward runs tunecache's conv2d kernels (see the module's docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the layer's settings, checked once (again only if stride or padding is set anew): a
        # call's host time is the kernel's launch, not the settings' checks
        plan = self.__dict__.get("_tunecache_plan")
        if plan is None or plan[0] is not self.stride or plan[1] is not self.padding:
            plan = self._tunecache_plan = _conv_plan(self)
        why = plan[2] or _input_refusal(x, 4)
        if why:
            if not x.is_meta:  # a model's shapes read on the meta device (tune_model): no warning
                _warn_once(f"{type(self).__name__}{tuple(self.weight.shape)}: {why}")
            return super().forward(x)
        return custom_ops().conv2d(x, self.weight, self.bias, plan[3], plan[4])


def _conv_plan(m: torch.nn.Conv2d) -> tuple:
    """(the stride and padding it was made from, why the kernels refuse it or None, stride and
    padding as pairs)."""
    why = conv_refusal(m)
    st = None if why else problems.pair(m.stride, "stride", minimum=1)
    pd = None if why else problems.pair(padding_pair(m), "padding", minimum=0)
    return (m.stride, m.padding, why, st, pd)


class Linear(torch.nn.Linear):
    """torch.nn.Linear whose forward runs tunecache's matmul kernels (see the module's docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        why = _input_refusal(x, None)
        if why:
            if not x.is_meta:
                _warn_once(f"{type(self).__name__}({self.in_features}, {self.out_features}): {why}")
            return super().forward(x)
        return custom_ops().linear(x, self.weight, self.bias)


def conv_refusal(m: torch.nn.Conv2d) -> str | None:
    """Why this convolution's settings are not for tunecache's kernels, or None."""
    if m.groups != 1:
        return f"groups={m.groups} (grouped and depthwise convolutions are not supported)"
    if tuple(m.dilation) != (1, 1):
        return f"dilation={tuple(m.dilation)} (only 1)"
    if m.padding_mode != "zeros":
        return f"padding_mode={m.padding_mode!r} (only 'zeros')"
    if padding_pair(m) is None:
        return f"padding={m.padding!r} with stride {tuple(m.stride)} and an even filter"
    return None


def padding_pair(m: torch.nn.Conv2d) -> tuple[int, int] | None:
    """The padding as two ints ('valid' is 0; 'same' with stride 1 and odd filters is half of them)."""
    if m.padding == "valid":
        return (0, 0)
    if m.padding == "same":
        r, s = m.kernel_size
        if tuple(m.stride) != (1, 1) or r % 2 == 0 or s % 2 == 0:
            return None
        return (r // 2, s // 2)
    return tuple(m.padding)


_GEMM_DTYPES = problems.GEMM_DTYPES  # made once: a module attribute of problems is made per read


def _input_refusal(x: torch.Tensor, ndim: int | None) -> str | None:
    if x.dtype not in _GEMM_DTYPES:
        return f"dtype {x.dtype} (the kernels take float16, bfloat16 and float32)"
    if ndim is not None and x.dim() != ndim:
        return f"a {x.dim()}-D input (a batch of NCHW images is 4-D)"
    if not (x.is_cuda or x.is_cpu):
        return f"device {x.device}"
    if x.numel() == 0:
        return "an empty input"
    return None


def convert(model: torch.nn.Module) -> torch.nn.Module:
    """Make every torch.nn.Conv2d and torch.nn.Linear of `model` (itself included) one of this
    module, in place: the same objects, parameters and state dict, only their class changes.
    Convolutions whose settings the kernels do not take (`conv_refusal`) are left to torch and
    named in one warning. Returns `model`."""
    left: list[str] = []
    for name, m in model.named_modules():
        if type(m) is torch.nn.Conv2d:
            why = conv_refusal(m)
            if why:
                left.append(f"{name or 'the model'}: {why}")
                continue
            m.__class__ = Conv2d
        elif type(m) is torch.nn.Linear:
            m.__class__ = Linear
    if left:
        shown = "; ".join(left[:5]) + (f"; and {len(left) - 5} more" if len(left) > 5 else "")
        log.warning("tunecache: convert left %d convolution(s) to torch: %s", len(left), shown)
    return model
