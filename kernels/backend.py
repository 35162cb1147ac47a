"""The contract of a backend module, as `typing.Protocol`s: a backend is a module (named
`<op>_<backend>.py`) whose functions and constants these list, so that a type checker and a
test (tests/unit/test_kernel_backend_protocol.py) hold every backend to it.

The methods are written as a Protocol writes a module's functions (PEP 544: a module matches
a protocol by its attributes, `self` left out). Names are the parameters' names in every
backend. `launch`, `problem` and `reference` take the op's own arguments after theirs, the same
in all three (matmul: a, b; conv2d_fprop: x, w, stride=1, padding=0; ...).

Who calls what: tunecache's backend choice (`supports`), the tuner (`config_space`, `prune`,
`inputs`, `flops`, `compile_specs`), the ops and their launcher (`problem`, `default_config`,
`launch`, `plan_for`), the self-check and the tests (`reference`); `kernel_version` hashes the
module, the kernels modules it references and `JIT_FUNCTIONS`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from . import KernelSpec


@runtime_checkable
class Backend(Protocol):
    """What every backend module (portable, hopper, blackwell) has."""

    OP: str  # "matmul"
    BACKEND: str  # "hopper"
    KERNEL: str  # "matmul.hopper": the key's kernel name
    JIT_FUNCTIONS: tuple  # the @jit functions it launches; their source keys the cache

    def supports(self, p: dict, device: Any) -> bool:
        """Can this backend run problem p on this DeviceClass?"""

    def problem(self, *args: Any, **kwargs: Any) -> dict:
        """Checks the op's arguments and returns the canonical problem dict (the key's part)."""

    def config_space(self, p: dict, device: Any) -> list[dict]:
        """The candidates, from spaces.<backend> (and, for the Gluon backends, worth_trying)."""

    def prune(self, configs: list[dict], p: dict, device: Any) -> list[dict]:
        """The static rules (divisibility, shared and tensor memory), in the order to time them."""

    def default_config(self, p: dict, device: Any) -> dict:
        """A reasonable untuned choice."""

    def inputs(self, p: dict, device: str) -> tuple:
        """Random arguments of the problem's shape on torch device `device`, for tuning."""

    def launch(self, config: dict, *args: Any, **kwargs: Any) -> Any:
        """Runs the op with that config on the op's arguments; returns the output."""

    def reference(self, *args: Any, **kwargs: Any) -> Any:
        """The PyTorch result of the op's arguments."""

    def flops(self, p: dict) -> float:
        """Floating-point operations of problem p, for TFLOP/s."""


@runtime_checkable
class GluonBackend(Backend, Protocol):
    """A Gluon backend (hopper, blackwell): it also compiles for an explicit target with no GPU,
    and states its static rules in two functions named for which they are."""

    def compile_specs(self, p: dict, config: dict, device: Any) -> list[KernelSpec]:
        """What a launch of config on problem p compiles (its kernels, and the split reduction
        where it splits), for `triton.compile` on an explicit target."""

    def resources_ok(self, c: dict, *args: Any, **kwargs: Any) -> bool:
        """What the compiler decides (shared and tensor memory, registers): prune() applies it
        and must agree with the compiler (tests/integration/test_compile_targets.py)."""

    def worth_trying(self, c: dict, p: dict, *args: Any, **kwargs: Any) -> bool:
        """Whether config c could win on problem p: config_space() applies it."""


@runtime_checkable
class PlannedBackend(Protocol):
    """A backend whose launches can skip JITFunction.run (the Hopper backends, gluon_launch):
    the launcher asks `plan_for` after a call's JIT launch and launches the plan after that."""

    def plan_for(self, config: dict, *args: Any) -> tuple | None:
        """(plan, device index) of the call `args` under config, once its first launch made one."""
