"""A pretune manifest made from a model: the shapes its layers give tunecache's ops.

`tunecache manifest --from-model torchvision:resnet50 --batch 128` builds the model, runs one
forward pass on the meta device (no memory, no compute) with hooks on every `nn.Conv2d` and
`nn.Linear`, and writes each distinct problem as the op calls that `tunecache.nn` makes for
it: a convolution's fprop (and, for training, its wgrad, and the forward convolution that
computes its input's gradient where its input needs one), a linear layer's GEMM (and, for
training, the GEMMs of its two gradients), as `tunecache.ops.custom` computes them. The
result is the TOML that `tunecache pretune` reads, so no one writes shapes by hand.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from tunecache_kernels.geometry import runs_as_matmul, wgrad_runs_as_matmul
from tunecache_kernels.problems import DTYPES


class ModelError(ValueError):
    """The model cannot be built or run as asked; the message says what to change."""


@dataclass
class Entry:
    name: str
    ops: list[str]
    fields: dict[str, Any]


def load_model(spec: str) -> torch.nn.Module:
    """'package.module:factory' (called with no arguments), or 'torchvision:NAME' for
    torchvision's model zoo (untrained weights: only the shapes matter)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ModelError(f"--from-model takes MODULE:FACTORY (e.g. torchvision:resnet50), got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - ImportError, or whatever the module raises as it loads
        raise ModelError(f"cannot import {module_name!r} for --from-model {spec}: {type(e).__name__}: {e}") from None
    if module_name == "torchvision":
        try:
            return module.models.get_model(attr)
        except ValueError as e:
            raise ModelError(f"torchvision has no model {attr!r}: {e}") from None
    factory: Callable[[], Any] | None = getattr(module, attr, None)
    if not callable(factory):
        raise ModelError(f"{module_name} has no callable {attr!r}")
    model = factory() if not isinstance(factory, torch.nn.Module) else factory
    if not isinstance(model, torch.nn.Module):
        raise ModelError(f"{spec}() returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def entries(
    model: torch.nn.Module,
    input_shape: tuple[int, ...],
    batch: int,
    dtype: str,
    training: bool = True,
    input_dtype: str | None = None,
) -> tuple[list[Entry], list[str]]:
    """(one entry per distinct problem, the layers tunecache leaves to torch), from one forward
    pass of `model` on the meta device with an input of (batch, *input_shape), of the model's
    dtype or `input_dtype` (e.g. int64 token ids)."""
    from tunecache.nn import conv_refusal, padding_pair

    if dtype not in DTYPES:
        raise ModelError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    seen: dict[tuple, Entry] = {}
    left: list[str] = []

    def keep(name: str, ops: list[str], fields: dict) -> None:
        k = (tuple(ops), tuple(sorted(fields.items())))
        if k not in seen:
            seen[k] = Entry(name, ops, fields)

    def on_conv(name: str):
        def hook(m: torch.nn.Conv2d, args: tuple, _out: Any) -> None:
            why = conv_refusal(m)
            if why:
                left.append(f"{name}: {why}")
                return
            x = args[0]
            n, ci, h, w = x.shape
            pad, st = padding_pair(m), tuple(m.stride)
            r, s = m.kernel_size
            fields = dict(N=n, H=h, W=w, Ci=ci, Co=m.out_channels, R=r, S=s)
            fields.update(_geometry(st, pad), dtype=dtype)
            co, gemm = m.out_channels, runs_as_matmul(r, s, st, pad)  # a pointwise conv's fprop and dgrad
            ops = [] if gemm else ["conv2d_fprop"]
            if gemm:  # y = x @ w.T (w read transposed in place); dx = dy @ w
                keep(f"{name}_fwd", ["matmul"], dict(M=n * h * w, N=co, K=ci, dtype=dtype, b_layout="col"))
            if training:
                if wgrad_runs_as_matmul(r, s, st, pad, n * h * w):  # dw = dy.T @ x (dy read transposed)
                    keep(f"{name}_wgrad", ["matmul"], dict(M=co, N=ci, K=n * h * w, dtype=dtype, a_layout="col"))
                else:
                    ops.append("conv2d_wgrad")
                if x.requires_grad and gemm:
                    keep(f"{name}_dgrad", ["matmul"], dict(M=n * h * w, N=ci, K=co, dtype=dtype))
                elif x.requires_grad:  # the model's input needs no gradient
                    ops.append("conv2d_dgrad")
            if ops:
                keep(name, ops, fields)

        return hook

    def on_linear(name: str):
        def hook(m: torch.nn.Linear, args: tuple, _out: Any) -> None:
            x = args[0]
            tokens = x.numel() // x.shape[-1]
            fin, fout = m.in_features, m.out_features
            # y = x @ W.T (W read transposed in place); dx = dy @ W; dW = dy.T @ x (dy read transposed)
            keep(f"{name}_fwd", ["matmul"], dict(M=tokens, N=fout, K=fin, dtype=dtype, b_layout="col"))
            if training:
                keep(f"{name}_dgrad", ["matmul"], dict(M=tokens, N=fin, K=fout, dtype=dtype))
                keep(f"{name}_wgrad", ["matmul"], dict(M=fout, N=fin, K=tokens, dtype=dtype, a_layout="col"))

        return hook

    handles = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Conv2d):
            handles.append(m.register_forward_hook(on_conv(name or "model")))
        elif isinstance(m, torch.nn.Linear):
            handles.append(m.register_forward_hook(on_linear(name or "model")))
    modes = {m: m.training for m in model.modules()}
    try:
        x = torch.empty((batch, *input_shape), device="meta", dtype=_input_dtype(input_dtype or dtype))
        with torch.enable_grad():  # which layers' inputs need a gradient (the model's input needs none)
            torch.func.functional_call(model.eval(), _on_meta(model, DTYPES[dtype]), (x,))
    except Exception as e:  # noqa: BLE001 - a model that cannot run on meta tensors, or a wrong input
        raise ModelError(
            f"one forward pass on the meta device with an input of {(batch, *input_shape)} failed: "
            f"{type(e).__name__}: {e}"
        ) from None
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
    return list(seen.values()), left


def _on_meta(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers as meta tensors (floating ones in `dtype`), for a
    forward pass that leaves the model itself as it is: a user's model, on its GPU."""

    def meta(t: torch.Tensor) -> torch.Tensor:
        m = torch.empty_like(t, device="meta", dtype=dtype if t.is_floating_point() else t.dtype)
        return m.requires_grad_(t.requires_grad) if m.is_floating_point() else m

    named = [*model.named_parameters(), *model.named_buffers()]  # a tied tensor once: functional_call ties it
    return {name: meta(t) for name, t in named}


def _input_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ModelError(f"--input-dtype must name a torch dtype (e.g. int64, bfloat16), got {name!r}")
    return dt


def _geometry(stride: tuple[int, int], padding: tuple[int, int]) -> dict:
    """A manifest's stride and padding fields: one number where both sides agree, else the
    per-axis keys the shapes take (stride_h / stride_w, pad_h / pad_w)."""
    out: dict = {}
    for (h, w), one, pair in ((stride, "stride", ("stride_h", "stride_w")), (padding, "padding", ("pad_h", "pad_w"))):
        out.update({one: h} if h == w else dict(zip(pair, (h, w))))
    return out


def to_toml(name: str, description: str, found: list[Entry]) -> str:
    """The manifest's text (the format of tunecache/manifests/*.toml)."""
    lines = [f"name = {_value(name)}", f"description = {_value(description)}", ""]
    for e in found:
        lines += ["[[shape]]", f"name = {_value(e.name)}", f"ops = {_value(e.ops)}"]
        lines += [f"{k} = {_value(v)}" for k, v in e.fields.items()]
        lines.append("")
    return "\n".join(lines)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'
