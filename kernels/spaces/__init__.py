"""Config spaces as plain data.

This package imports neither torch nor Triton: the service validates every published
config against these spaces, and it must stay light. A kernel is named "<op>.<backend>"
(e.g. "matmul.hopper"); its space lives in the module for its backend.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from typing import Any, Iterator, Mapping


class UnknownKernel(KeyError):
    """No kernel (or op, or backend) by that name. A KeyError, as a failed lookup is; its text
    is the message alone (a KeyError's own would quote it), so callers just use str(e)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class _Schema:
    """What a published config is checked against: `check` raises ValueError naming what is
    wrong, `contains` says whether there is nothing."""

    def check(self, config: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def contains(self, config: Mapping[str, Any]) -> bool:
        try:
            self.check(config)
            return True
        except ValueError:
            return False


def _check_object(config: Any) -> None:
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be an object, got {type(config).__name__}")


# The vendor's op (cuBLAS / cuDNN, as torch calls them: the backend's `reference`) as a config:
# every op's space holds it beside its grid, so a tune on a GPU times it as a candidate and it
# wins where it is faster; the store, the fleet and the dashboard keep it as any winner.
VENDOR = {"vendor": True}


def is_vendor(config: Mapping[str, Any]) -> bool:
    return config.get("vendor") is True and len(config) == 1


@dataclass(frozen=True)
class ConfigSpace(_Schema):
    """A grid of meta-parameters: every config is one value per parameter, and `VENDOR`."""

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
        _check_object(config)
        if is_vendor(config):
            return
        for name in config:
            if name not in self.params:
                raise ValueError(
                    f"config key {name!r} is not a parameter of this kernel (expected {sorted(self.params)})"
                )
        for name, allowed in self.params.items():
            if name not in config:
                raise ValueError(f"config is missing {name!r}")
            value = config[name]
            # bool is an int in Python; keep True from matching 1 and vice versa
            if not any(type(value) is type(a) and value == a for a in allowed):
                raise ValueError(f"config {name}={value!r} is outside the space {list(allowed)}")

    def fingerprint(self) -> str:
        data = json.dumps({k: list(v) for k, v in self.params.items()}, sort_keys=True)
        return hashlib.sha256(data.encode()).hexdigest()[:16]


BACKENDS = ("blackwell", "hopper", "portable")  # every backend, preferred first (tunecache.backends)
# The GPU generations (compute capability majors) each backend is written for; None: any device,
# the CPU interpreter included. A backend's own `supports()` decides the rest; this lets the
# registry skip importing (and compiling the module of) a backend that cannot run here.
BACKEND_MAJORS: dict[str, tuple[int, ...] | None] = {"blackwell": (10,), "hopper": (9,), "portable": None}


def may_run_on(backend: str, capability: tuple[int, int] | None) -> bool:
    majors = BACKEND_MAJORS.get(backend)
    return majors is None or (capability is not None and capability[0] in majors)


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


USER_KERNEL_PREFIX = "triton:"


class TritonConfigSchema(_Schema):
    """The 'space' of a user's own Triton kernel (`@tunecache.autotune`): its configs live in
    the user's code, so the service can only check that a config is a well-formed
    triton.Config: scalar kwargs and sane launch options."""

    OPTIONS = {"num_warps": (1, 2, 4, 8, 16, 32), "num_stages": tuple(range(0, 9)), "num_ctas": (1, 2, 4, 8)}

    def check(self, config: Mapping[str, Any]) -> None:
        _check_object(config)
        for name in ("kwargs", "num_warps", "num_stages", "num_ctas"):
            if name not in config:
                raise ValueError(f"config is missing {name!r}")
        for name in config:
            if name not in ("kwargs", "maxnreg", *self.OPTIONS):
                raise ValueError(f"config key {name!r} is not a triton.Config field")
        kwargs = config["kwargs"]
        if not isinstance(kwargs, Mapping) or len(kwargs) > 64:
            raise ValueError("config kwargs must be an object of at most 64 entries")
        for k, v in kwargs.items():
            if (
                not isinstance(k, str)
                or not isinstance(v, (int, float, bool, str))
                or (isinstance(v, str) and len(v) > 256)
            ):
                raise ValueError(f"config kwarg {k!r}={v!r} is not a scalar meta-parameter")
        for name, allowed in self.OPTIONS.items():
            if config[name] not in allowed or isinstance(config[name], bool):
                raise ValueError(f"config {name}={config[name]!r} is outside {list(allowed)}")
        maxnreg = config.get("maxnreg")
        if maxnreg is not None and (
            isinstance(maxnreg, bool) or not isinstance(maxnreg, int) or not 16 <= maxnreg <= 256
        ):
            raise ValueError(f"config maxnreg={maxnreg!r} must be null or an int in [16, 256]")


def space_for(kernel: str) -> ConfigSpace | TritonConfigSchema:
    """The space of kernel "<op>.<backend>" (or the schema of a user kernel "triton:...");
    UnknownKernel (a KeyError) names an unknown kernel."""
    global _SPACES
    if kernel.startswith(USER_KERNEL_PREFIX) and len(kernel) > len(USER_KERNEL_PREFIX):
        return TritonConfigSchema()
    if _SPACES is None:
        _SPACES = _registry()
    try:
        return _SPACES[kernel]
    except KeyError:
        raise UnknownKernel(f"unknown kernel {kernel!r}; known: {sorted(_SPACES)}") from None


def kernels() -> list[str]:
    space_for("matmul.portable")
    assert _SPACES is not None
    return sorted(_SPACES)
