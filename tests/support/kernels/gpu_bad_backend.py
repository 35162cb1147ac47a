"""A test-only GPU backend: the portable matmul behind a `behaviour` field whose bad values
launch a kernel that writes far out of bounds (an illegal address: the CUDA context of the
process is gone) or one that spins forever. It shows, on a real GPU, that such candidates are
failed trials of the isolated trial runner and the caller's CUDA context is untouched."""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from tunecache_kernels import matmul_portable as base
from tunecache_kernels.spaces import ConfigSpace

OP, BACKEND = "matmul", "gpubad"
KERNEL = f"{OP}.{BACKEND}"
problem, inputs, reference, flops, supports = base.problem, base.inputs, base.reference, base.flops, base.supports

GOOD = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
BEHAVIOURS = ("out_of_bounds", "spin", "ok")
SPACE = ConfigSpace({**{k: (v,) for k, v in GOOD.items()}, "behaviour": BEHAVIOURS})


@triton.jit
def out_of_bounds_kernel(p):
    tl.store(p + (1 << 40), 1.0)  # a terabyte past the tensor


@triton.jit
def spin_kernel(flag):
    seen = tl.load(flag, volatile=True)
    while seen == 0:  # the flag is zero and nobody sets it
        seen = tl.load(flag, volatile=True)


JIT_FUNCTIONS = base.JIT_FUNCTIONS + (out_of_bounds_kernel, spin_kernel)


def register(monkeypatch) -> None:
    from tunecache import backends
    from tunecache_kernels import spaces

    spaces.space_for("matmul.portable")
    monkeypatch.setitem(spaces._SPACES, KERNEL, SPACE)
    monkeypatch.setitem(backends._MODULES, (OP, BACKEND), sys.modules[__name__])


def config_space(p: dict, device) -> list[dict]:
    return [{**GOOD, "behaviour": b} for b in BEHAVIOURS]


def prune(configs: list[dict], p: dict, device) -> list[dict]:
    return list(configs)


def default_config(p: dict, device) -> dict:
    return {**GOOD, "behaviour": "ok"}


def launch(config: dict, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    behaviour = config.get("behaviour", "ok")
    if behaviour == "out_of_bounds":
        out_of_bounds_kernel[(1,)](a)
    elif behaviour == "spin":
        spin_kernel[(1,)](torch.zeros(1, device=a.device, dtype=torch.int32))
    return base.launch({k: v for k, v in config.items() if k != "behaviour"}, a, b)
