"""The Blackwell kernels, compiled for sm_100a on the CPU, are what they claim to be.

No Blackwell GPU is needed (or used): each kernel is compiled for an explicit sm_100a
target and its PTX (`kernel.asm["ptx"]`) is read for
- tcgen05 MMA into tensor memory (alloc, mma, commit, ld), not a WGMMA or mma.sync fallback;
- warp specialization: the partition dispatch (a jump table over warp groups) and the
  register split (worker warps shrink with setmaxnreg.dec, the epilogue grows with .inc);
- the code of each partition (load, MMA, epilogue), found through the PTX line table;
- TMA: bulk tensor loads (im2col mode for the conv activations) and, where the epilogue
  uses it, TMA stores.
What this cannot show is that the kernels run correctly: that needs a Blackwell GPU.
"""

from __future__ import annotations

import inspect
import os
import re

import pytest

pytest.importorskip("triton")

from tunecache.tuning.compile import REPRESENTATIVE, canonical_problem, device_for
from tunecache.tuning.compile_pool import compile_in_fresh_processes
from tunecache_kernels import (
    conv2d_dgrad_blackwell,
    conv2d_fprop_blackwell,
    conv2d_wgrad_blackwell,
    gluon_blackwell,
    matmul_blackwell,
)
from tunecache_kernels import gluon_host as gh
from tunecache_kernels import gluon_matmul as gmm
from tunecache_kernels import gluon_wgrad as gwg

ARCH = "sm_100a"
SPLIT_B1 = {"N": 1, "H": 7, "W": 7, "Ci": 512, "Co": 512, "R": 3, "S": 3, "stride": 1, "padding": 1}
# each kernel on a problem and config that take the path named: (op, problem overrides, module,
# config overrides of the default config)
KERNELS = {
    "matmul": ("matmul", {}, matmul_blackwell, {}),
    # a decode GEMM: 32 tiles on 148 SMs, so the default config splits K (the split binary)
    "matmul-split": ("matmul", {"M": 16, "N": 4096, "K": 4096}, matmul_blackwell, {}),
    # swapped (c^T = b^T a^T): M = 1 on an 8-wide MMA tile, unsplit and split
    "matmul-swap": ("matmul", {"M": 1, "N": 4096, "K": 4096}, matmul_blackwell, {"SWAP_AB": 1, "SPLIT_K": 1}),
    "matmul-swap-split": ("matmul", {"M": 1, "N": 4096, "K": 4096}, matmul_blackwell, {"SWAP_AB": 1, "SPLIT_K": 0}),
    "conv2d_fprop": ("conv2d_fprop", {}, conv2d_fprop_blackwell, {}),
    # batch 1 at 7x7: 16 tiles on 148 SMs, so the default config splits K (the split binary)
    "conv2d_fprop-split": ("conv2d_fprop", SPLIT_B1, conv2d_fprop_blackwell, {}),
    "conv2d_wgrad": ("conv2d_wgrad", {}, conv2d_wgrad_blackwell, {}),
    "conv2d_wgrad-stream": ("conv2d_wgrad", {}, conv2d_wgrad_blackwell, {"SPLIT_K": gwg.STREAM_K}),
    # stride 1: one phase, a TMA-store epilogue; stride 2: four phases stored from registers
    "conv2d_dgrad": ("conv2d_dgrad", {}, conv2d_dgrad_blackwell, {}),
    "conv2d_dgrad-strided": ("conv2d_dgrad", {"stride": 2}, conv2d_dgrad_blackwell, {}),
    # batch 1 at 7x7, stride 1: the default config splits K (partials from tensor memory)
    "conv2d_dgrad-split": ("conv2d_dgrad", SPLIT_B1, conv2d_dgrad_blackwell, {}),
}
# the partitions each kernel's warp_specialize runs: (default/epilogue, MMA, load)
PARTITIONS = {
    "matmul": (gluon_blackwell.tma_store_epilogue, gluon_blackwell.mma_partition, matmul_blackwell._load_partition),
    "matmul-split": (
        matmul_blackwell._register_epilogue,
        gluon_blackwell.mma_partition,
        matmul_blackwell._load_partition,
    ),
    "matmul-swap": (
        matmul_blackwell._register_epilogue,
        gluon_blackwell.mma_partition,
        matmul_blackwell._load_partition,
    ),
    "matmul-swap-split": (
        matmul_blackwell._register_epilogue,
        gluon_blackwell.mma_partition,
        matmul_blackwell._load_partition,
    ),
    "conv2d_fprop": (
        gluon_blackwell.tma_store_epilogue,
        gluon_blackwell.mma_partition,
        conv2d_fprop_blackwell._load_partition,
    ),
    "conv2d_fprop-split": (
        gluon_blackwell.partial_epilogue,
        gluon_blackwell.mma_partition,
        conv2d_fprop_blackwell._load_partition,
    ),
    "conv2d_wgrad": (
        conv2d_wgrad_blackwell._epilogue_partition,
        conv2d_wgrad_blackwell._mma_partition,
        conv2d_wgrad_blackwell._load_partition,
    ),
    "conv2d_wgrad-stream": (
        conv2d_wgrad_blackwell._epilogue_partition,
        conv2d_wgrad_blackwell._mma_partition,
        conv2d_wgrad_blackwell._load_partition,
    ),
    "conv2d_dgrad": (
        gluon_blackwell.tma_store_epilogue,
        conv2d_dgrad_blackwell._mma_partition,
        conv2d_dgrad_blackwell._load_partition,
    ),
    "conv2d_dgrad-strided": (
        conv2d_dgrad_blackwell._phase_store_epilogue,
        conv2d_dgrad_blackwell._mma_partition,
        conv2d_dgrad_blackwell._load_partition,
    ),
    "conv2d_dgrad-split": (
        gluon_blackwell.partial_epilogue,
        conv2d_dgrad_blackwell._mma_partition,
        conv2d_dgrad_blackwell._load_partition,
    ),
}
# the split binary's partials and wgrad's tiles leave from registers (masked global stores)
TMA_STORE = {
    "matmul": True,
    "matmul-split": False,
    "matmul-swap": False,
    "matmul-swap-split": False,
    "conv2d_fprop": True,
    "conv2d_fprop-split": False,
    "conv2d_wgrad": False,
    "conv2d_wgrad-stream": False,
    "conv2d_dgrad": True,
    "conv2d_dgrad-strided": False,
    "conv2d_dgrad-split": False,
}
IM2COL = {k: op.startswith("conv") for k, (op, *_) in KERNELS.items()}


def _problem(kernel: str) -> dict:
    op, overrides, _, _ = KERNELS[kernel]
    return canonical_problem(op, {**REPRESENTATIVE[op], **overrides})


@pytest.fixture(scope="module")
def ptx_of():
    # one batch of compiles in fresh processes: earlier tests ran the CPU interpreter in this one
    device = device_for(ARCH)
    jobs = []
    for kernel, (_, _, mod, config) in KERNELS.items():
        p = _problem(kernel)
        jobs.append((mod, p, {**mod.default_config(p, device), **config}, 0))
    ptx = {k: out["asm"]["ptx"] for k, out in zip(KERNELS, compile_in_fresh_processes(jobs, device, ARCH))}
    return ptx.__getitem__


def test_the_decode_problem_takes_the_split_binary():
    device = device_for(ARCH)
    p = _problem("matmul-split")
    config = matmul_blackwell.default_config(p, device)
    splits, _ = gmm.matmul_splits(p, config, gh.sm_count_of(device))
    assert splits > 1 and gmm.split_binary(config, splits)
    names = [spec.name for spec in matmul_blackwell.compile_specs(p, config, device)]
    assert names == ["matmul_kernel"]  # the split binary sums its own partials
    big = _problem("matmul")
    assert not gmm.split_binary(matmul_blackwell.default_config(big, device), 1)


@pytest.mark.parametrize("op", ["conv2d_fprop", "conv2d_dgrad"])
def test_a_batch_1_conv_takes_the_split_binary_and_its_reduction(op):
    device = device_for(ARCH)
    mod = KERNELS[op][2]
    config = mod.default_config(_problem(f"{op}-split"), device)
    assert config["SPLIT_K"] == 0
    assert [spec.name for spec in mod.compile_specs(_problem(f"{op}-split"), config, device)] == [
        f"{op}_kernel",
        "split_k_reduce",
    ]
    assert mod.default_config(_problem(op), device)["SPLIT_K"] == 1  # batch 32: the tiles fill the GPU


@pytest.mark.parametrize("kernel", ["matmul-split", "matmul-swap-split"])
def test_the_last_split_of_a_tile_sums_the_partials(kernel, ptx_of):
    # each split counts in on its tile's counter (acq_rel at GPU scope: its partial is out
    # before, the last one sees them all), the last one reads the partials past L1 and zeroes
    # the counter for the next launch
    ptx = ptx_of(kernel)
    assert re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx)
    assert re.search(r"ld\.global\.cg", ptx)
    assert re.search(r"atom\.global\.gpu\.relaxed\.exch", ptx)
    for unsplit in ("matmul", "matmul-swap"):
        assert not re.search(r"atom\.global\.gpu\.acq_rel", ptx_of(unsplit)), f"{unsplit} counts nothing"


def test_a_swapped_decode_gemm_runs_an_8_wide_mma():
    # M = 1 on the MMA's narrow side: the kernel is compiled for an [BLOCK_M, 8] accumulator
    device = device_for(ARCH)
    p = _problem("matmul-swap")
    config = {**matmul_blackwell.default_config(p, device), **KERNELS["matmul-swap"][3]}
    (spec,) = matmul_blackwell.compile_specs(p, config, device)
    assert spec.constexprs["SWAP"] and spec.constexprs["BLOCK_N"] == 8


def _lines_in_ptx(ptx: str) -> set[tuple[str, int]]:
    """(source file basename, line) pairs of the PTX line table."""
    files = {m.group(1): os.path.basename(m.group(2)) for m in re.finditer(r'\.file\s+(\d+)\s+"([^"]+)"', ptx)}
    return {(files.get(f, "?"), int(line)) for f, line in re.findall(r"\.loc\s+(\d+)\s+(\d+)\s+\d+", ptx)}


def _body_lines(jit_fn) -> tuple[str, range]:
    fn = jit_fn.fn
    src, first = inspect.getsourcelines(fn)
    return os.path.basename(inspect.getsourcefile(fn)), range(first + 1, first + len(src))


@pytest.mark.parametrize("op", sorted(KERNELS))
def test_tcgen05_mma_into_tensor_memory(op, ptx_of):
    ptx = ptx_of(op)
    assert re.search(r"tcgen05\.mma\.cta_group::1\.kind::f16", ptx), "no tcgen05 MMA in the PTX"
    for instr in ("tcgen05.alloc", "tcgen05.commit", "tcgen05.ld", "tcgen05.dealloc"):
        assert instr in ptx, f"{instr} missing: the accumulator does not live in tensor memory"
    assert "wgmma" not in ptx and "mma.sync" not in ptx


@pytest.mark.parametrize("op", sorted(KERNELS))
def test_warp_specialized_partitions(op, ptx_of):
    ptx = ptx_of(op)
    # the partitions are dispatched on the warp index through a jump table
    assert ".branchtargets" in ptx and "brx.idx" in ptx
    # one-warp load and MMA partitions give registers back; the epilogue takes them
    workers = int(gluon_blackwell.WORKER_REGS.value)
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{workers};", ptx)
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+\d+;", ptx)
    # and each partition's code is in there (the line table points into its body)
    lines = _lines_in_ptx(ptx)
    for part in PARTITIONS[op]:
        fname, body = _body_lines(part)
        assert any((fname, n) in lines for n in body), f"{part.__name__} ({fname}) has no code in the PTX"


@pytest.mark.parametrize("op", sorted(KERNELS))
def test_tma_loads_and_stores(op, ptx_of):
    ptx = ptx_of(op)
    loads = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global\.(im2col\.)?mbarrier", ptx)
    assert loads, "no TMA loads"
    assert any(loads) == IM2COL[op], "TMA im2col mode expected exactly for the conv activations"
    stores = re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx)
    assert bool(stores) == TMA_STORE[op]
    # the loads complete on mbarriers that the consumers wait on
    assert "mbarrier.try_wait" in ptx


@pytest.mark.parametrize("kernel", ["conv2d_wgrad", "conv2d_wgrad-stream"])
def test_stream_k_hands_partials_over_through_release_and_acquire(kernel, ptx_of):
    # a CTA publishes its partial with a release store of its flag; the CTA that ends the tile
    # polls the flags with acquire loads: without both, the sum could read a partial half-written
    ptx = ptx_of(kernel)
    stream = kernel.endswith("-stream")
    assert bool(re.search(r"\.release\.gpu", ptx)) == stream
    assert bool(re.search(r"\.acquire\.gpu", ptx)) == stream


def test_the_strided_dgrad_stores_each_threads_channels_at_once(ptx_of):
    # Ci = 256: a thread's run of a pixel's channels is 16-byte aligned and masked as a whole,
    # so it leaves as vector stores, never one 2-byte store per channel
    ptx = ptx_of("conv2d_dgrad-strided")
    assert re.search(r"st\.global\.v4\.b32", ptx) and not re.search(r"st\.global\.b16", ptx)


# few input channels: the packed-taps kernels (one tile per CTA, no warp specialization); x is
# gathered through pointers, the other operand comes by TMA
PACKED_STEM = {"N": 32, "H": 224, "W": 224, "Ci": 3, "Co": 64, "R": 7, "S": 7, "stride": 2, "padding": 3}


@pytest.fixture(scope="module")
def packed_ptx():
    device = device_for(ARCH)
    jobs = []
    for mod in (conv2d_fprop_blackwell, conv2d_wgrad_blackwell):
        p = canonical_problem(mod.OP, {**PACKED_STEM, "dtype": "bfloat16"})
        jobs.append((mod, p, mod.default_config(p, device), 0))
    ptx = compile_in_fresh_processes(jobs, device, ARCH)
    return {"conv2d_fprop": ptx[0]["asm"]["ptx"], "conv2d_wgrad": ptx[1]["asm"]["ptx"]}


@pytest.mark.parametrize("op", ["conv2d_fprop", "conv2d_wgrad"])
def test_the_packed_taps_kernels_gather_x_and_multiply_on_tcgen05(op, packed_ptx):
    ptx = packed_ptx[op]
    assert f".entry {op}_packed_kernel" in ptx
    assert re.search(r"tcgen05\.mma\.cta_group::1\.kind::f16", ptx) and "wgmma" not in ptx
    assert re.search(r"ld\.global(\.\w+)*\.b16", ptx), "x is not gathered through pointers"
    loads = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global\.(im2col\.)?mbarrier", ptx)
    assert loads and not any(loads), "the weights / grad_out come by plain tiled TMA, no im2col"
    # fprop's y leaves by TMA; wgrad's tiles (fp32 partials) from registers
    assert bool(re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx)) == (op == "conv2d_fprop")


# few output channels: the few-Co wgrad kernel (one tile per CTA): x by plain tiled TMA, read
# once; grad_out gathered per tap through pointers, no per-element integer division at stride 1
def test_the_few_co_wgrad_reads_x_by_tma_and_gathers_grad_out():
    device = device_for(ARCH)
    mod = conv2d_wgrad_blackwell
    base = {"N": 1, "H": 512, "W": 512, "Ci": 128, "Co": 3, "R": 3, "S": 3, "padding": 1, "dtype": "bfloat16"}
    jobs = []
    for stride in (1, 2):
        p = canonical_problem(mod.OP, dict(base, stride=stride))
        cfg = dict(mod.default_config(canonical_problem(mod.OP, dict(base, stride=1)), device))
        assert gwg.runs_few_co(p, cfg, mod.FEW_CO_NARROWEST)
        jobs.append((mod, p, cfg, 0))
    unit, strided = (r["asm"]["ptx"] for r in compile_in_fresh_processes(jobs, device, ARCH))
    for ptx in (unit, strided):
        assert ".entry conv2d_wgrad_few_co_kernel" in ptx
        assert re.search(r"tcgen05\.mma\.cta_group::1\.kind::f16", ptx) and "wgmma" not in ptx
        assert re.search(r"ld\.global(\.\w+)*\.b16", ptx), "grad_out is not gathered through pointers"
        loads = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global\.(im2col\.)?mbarrier", ptx)
        assert loads and not any(loads), "x comes by plain tiled TMA, no im2col"
    # per row and per column a few divisions either way; a stride adds two for every element
    divs = [len(re.findall(r"\bdiv\.s32\b", ptx)) for ptx in (unit, strided)]
    assert divs[1] >= divs[0] + 16, divs
