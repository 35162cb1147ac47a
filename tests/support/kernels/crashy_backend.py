"""A test-only backend whose candidates crash, hang or compute garbage: the portable matmul
behind a `behaviour` field. It lets the tests show that a bad candidate is a failed trial of
the isolated trial runner, never the caller's problem."""

from __future__ import annotations

import os
import signal
import sys
import time

from tunecache_kernels import matmul_portable as base
from tunecache_kernels.spaces import ConfigSpace

OP, BACKEND = "matmul", "crashy"
KERNEL = f"{OP}.{BACKEND}"
JIT_FUNCTIONS = base.JIT_FUNCTIONS
problem, inputs, reference, flops, supports = base.problem, base.inputs, base.reference, base.flops, base.supports

GOOD = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 1, "num_warps": 4, "num_stages": 1}
# "oversized" stands for a config the device cannot hold (say 491,520 B of shared memory on a
# 232,448 B part): prune() refuses it, and launching it would kill the process
BEHAVIOURS = ("segfault", "hang", "exit", "raise", "oversized", "ok")
SPACE = ConfigSpace({**{k: (v,) for k, v in GOOD.items()}, "behaviour": BEHAVIOURS})


def register(monkeypatch, *, preferred: bool = True) -> None:
    """Make this the preferred matmul backend (before portable) for the test's duration."""
    from tunecache import backends
    from tunecache_kernels import spaces

    spaces.space_for("matmul.portable")  # load the spaces
    monkeypatch.setitem(spaces._SPACES, KERNEL, SPACE)
    preference = (BACKEND, "portable") if preferred else backends.BACKENDS_BY_OP[OP]
    monkeypatch.setitem(backends.BACKENDS_BY_OP, OP, preference)
    monkeypatch.setitem(backends._MODULES, (OP, BACKEND), sys.modules[__name__])


def config_space(p: dict, device) -> list[dict]:
    return [{**GOOD, "behaviour": b} for b in BEHAVIOURS]


def prune(configs: list[dict], p: dict, device) -> list[dict]:
    return [c for c in configs if c.get("behaviour") != "oversized"]


def default_config(p: dict, device) -> dict:
    # the self-check runs the default: CRASHY_DEFAULT=hang makes the backend fail it
    return {**GOOD, "behaviour": os.environ.get("CRASHY_DEFAULT", "ok")}


def launch(config: dict, a, b):
    behaviour = config.get("behaviour", "ok")
    if behaviour in ("segfault", "oversized"):
        os.kill(os.getpid(), signal.SIGSEGV)
    elif behaviour == "hang":
        while True:
            time.sleep(0.05)
    elif behaviour == "exit":
        os._exit(3)
    elif behaviour == "raise":
        raise RuntimeError("this config cannot launch here")
    return base.launch({k: v for k, v in config.items() if k != "behaviour"}, a, b)
