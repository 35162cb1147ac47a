"""tunecache: a persistent, fleet-shared autotune cache for Triton/Gluon kernels.

    import tunecache
    y = tunecache.ops.conv2d_fprop(x, w, stride=1, padding=1)
    model = tunecache.nn.convert(model)

`import tunecache` is light (training jobs import it): torch, Triton and SQLAlchemy load
on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

# Bound eagerly: the module is light (it imports Triton only when a kernel is decorated).
from tunecache.dropin import autotune, patch_triton, unpatch_triton

__version__ = "0.1.0"

_LAZY = {
    "ops": ("tunecache.ops", None),
    "nn": ("tunecache.nn", None),
    "TuneKey": ("tunecache.key", "TuneKey"),
    "DeviceClass": ("tunecache.key", "DeviceClass"),
    "Store": ("tunecache.store", "Store"),
    "MissingConfig": ("tunecache.ops.launcher", "MissingConfig"),
    "tune_all": ("tunecache.ops.ahead", "tune_all"),
    "tune_model": ("tunecache.ops.ahead", "tune_model"),
}

__all__ = ["autotune", "patch_triton", "refresh", "unpatch_triton", *_LAZY]


def refresh() -> None:
    """Move on to the newest winners: the next call of every shape (of the ops and of your
    @tunecache.autotune kernels) looks its config up again, in this host's store and then the
    fleet, instead of running the one this process settled on first. Until then a process keeps
    its first winner for each key, so ranks stay on one config; call it on every rank at the
    same step boundary."""
    import sys

    ops = sys.modules.get("tunecache.ops")
    if ops is not None:
        ops.clear_memo()
    dropin = sys.modules.get("tunecache.dropin.autotuner")
    if dropin is not None:
        dropin.forget_all()


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'tunecache' has no attribute {name!r}") from None
    mod = importlib.import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value
