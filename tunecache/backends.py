"""Which kernel backends exist for each op, which one runs on a device, and their versions."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import sys
from types import ModuleType
from typing import Any

from tunecache import settings
from tunecache.key import DeviceClass, use_interpreter_without_gpu
from tunecache.shapes import OPS
from tunecache.tuning import triton_key_cache
from tunecache_kernels.spaces import BACKENDS, UnknownKernel, may_run_on

# Backends in order of preference (BACKENDS): the first whose `supports(problem, device)` is true runs.
BACKENDS_BY_OP: dict[str, tuple[str, ...]] = {op: BACKENDS for op in OPS}

_MODULES: dict[tuple[str, str], ModuleType | None] = {}
_VERSIONS: dict[str, str] = {}


def backend_module(op: str, backend: str) -> ModuleType:
    """Import `tunecache_kernels.<op>_<backend>`; UnknownKernel (a KeyError) names an unknown op or
    backend."""
    if op not in BACKENDS_BY_OP:
        raise UnknownKernel(f"unknown op {op!r}; known: {sorted(BACKENDS_BY_OP)}")
    if backend not in BACKENDS_BY_OP[op]:
        raise UnknownKernel(f"unknown backend {backend!r} for {op}; known: {list(BACKENDS_BY_OP[op])}")
    mod = _load(op, backend)
    if mod is None:
        raise UnknownKernel(f"backend {backend!r} of {op} is not available in this build")
    return mod


def _load(op: str, backend: str) -> ModuleType | None:
    k = (op, backend)
    if k not in _MODULES:
        use_interpreter_without_gpu()
        try:
            _MODULES[k] = importlib.import_module(f"tunecache_kernels.{op}_{backend}")
            if not settings.triton_interpret():  # the interpreter compiles nothing
                triton_key_cache.install()  # Triton is imported now: spare it hashing itself (see there)
        except ModuleNotFoundError as e:
            if e.name != f"tunecache_kernels.{op}_{backend}":
                raise
            _MODULES[k] = None
    return _MODULES[k]


def module_for_kernel(kernel: str) -> ModuleType:
    """'matmul.hopper' -> its backend module."""
    op, _, backend = kernel.partition(".")
    return backend_module(op, backend)


def available_backends(op: str) -> list[str]:
    return [b for b in BACKENDS_BY_OP[op] if _load(op, b) is not None]


def backends_for(op: str, device: DeviceClass, problem: dict[str, Any], forced: str | None = None) -> list[ModuleType]:
    """Every backend that supports this problem on this device, preferred first (the later ones
    are the fallbacks of the first); only the forced one if a backend is forced."""
    if forced:
        return [backend_for(op, device, problem, forced)]
    mods = [
        m
        for name in BACKENDS_BY_OP[op]
        if may_run_on(name, device.capability) and (m := _load(op, name)) is not None and m.supports(problem, device)
    ]
    if not mods:
        raise ValueError(f"no backend of {op} supports {problem} on {device}")
    return mods


def backend_for(
    op: str,
    device: DeviceClass,
    problem: dict[str, Any],
    forced: str | None = None,
    forced_by: str = "TUNECACHE_BACKEND",
) -> ModuleType:
    """The preferred backend that supports this problem on this device class (`forced`: that
    one, as `forced_by` asked for it: the variable, or a command's option)."""
    if forced:
        mod = backend_module(op, forced)
        if not mod.supports(problem, device):
            raise ValueError(f"backend {forced!r} ({forced_by}) does not support {op} {problem} on {device}")
        return mod
    for name in BACKENDS_BY_OP[op]:
        mod = _load(op, name) if may_run_on(name, device.capability) else None
        if mod is not None and mod.supports(problem, device):
            return mod
    raise ValueError(f"no backend of {op} supports {problem} on {device}")


def kernel_version(mod: ModuleType) -> str:
    """Hash of the backend's source, the kernel modules it uses, its jit functions and its space.

    Editing a kernel, its host code or its config space changes the version, so its stored
    entries stop matching instead of launching a config tuned for different code.
    """
    v = _VERSIONS.get(mod.__name__)
    if v is None:
        from tunecache_kernels.spaces import space_for

        h = hashlib.sha256()
        for path in sorted(_kernel_sources(mod)):
            with open(path, "rb") as f:
                h.update(f.read())
        for fn in mod.JIT_FUNCTIONS:
            key = getattr(fn, "cache_key", None)  # covers the @jit functions it calls
            h.update((key if isinstance(key, str) else "").encode())
        h.update(space_for(mod.KERNEL).fingerprint().encode())
        v = _VERSIONS[mod.__name__] = h.hexdigest()[:16]
    return v


def _kernel_sources(mod: ModuleType) -> set[str]:
    files = {inspect.getfile(mod)}
    for value in vars(mod).values():
        name = value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", None)
        if isinstance(name, str) and name.startswith("tunecache_kernels") and name in sys.modules:
            f = getattr(sys.modules[name], "__file__", None)
            if f:
                files.add(f)
    return files
