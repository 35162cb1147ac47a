"""The Hopper dgrad kernel as compiled for sm_90a, read from its PTX on the CPU: the epilogue a
problem gets (TMA store at stride 1, masked stores into the phases' strided positions
otherwise) and how wide those stores are. A scalar 2-byte store per channel made the strided
epilogue the kernel's bottleneck on an H100 (ResNet-50's strided 3x3 at batch 32: 68.7 us ->
28.7 us once each thread's 8 channels were one 16-byte store); the GPU results are in
tests/gpu/test_hopper_kernels.py."""

from __future__ import annotations

import re

import pytest

from tunecache.tuning.compile import canonical_problem, device_for
from tunecache.tuning.compile_pool import compile_in_fresh_processes
from tunecache_kernels import conv2d_dgrad_hopper as dgrad

ARCH = "sm_90a"
BASE = {"N": 32, "H": 28, "W": 28, "Ci": 128, "Co": 128, "R": 3, "S": 3, "padding": 1, "dtype": "bfloat16"}
# name: (shape overrides, the epilogue's store instruction, stores the PTX must not hold)
CASES = {
    "stride1": ({"stride": 1}, r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta", r"st\.global"),
    "stride2": ({"stride": 2}, r"st\.global\.v4\.b32", r"st\.global\.b16"),
    "stride2-ci4": ({"stride": 2, "Ci": 4}, r"st\.global\.v2\.b32", r"st\.global\.b16"),
    "stride2-ci3": ({"stride": 2, "Ci": 3}, r"st\.global\.b16", r"st\.global\.v4"),
}


@pytest.fixture(scope="module")
def ptx_of():
    device = device_for(ARCH)
    jobs = []
    for overrides, _, _ in CASES.values():
        p = canonical_problem("conv2d_dgrad", {**BASE, **overrides})
        jobs.append((dgrad, p, dgrad.default_config(p, device), 0))
    ptx = {k: out["asm"]["ptx"] for k, out in zip(CASES, compile_in_fresh_processes(jobs, device, ARCH))}
    return ptx.__getitem__


@pytest.mark.parametrize("case", list(CASES))
def test_the_epilogue_stores_as_wide_as_the_channels_allow(case, ptx_of):
    _, store, never = CASES[case]
    ptx = ptx_of(case)
    assert re.search(store, ptx), f"{case}: no {store} in the PTX"
    assert not re.search(never, ptx), f"{case}: {never} in the PTX"


def test_w_is_read_in_place_and_every_phase_in_one_kernel(ptx_of):
    """One kernel: its B operand is the TMA tile of w itself (no flipped copy exists to load),
    its A operand grad_out through im2col."""
    ptx = ptx_of("stride2")
    assert re.search(r"cp\.async\.bulk\.tensor\.4d\.shared::cta\.global\.im2col", ptx)
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global", ptx)
    assert re.search(r"wgmma\.mma_async", ptx)


def test_a_loader_warp_feeds_the_wgmma_warps(ptx_of):
    """Warp-specialized: the loader warp's registers go to the WGMMA warps (setmaxnreg) and the
    epilogue's barriers are the WGMMA warps' own (a named barrier over their threads, not the
    CTA's), so the loader runs ahead into the next tile while they store this one."""
    ptx = ptx_of("stride2")
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+\d+;", ptx)
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+\d+;", ptx)
    assert re.search(r"bar\.sync\s+\d+,\s*(128|256);", ptx), "the epilogue's barrier is not the WGMMA warps' own"


def test_two_ctas_per_sm_cap_the_registers_so_that_both_fit():
    """CTAS_PER_SM 2: a CTA of 256 threads (4 WGMMA warps, the loader's warpgroup) launches with
    128 registers a thread, so two fit the SM's 65536; one CTA alone gets them all."""
    device = device_for(ARCH)
    p = canonical_problem("conv2d_dgrad", {**BASE, "N": 128, "stride": 2})
    c = {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "CTAS_PER_SM": 2, "SPLIT_K": 1}
    c |= {"num_warps": 4, "num_stages": 3}
    assert dgrad.worth_trying(c, p, 132)
    two, one = compile_in_fresh_processes([(dgrad, p, c, 0), (dgrad, p, {**c, "CTAS_PER_SM": 1}, 0)], device, ARCH)
    assert re.search(r"\.reqntid 256\b", two["asm"]["ptx"]) and re.search(r"\.maxnreg 128\b", two["asm"]["ptx"])
    assert re.search(r"\.maxnreg 256\b", one["asm"]["ptx"])
