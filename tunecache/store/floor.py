"""The least time a tuning result can physically take: the service refuses a claim below it.

A kernel's launch cannot finish faster than its device class can do the problem's arithmetic
at the class's peak tensor throughput, nor faster than it can move the problem's compulsory
bytes (each operand read once, the result written once) at the class's memory bandwidth.
The larger of the two is the floor; a claimed `median_ms` below it is not a measurement.

Plain data and arithmetic: the service imports this, and it imports neither torch nor Triton
(the kernels' own `flops(problem)` live beside torch code in `tunecache_kernels.problems`).
The peaks are the vendors' figures for dense 16-bit tensor math, the fastest any dtype of the
shipped kernels runs (float32 goes through TF32 or FMA, at half of it or less), and for a
device class shared by several products (sm_90 with 132 SMs: H100 SXM, H200, GH200) the
highest of each figure, so the floor never refuses an honest measurement. Timings take the
median over launches with L2 flushed between them (`tunecache.tuning.timing`), so bytes come from
memory, not cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class DevicePeak:
    """What a device class can do at best."""

    tflops: float  # dense tensor throughput, TFLOP/s
    tb_per_s: float  # memory bandwidth, TB/s
    what: str  # where the figures come from

    def __str__(self) -> str:
        return f"{self.tflops:g} TFLOP/s and {self.tb_per_s:g} TB/s ({self.what})"


# (arch, SM count) -> the class's peak; a class not listed gets UNKNOWN_PEAK
PEAKS: dict[tuple[str, int], DevicePeak] = {
    ("sm_80", 108): DevicePeak(312, 2.04, "A100"),
    ("sm_90", 132): DevicePeak(990, 4.9, "H100 SXM 990 TFLOP/s; H200 4.8 TB/s; GH200 up to 4.9 TB/s"),
    ("sm_90", 114): DevicePeak(756, 2.0, "H100 PCIe"),
    ("sm_100", 148): DevicePeak(2500, 8.0, "B200 2250 TFLOP/s; GB200 2500 TFLOP/s; 8 TB/s"),
}
# the Triton interpreter on a CPU: far above what any CPU does, so only the absolute floor bites
CPU_PEAK = DevicePeak(100, 10, "the CPU interpreter: a generous bound for any CPU")
# a device class nobody listed (a new GPU, a MIG slice): above every GPU shipped so far
UNKNOWN_PEAK = DevicePeak(10_000, 20, "an unknown device class: a conservative bound above any GPU")

# No kernel launch timed on a device completes in under a microsecond (an empty kernel timed
# with CUDA events takes several); this holds for every kernel, the user's `triton:` ones too,
# for which there is no model of their work.
ABSOLUTE_FLOOR_MS = 1e-3

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
_MAX_SIZE = 2**31  # a size past this is not a problem anyone runs: no model, the absolute floor only


def peak(arch: str, sm_count: int) -> DevicePeak:
    if arch == "cpu":
        return CPU_PEAK
    return PEAKS.get((arch, sm_count), UNKNOWN_PEAK)


def _sizes(problem: Mapping[str, Any], *names: str) -> list[int] | None:
    out = []
    for n in names:
        v = problem.get(n)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v < _MAX_SIZE:
            return None
        out.append(v)
    return out


def work(kernel: str, problem: Mapping[str, Any]) -> tuple[float, float] | None:
    """(FLOPs, compulsory bytes) of the problem of a kernel "<op>.<backend>", or None when there
    is no model: a user's `triton:` kernel, an unknown op, a problem without the sizes."""
    op = kernel.partition(".")[0] if "." in kernel and not kernel.startswith("triton:") else None
    size = DTYPE_BYTES.get(problem.get("dtype"))  # type: ignore[arg-type]
    if op is None or size is None:
        return None
    if op == "matmul":
        mnk = _sizes(problem, "M", "N", "K")
        if mnk is None:
            return None
        M, N, K = mnk
        return 2.0 * M * N * K, float(size * (M * K + K * N + M * N))
    if op in ("conv2d_fprop", "conv2d_wgrad", "conv2d_dgrad"):
        # all tile an implicit GEMM of the same multiply-adds (fprop: [NPQ, Co] x RSCi; wgrad:
        # [Co, RSCi] x NPQ; dgrad: its phases), and touch x (or grad_x), the filter and grad_out or y
        dims = _sizes(problem, "gemm_M", "gemm_N", "gemm_K", "N", "H", "W", "Ci", "Co", "R", "S", "P", "Q")
        if dims is None:
            return None
        _, _, _, N, H, W, Ci, Co, R, S, P, Q = dims  # gemm_M/N/K: a canonical conv problem's mark
        return 2.0 * N * P * Q * Co * R * S * Ci, float(size * (N * H * W * Ci + Co * R * S * Ci + N * P * Q * Co))
    return None


@dataclass(frozen=True)
class Floor:
    ms: float
    why: str  # how the floor was reached, in words


def floor(kernel: str, arch: str, sm_count: int, problem: Mapping[str, Any]) -> Floor:
    """The least time the key's launch can take on its device class."""
    w = work(kernel, problem)
    if w is None:
        return Floor(
            ABSOLUTE_FLOOR_MS,
            f"no launch completes in under {ABSOLUTE_FLOOR_MS:g} ms (no model of the work of {kernel})",
        )
    flops, nbytes = w
    p = peak(arch, sm_count)
    compute_ms = flops / (p.tflops * 1e12) * 1e3
    memory_ms = nbytes / (p.tb_per_s * 1e12) * 1e3
    ms = max(compute_ms, memory_ms, ABSOLUTE_FLOOR_MS)
    return Floor(
        ms,
        f"{flops:.3g} FLOPs at {p.tflops:g} TFLOP/s take {compute_ms:.3g} ms, {nbytes:.3g} bytes at "
        f"{p.tb_per_s:g} TB/s take {memory_ms:.3g} ms, and no launch completes in under "
        f"{ABSOLUTE_FLOOR_MS:g} ms ({arch}:{sm_count}: {p.what})",
    )


def refusal(kernel: str, arch: str, sm_count: int, problem: Mapping[str, Any], median_ms: float) -> str | None:
    """Why a claimed median is physically impossible, or None when it is not."""
    f = floor(kernel, arch, sm_count, problem)
    if median_ms >= f.ms:
        return None
    return (
        f"median_ms={median_ms:.3g} is below what {arch}:{sm_count} can do: at least {f.ms:.3g} ms for this "
        f"{kernel} problem, since {f.why}"
    )
