"""Config spaces as plain data.

This package imports neither torch nor Triton: the service validates every published
config against these spaces, and it must stay light. A kernel is named "<op>.<backend>"
(e.g. "matmul.hopper"); its space lives in the module for its backend.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping


@dataclass(frozen=True)
class ConfigSpace:
    """A grid of meta-parameters: every config is one value per parameter."""

    params: Mapping[str, tuple]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        names = list(self.params)
        for values in itertools.product(*(self.params[n] for n in names)):
            yield dict(zip(names, values))

    def __len__(self) -> int:
        n = 1
        for v in self.params.values():
            n *= len(v)
        return n

    def check(self, config: Mapping[str, Any]) -> None:
        """Raise ValueError naming the first key that is missing, unknown or out of range."""
        if not isinstance(config, Mapping):
            raise ValueError(f"config must be an object, got {type(config).__name__}")
        for name in config:
            if name not in self.params:
                raise ValueError(f"config key {name!r} is not a parameter of this kernel "
                                 f"(expected {sorted(self.params)})")
        for name, allowed in self.params.items():
            if name not in config:
                raise ValueError(f"config is missing {name!r}")
            value = config[name]
            # bool is an int in Python; keep True from matching 1 and vice versa
            if not any(type(value) is type(a) and value == a for a in allowed):
                raise ValueError(f"config {name}={value!r} is outside the space {list(allowed)}")

    def contains(self, config: Mapping[str, Any]) -> bool:
        try:
            self.check(config)
            return True
        except ValueError:
            return False

    def fingerprint(self) -> str:
        data = json.dumps({k: list(v) for k, v in self.params.items()}, sort_keys=True)
        return hashlib.sha256(data.encode()).hexdigest()[:16]


BACKENDS = ("blackwell", "hopper", "portable")


def _registry() -> dict[str, ConfigSpace]:
    import importlib

    spaces: dict[str, ConfigSpace] = {}
    for backend in BACKENDS:
        try:
            mod = importlib.import_module(f"{__name__}.{backend}")
        except ModuleNotFoundError:  # a backend whose space is not written yet
            continue
        for op, space in mod.SPACES.items():
            spaces[f"{op}.{backend}"] = space
    return spaces


_SPACES: dict[str, ConfigSpace] | None = None


def space_for(kernel: str) -> ConfigSpace:
    """The space of kernel "<op>.<backend>"; KeyError names the unknown kernel."""
    global _SPACES
    if _SPACES is None:
        _SPACES = _registry()
    try:
        return _SPACES[kernel]
    except KeyError:
        raise KeyError(f"unknown kernel {kernel!r}; known: {sorted(_SPACES)}") from None


def kernels() -> list[str]:
    space_for("matmul.portable")
    assert _SPACES is not None
    return sorted(_SPACES)
