"""tunecache's kernels, one backend per module, named `<op>_<backend>.py`.

Every backend module exposes the same contract, which the launcher and tuner rely on:

    OP, BACKEND, KERNEL          "matmul", "hopper", "matmul.hopper"
    JIT_FUNCTIONS                the @jit functions it launches (their source keys the cache)
    supports(problem, device)    can this backend run this problem on this DeviceClass?
    problem(*args, **kw)         checks the arguments, returns the canonical problem dict
    config_space(problem, device) -> list[dict]   candidates, from spaces.<backend>
    prune(configs, problem, device) -> list[dict] static rules (divisibility, smem, tmem)
    default_config(problem, device) -> dict       a reasonable untuned choice
    inputs(problem, device_str)  random arguments of the problem's shape, for tuning
    launch(config, *args)        runs the op with that config, returns the output
    reference(*args)             the PyTorch result
    flops(problem)               floating-point operations, for TFLOP/s
    compile_specs(problem, config, device) -> list[KernelSpec]   (Gluon backends) what to
                                 compile for an explicit target with no GPU

The Gluon backends state their static rules in two functions named for which they are:
`resources_ok(config, ...)`, what the compiler decides (shared and tensor memory, registers;
prune() applies it and must agree with the compiler), and `worth_trying(config, problem, ...)`,
whether the config could win on this problem (config_space() applies it).

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
