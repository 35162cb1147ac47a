"""tunecache's kernels, one backend per module, named `<op>_<backend>.py`.

Every backend module meets the contract in backend.py (`Backend`, and `GluonBackend` /
`PlannedBackend` for what the Gluon and the Hopper backends add), which the launcher and the
tuner rely on and tests/unit/test_kernel_backend_protocol.py checks.

Beside the backends: problems.py and geometry.py (each op's arguments, problem dict and
reference, for every backend), hardware.py (each architecture's limits: shared and tensor
memory, registers, SM counts), portable_rules.py and portable_tiles.py (the portable backends'
pruning and tile order), dgrad_phases.py (every dgrad kernel's phase arithmetic), and the
modules the Gluon backends share, named for what they hold: gluon_host (descriptors, padding,
grids), gluon_device (device helpers), gluon_split_k, gluon_matmul, gluon_dgrad, gluon_wgrad,
gluon_packed_taps; gluon_hopper and gluon_launch (Hopper only), gluon_blackwell (Blackwell only).
A kernel version hashes the backend's file and the kernels modules it references, so each of
these re-keys only the backends that run it (tests/integration/test_kernel_versions_scope.py).

Config spaces are plain data in `spaces/` (no torch, no Triton): the service imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class KernelSpec:
    """One kernel compile: `triton.compile(GluonASTSource(fn, signature, constexprs), target)`."""

    fn: Any
    signature: dict[str, str]
    constexprs: dict[Any, Any]
    num_warps: int = 4
    # launch options as the launch passes them (they are part of Triton's cache key); the
    # Gluon kernels take their pipeline depth as a constexpr, so no launch passes num_stages
    num_stages: int | None = None
    num_ctas: int = 1
    options: dict[str, Any] = field(default_factory=dict)
    name: str = ""
