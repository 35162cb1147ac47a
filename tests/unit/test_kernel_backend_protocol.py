"""Every backend module meets the contract of tunecache_kernels.backend: its Protocols, and the
parameter names they give (a backend that renamed `p` or reordered `configs` would break the
callers that pass them by position)."""

from __future__ import annotations

import importlib
import inspect

import pytest

pytest.importorskip("triton")

from tunecache.shapes import OPS
from tunecache_kernels.backend import Backend, GluonBackend, PlannedBackend
from tunecache_kernels.spaces import BACKENDS

MODULES = {f"{op}.{b}": importlib.import_module(f"tunecache_kernels.{op}_{b}") for op in OPS for b in BACKENDS}


def _named(fn) -> list[str]:
    """A callable's parameters before its first *args or **kwargs, `self` left out."""
    names = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            break
        if p.name != "self":
            names.append(p.name)
    return names


def _protocol_methods(proto) -> list[str]:
    return [n for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_")]


def _check(mod, proto) -> None:
    assert isinstance(mod, proto), [n for n in proto.__protocol_attrs__ if not hasattr(mod, n)]
    for name in _protocol_methods(proto):
        want = _named(getattr(proto, name))
        have = [p for p in inspect.signature(getattr(mod, name)).parameters][: len(want)]
        assert have == want, (mod.KERNEL, name, have, want)


@pytest.mark.parametrize("kernel", sorted(MODULES))
def test_every_backend_module_is_a_backend(kernel):
    mod = MODULES[kernel]
    for proto in (Backend,) + ((GluonBackend,) if not kernel.endswith(".portable") else ()):
        for base in proto.__mro__:
            if base is not object and getattr(base, "_is_protocol", False) and base.__module__ == proto.__module__:
                _check(mod, base)
    assert (mod.OP, mod.BACKEND, mod.KERNEL) == (*kernel.split("."), kernel)
    assert isinstance(mod.JIT_FUNCTIONS, tuple) and mod.JIT_FUNCTIONS


@pytest.mark.parametrize("kernel", sorted(MODULES))
def test_launch_problem_and_reference_take_the_same_arguments(kernel):
    mod = MODULES[kernel]
    args = list(inspect.signature(mod.problem).parameters)
    assert list(inspect.signature(mod.launch).parameters)[1:] == args
    assert list(inspect.signature(mod.reference).parameters) == args


@pytest.mark.parametrize("kernel", sorted(MODULES))
def test_the_optional_parts_are_where_the_backend_kind_says(kernel):
    """Gluon backends compile for an explicit target; the Hopper ones plan their launches; the
    portable ones do neither (the tuner and the launcher ask with hasattr / getattr)."""
    mod, backend = MODULES[kernel], kernel.split(".")[1]
    assert isinstance(mod, GluonBackend) is (backend != "portable")
    assert isinstance(mod, PlannedBackend) is (backend == "hopper")
    if backend == "hopper":
        _check(mod, PlannedBackend)
