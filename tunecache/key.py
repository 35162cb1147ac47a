"""What identifies one tuning result: the kernel, the device class and the problem.

Two devices share a config only when compute capability *and* SM count agree: an H100 SXM
(132 SMs) and an H100 PCIe (114 SMs) want different persistent grids and tiles.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

_ARCH_RE = re.compile(r"^(sm_(\d+)(\d)a?|cpu)$")


@dataclass(frozen=True)
class DeviceClass:
    """Compute capability + SM count; the name is metadata only (not part of the key)."""

    arch: str  # "sm_90", "sm_100", or "cpu" for the Triton interpreter
    sm_count: int
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not _ARCH_RE.match(self.arch):
            raise ValueError(f"arch must look like 'sm_90', 'sm_100' or 'cpu', got {self.arch!r}")
        if self.sm_count < 0:
            raise ValueError(f"sm_count must be >= 0, got {self.sm_count}")

    @property
    def capability(self) -> tuple[int, int] | None:
        """(major, minor), or None for the CPU interpreter."""
        m = _ARCH_RE.match(self.arch)
        if self.arch == "cpu" or m is None:
            return None
        return int(m.group(2)), int(m.group(3))

    @classmethod
    def parse(cls, text: str) -> "DeviceClass":
        """'sm_90:132' or 'sm_100:148:NVIDIA B200' -> DeviceClass (for CPU hosts keying any device)."""
        parts = text.split(":", 2)
        if len(parts) < 2:
            raise ValueError(f"device class must be 'ARCH:SM_COUNT[:NAME]', got {text!r}")
        try:
            sms = int(parts[1])
        except ValueError:
            raise ValueError(f"SM count in device class {text!r} is not an integer") from None
        return cls(parts[0], sms, parts[2] if len(parts) > 2 else "")

    def __str__(self) -> str:
        return f"{self.arch}:{self.sm_count}"


# ---- which device: the one place that decides -------------------------------------------


def interpreter_device() -> DeviceClass:
    """The Triton interpreter on the CPU: its own device class, never mixed with a GPU's."""
    return DeviceClass("cpu", 0, "triton-interpreter")


_CUDA_CACHE: dict[int, DeviceClass] = {}


def cuda_device(index: int = 0) -> DeviceClass:
    """The device class of CUDA device `index` (asked once per process)."""
    dc = _CUDA_CACHE.get(index)
    if dc is None:
        import torch

        p = torch.cuda.get_device_properties(index)
        dc = DeviceClass(f"sm_{p.major}{p.minor}", p.multi_processor_count, p.name)
        _CUDA_CACHE[index] = dc
    return dc


def interpreting() -> bool:
    """Whether kernels run on Triton's CPU interpreter here: TRITON_INTERPRET is on (Triton's own
    knob once Triton is loaded: code may set it), or there is no CUDA GPU (see
    `use_interpreter_without_gpu`)."""
    import torch

    from tunecache import settings

    knobs = getattr(sys.modules.get("triton"), "knobs", None)
    on = knobs.runtime.interpret if knobs is not None else settings.triton_interpret()
    return bool(on) or not torch.cuda.is_available()


def use_interpreter_without_gpu() -> None:
    """With no GPU the kernels can only run on Triton's CPU interpreter: choose it (unless
    TRITON_INTERPRET says otherwise) before the first @jit is created, so that a fresh CPU-only
    machine works without settings."""
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
            if "triton" in sys.modules:  # too late for Triton's own @jit helpers (tl.cdiv, ...)
                import logging

                logging.getLogger("tunecache").warning(
                    "tunecache: Triton was imported before tunecache chose its CPU interpreter (no GPU "
                    "here), so its kernels cannot run in this process and the ops run PyTorch's; set "
                    "TRITON_INTERPRET=1 before anything imports Triton, or import tunecache.ops first"
                )


def local_device(gpu: int | None = None) -> DeviceClass:
    """This host's device class for kernels on CUDA device `gpu` (default: the current one), or
    the interpreter's. The hardware's facts: TUNECACHE_DEVICE is `device_of`'s."""
    if interpreting():
        return interpreter_device()
    if gpu is None:
        import torch

        gpu = torch.cuda.current_device()
    return cuda_device(gpu)


def device_of(tensor: Any = None) -> DeviceClass:
    """The device class a launch is keyed for: TUNECACHE_DEVICE if set, else the tensor's device
    (no tensor: `local_device()`, where Triton launches)."""
    from tunecache import settings

    override = settings.device_override()
    if override:
        return DeviceClass.parse(override)
    if tensor is None:
        return local_device()
    if tensor.device.type != "cuda":
        return interpreter_device()
    return cuda_device(tensor.device.index or 0)


def torch_device_for(device: DeviceClass, gpu: int | None = 0) -> str:
    """Where a device class's candidates run: "cuda:N", or "cpu" for the interpreter (or when
    there is no GPU index: the user's tensors are on the CPU)."""
    return "cpu" if device.arch == "cpu" or gpu is None else f"cuda:{gpu}"


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class TuneKey:
    """The store's lookup key. `digest` is sha256 over the canonical JSON of every field."""

    kernel: str
    kernel_version: str
    triton_version: str
    arch: str
    sm_count: int
    problem: Mapping[str, Any]

    def fields(self) -> dict[str, Any]:
        return {
            "kernel": self.kernel,
            "kernel_version": self.kernel_version,
            "triton_version": self.triton_version,
            "arch": self.arch,
            "sm_count": int(self.sm_count),
            "problem": dict(self.problem),
        }

    @property
    def digest(self) -> str:
        return hashlib.sha256(canonical_json(self.fields()).encode()).hexdigest()

    @classmethod
    def from_fields(cls, d: Mapping[str, Any]) -> "TuneKey":
        return cls(
            kernel=str(d["kernel"]),
            kernel_version=str(d["kernel_version"]),
            triton_version=str(d["triton_version"]),
            arch=str(d["arch"]),
            sm_count=int(d["sm_count"]),
            problem=dict(d["problem"]),
        )

    @property
    def device_class(self) -> DeviceClass:
        return DeviceClass(self.arch, self.sm_count)


def triton_version() -> str:
    from importlib.metadata import version

    return version("triton")
