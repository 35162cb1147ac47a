"""What each GPU architecture the kernels target offers a kernel: one table, read by the
backends' static rules (prune, resources_ok), their launch options and the compile checks.

Plain data (no torch, no Triton), so the service and the compile pool can read it too. Every
number here is the architecture's, from CUDA's programming guide (compute capabilities table);
what a kernel chooses to use of it (a register budget, a ring depth) stays with the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Arch:
    """One compute capability's limits, as a kernel meets them."""

    name: str  # "sm_90": the DeviceClass's arch (a compile target adds "a")
    capability: tuple[int, int]
    # dynamic shared memory one CTA may use (the opt-in maximum); a kernel's own barriers and
    # the compiler's scratch come out of it too
    smem_per_block: int
    # shared memory of one SM, shared by the CTAs resident on it, each of which also takes
    # smem_reserved_per_block (the system's use) beside its own
    smem_per_sm: int
    smem_reserved_per_block: int
    # 32-bit registers of one SM, shared by its resident threads; at most this many per thread
    registers_per_sm: int
    max_registers_per_thread: int
    # tensor memory (tcgen05): 128 lanes x this many 32-bit columns per SM; 0 where there is none
    tmem_columns: int
    # SMs of the architecture's usual part, for a device class that names no count
    usual_sm_count: int
    usual_part: str


HOPPER = Arch(
    "sm_90",
    (9, 0),
    smem_per_block=227 * 1024,
    smem_per_sm=228 * 1024,
    smem_reserved_per_block=1024,
    registers_per_sm=65536,
    max_registers_per_thread=255,
    tmem_columns=0,
    usual_sm_count=132,
    usual_part="H100 SXM",
)
# Blackwell's limits are Hopper's but for its tensor memory
BLACKWELL = replace(HOPPER, name="sm_100", capability=(10, 0), tmem_columns=512, usual_sm_count=148, usual_part="B200")
BLACKWELL_ULTRA = replace(
    BLACKWELL,
    name="sm_103",
    capability=(10, 3),
    usual_part="B300 (its count as the sm_103a compile target assumes; unchecked)",
)

ARCHES: dict[str, Arch] = {a.name: a for a in (HOPPER, BLACKWELL, BLACKWELL_ULTRA)}


def arch_for(capability: tuple[int, int] | None) -> Arch:
    """The table's row for a compute capability: its own, else its major's first, else Hopper's
    (what the Gluon backends' rules assume where a device class names no capability)."""
    if capability is None:
        return HOPPER
    for a in ARCHES.values():
        if a.capability == tuple(capability):
            return a
    return next((a for a in ARCHES.values() if a.capability[0] == capability[0]), HOPPER)
