"""Every config of every Gluon space compiles for its target on this CPU-only host, and the
pruning rules agree with the compiler.

Blackwell spaces are compiled for sm_100a, Hopper spaces for sm_90a, each on a
representative problem per op (tunecache.tuning.compile.REPRESENTATIVE: large enough that no tile
is larger than the problem). For every config of the whole space:
- a config that passes the backend's prune() must compile and fit the device (the
  compiler's shared memory within the per-block limit, tensor memory within 512 columns);
- a config that prune() drops must not be one that compiles and fits: pruning may only
  remove what the compiler would reject or the device could not launch (where the compiler's
  allocation alone does not fit, the compile stops there: tunecache.tuning.compile.allocation_of).
Registers are the one judgment call: a config whose registers spill (ptxas gives it a stack
frame) still launches, so prune() may keep it, and it is slow, so prune() may drop it.
The configs the rules drop are compiled too, to check the second point. Identical kernels
are compiled once and in parallel on every core (tunecache.tuning.compile), and the ring depths are
sampled (_sampled), so the whole run fits a CI budget on a 2-core machine.

Only compilation is checked here: that the Blackwell kernels compute the right answer needs a
Blackwell GPU (the shared host code runs on an H100 through the Hopper backend's tests).
"""

from __future__ import annotations

import functools
import importlib
import json
import time

import pytest

pytest.importorskip("triton")

from tunecache.shapes import OPS
from tunecache.tuning.compile import ConfigReport, canonical_problem, device_for
from tunecache.tuning.compile_pool import compile_configs
from tunecache_kernels.gluon_hopper import accumulator_per_thread
from tunecache_kernels.spaces import space_for

TARGETS = {"blackwell": "sm_100a", "hopper": "sm_90a"}


def _module(op: str, backend: str):
    name = f"tunecache_kernels.{op}_{backend}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:
            pytest.skip(f"kernels/{op}_{backend}.py does not exist (yet)")
        raise


def _show(reports: list[ConfigReport], limit: int = 8) -> str:
    lines = []
    for r in reports[:limit]:
        err = (r.error or "").strip().splitlines()
        lines.append(
            f"  {json.dumps(r.config)}: compiled={r.compiled} shared={r.shared} tmem={r.tmem} "
            f"stack={r.stack_bytes} "
            f"-- {err[-1] if err else ''}"
        )
    if len(reports) > limit:
        lines.append(f"  ... and {len(reports) - limit} more")
    return "\n".join(lines)


def _ring(config: dict) -> str:
    return "num_stages" if "num_stages" in config else "NUM_BUFFERS"


def _families(configs: list[dict]) -> dict[str, list[dict]]:
    """Configs that differ only in their ring's depth, shallowest first."""
    fams: dict[str, list[dict]] = {}
    for c in configs:
        ring = _ring(c)
        fams.setdefault(json.dumps({k: v for k, v in c.items() if k != ring}, sort_keys=True), []).append(c)
    return {k: sorted(v, key=lambda c: c[_ring(c)]) for k, v in fams.items()}


def _holds_no_accumulator(mod, c: dict) -> bool:
    """A WGMMA (Hopper) tile whose fp32 accumulator alone takes 256 or more registers a thread:
    a thread has 255, so it spills whatever the rest of the kernel does, and prune() drops it
    (gluon_hopper.wgmma_resources_ok; asserted in _sampled). Compiling it, ptxas spilling a
    whole tile (the slowest compiles of the spaces), could only confirm that. (A swapped matmul
    launches another tile: gluon_matmul.matmul_as_launched.)"""
    if mod.BACKEND != "hopper" or c.get("SWAP_AB"):
        return False
    return accumulator_per_thread(c) >= 256


def _sampled(mod, configs: list[dict], problem: dict, device) -> list[dict]:
    """The configs whose compile is not implied by another's. Within a family of ring depths the
    kernel is the same code with a deeper ring (a loop bound and a modulus), and its shared
    memory grows with the depth; prune() keeps a family's shallowest rings up to a depth and
    drops the deeper ones (asserted here). So the deepest kept ring compiles and fits => every
    shallower one does, and the shallowest dropped one does not fit => no deeper one does:
    those two are compiled, the rest follow; and each ring depth the space has is compiled in
    some family where prune() keeps it (its loop bounds' code). About a quarter of the distinct
    kernels of the spaces. Tiles whose accumulator cannot fit a thread's registers are not
    compiled (_holds_no_accumulator)."""
    kept = {json.dumps(c, sort_keys=True) for c in mod.prune(configs, problem, device)}
    spill = [c for c in configs if _holds_no_accumulator(mod, c)]
    assert not any(json.dumps(c, sort_keys=True) in kept for c in spill), (
        f"{mod.KERNEL}: prune() keeps a tile that must spill"
    )
    configs = [c for c in configs if not _holds_no_accumulator(mod, c)]
    out: list[dict] = []
    first_kept: dict[int, dict] = {}  # ring depth -> a kept config of that depth
    for fam in _families(configs).values():
        is_kept = [json.dumps(c, sort_keys=True) in kept for c in fam]
        depths = [c[_ring(c)] for c in fam]
        assert is_kept == sorted(is_kept, reverse=True), (
            f"{mod.KERNEL}: prune() keeps ring depths {[d for d, k in zip(depths, is_kept) if k]} of {depths} "
            f"for {fam[0]}: not the shallowest ones, so a dropped ring sits between kept ones"
        )
        n = sum(is_kept)
        out += fam[max(0, n - 1) : n + 1]
        for c in fam[:n]:
            first_kept.setdefault(c[_ring(c)], c)
    covered = {c[_ring(c)] for c in out if json.dumps(c, sort_keys=True) in kept}
    return out + [c for d, c in sorted(first_kept.items()) if d not in covered]


# the spaces are compiled a slice at a time: pytest shows progress, and a failure names its slice
CHUNK = 120


@functools.cache
def _space_sample(op: str, backend: str) -> tuple[str, ...]:
    mod = _module(op, backend)
    device = device_for(TARGETS[backend])
    return tuple(json.dumps(c) for c in _sampled(mod, list(space_for(mod.KERNEL)), canonical_problem(op), device))


def _slices():
    for op in OPS:
        for backend in sorted(TARGETS):
            try:
                n = len(_space_sample(op, backend))
            except (KeyError, pytest.skip.Exception):
                n = 0
            for i in range(max(1, -(-n // CHUNK))):
                yield pytest.param(op, backend, i, id=f"{op}-{backend}-{i + 1}of{max(1, -(-n // CHUNK))}")


@pytest.mark.parametrize("op,backend,part", list(_slices()))
def test_space_compiles_and_pruning_agrees(op, backend, part, record_property):
    mod = _module(op, backend)
    configs = [json.loads(c) for c in _space_sample(op, backend)[part * CHUNK : (part + 1) * CHUNK]]
    label = f"sampled configs {part * CHUNK}-"
    _compile_and_check(mod, canonical_problem(op), configs, TARGETS[backend], label, record_property)


def test_the_sample_covers_every_kernel_kind_and_ring_depth():
    """The sample still holds every ring depth of each space (one prune() keeps) and, for every
    family the space has, a config (no family is skipped whole but those whose accumulator
    cannot fit a thread's registers)."""
    for op in OPS:
        for backend in sorted(TARGETS):
            mod = _module(op, backend)
            space = list(space_for(mod.KERNEL))
            sample = [json.loads(c) for c in _space_sample(op, backend)]
            ring = _ring(space[0])
            device, problem = device_for(TARGETS[backend]), canonical_problem(op)
            kept_depths = {c[ring] for c in mod.prune(space, problem, device)}
            assert {c[ring] for c in mod.prune(sample, problem, device)} == kept_depths, (op, backend)
            held = _families([c for c in space if not _holds_no_accumulator(mod, c)])
            assert _families(sample).keys() == held.keys(), (op, backend)
            assert len(sample) < len(space)


# Few input channels take the packed-taps kernels (gluon_packed_taps.packs_taps). Every config the
# backend would tune for a stem-like conv (Co = 256, so that no N tile is pruned as too wide)
# is compiled, ring depths sampled as above, with the same two checks.
PACKED = {"N": 32, "H": 224, "W": 224, "Ci": 3, "Co": 256, "R": 7, "S": 7, "stride": 2, "padding": 3}
PACKED["dtype"] = "bfloat16"


@pytest.mark.parametrize("backend", sorted(TARGETS))
@pytest.mark.parametrize("op", ["conv2d_fprop", "conv2d_wgrad"])
def test_packed_taps_kernels_compile_and_pruning_agrees(op, backend, record_property):
    mod = _module(op, backend)
    arch = TARGETS[backend]
    problem = canonical_problem(op, PACKED)
    configs = mod.config_space(problem, device_for(arch))
    assert {s.name for s in mod.compile_specs(problem, configs[0], device_for(arch))} & {f"{op}_packed_kernel"}
    configs = _sampled(mod, configs, problem, device_for(arch))
    _compile_and_check(mod, problem, configs, arch, "packed-taps configs ", record_property)


# Few output tiles: batch 1 at 7x7 (ResNet-50's layer4: 16 tiles of 128 x 256 on 132 or 148 SMs)
# and a decode GEMM (M = 16). Every config that splits K there (SPLIT_K 0 where the work model
# splits) launches the split binary, whose fp32 partials leave from registers: no output tile in
# shared memory, so deeper rings fit than in the unsplit binary, and prune() must know which
# binary a config launches.
SPLIT_CONV = {"N": 1, "H": 7, "W": 7, "Ci": 512, "Co": 512, "R": 3, "S": 3, "stride": 1, "padding": 1}
SPLIT_PROBLEMS = {
    "conv2d_fprop": SPLIT_CONV,
    "conv2d_dgrad": SPLIT_CONV,
    "matmul": {"M": 16, "N": 4096, "K": 4096, "a_layout": "row", "b_layout": "col"},
}


def _runs_split(mod, problem: dict, config: dict, device) -> bool:
    """The launch is a split one: a conv's with its reduction, a matmul's split binary."""
    specs = mod.compile_specs(problem, config, device)
    return any(s.name == "split_k_reduce" or s.constexprs.get("SPLIT") for s in specs)


@pytest.mark.parametrize("backend", sorted(TARGETS))
@pytest.mark.parametrize("op", sorted(SPLIT_PROBLEMS))
def test_split_kernels_compile_and_pruning_agrees(op, backend, record_property):
    mod = _module(op, backend)
    device = device_for(TARGETS[backend])
    problem = canonical_problem(op, dict(SPLIT_PROBLEMS[op], dtype="bfloat16"))
    configs = [c for c in mod.config_space(problem, device) if c["SPLIT_K"] == 0 and not c.get("SWAP_AB")]
    assert configs and all(_runs_split(mod, problem, c, device) for c in configs)
    configs = _sampled(mod, configs, problem, device)
    _compile_and_check(mod, problem, configs, TARGETS[backend], "split configs ", record_property)


# Few output channels take the few-Co wgrad kernels where the config's BLOCK_N is their width
# (gluon_wgrad.runs_few_co). Every such config the backend would tune for an image head (the SD
# VAE's decoder.conv_out), ring depths sampled as above, with the same two checks; and a strided
# one (the gather's division by the stride) at the untuned call's tile.
FEW_CO = {"N": 1, "H": 512, "W": 512, "Ci": 128, "Co": 3, "R": 3, "S": 3, "stride": 1, "padding": 1}
FEW_CO["dtype"] = "bfloat16"


@pytest.mark.parametrize("backend", sorted(TARGETS))
def test_few_co_wgrad_kernels_compile_and_pruning_agrees(backend, record_property):
    from tunecache_kernels import gluon_wgrad as gwg

    mod = _module("conv2d_wgrad", backend)
    arch = TARGETS[backend]
    device = device_for(arch)
    problem = canonical_problem("conv2d_wgrad", FEW_CO)
    configs = [c for c in mod.config_space(problem, device) if gwg.runs_few_co(problem, c, mod.FEW_CO_NARROWEST)]
    assert gwg.runs_few_co(problem, mod.default_config(problem, device), mod.FEW_CO_NARROWEST)
    assert {s.name for s in mod.compile_specs(problem, configs[0], device)} & {"conv2d_wgrad_few_co_kernel"}
    _compile_and_check(mod, problem, _sampled(mod, configs, problem, device), arch, "few-Co configs ", record_property)
    strided = canonical_problem("conv2d_wgrad", dict(FEW_CO, N=2, H=64, W=64, stride=2))
    cfg = dict(mod.default_config(problem, device))
    assert gwg.runs_few_co(strided, cfg, mod.FEW_CO_NARROWEST) and cfg in mod.prune([cfg], strided, device)
    (report,) = compile_configs(mod, strided, [cfg], device)
    assert report.ok, report.error


def _compile_and_check(mod, problem: dict, configs: list[dict], arch: str, label: str, record_property) -> None:
    device = device_for(arch)
    t0 = time.perf_counter()
    kept = {json.dumps(c, sort_keys=True) for c in mod.prune(configs, problem, device)}
    # a config prune() drops need only be shown not to fit: its kernels stop at the compiler's
    # allocation where that does not fit (tunecache.tuning.compile.allocation_of), else compile whole
    reports = compile_configs(
        mod, problem, configs, device, unfit_suffices=lambda c: json.dumps(c, sort_keys=True) not in kept
    )
    for r in reports:
        r.pruned = json.dumps(r.config, sort_keys=True) not in kept
    wall = time.perf_counter() - t0
    assert len(reports) == len(configs)

    compiles = sum(1 for r in reports for k in r.kernels if not k.reused)
    record_property("configs", len(reports))
    record_property("distinct_kernels", compiles)
    record_property("wall_seconds", round(wall, 1))
    print(
        f"{mod.KERNEL} for {arch}, {label}({len(configs)}): {compiles} distinct "
        f"kernels, {sum(not r.pruned for r in reports)} kept by prune, {sum(r.ok for r in reports)} fit, "
        f"{wall:.1f} s"
    )

    kept_but_broken = [r for r in reports if not r.pruned and not r.ok]
    assert not kept_but_broken, (
        f"{len(kept_but_broken)} config(s) of {mod.KERNEL} pass prune() but fail to compile or do not fit "
        f"{arch}:\n{_show(kept_but_broken)}"
    )
    pruned_but_fit = [r for r in reports if r.pruned and r.ok and not r.stack_bytes]
    assert not pruned_but_fit, (
        f"{len(pruned_but_fit)} config(s) of {mod.KERNEL} are dropped by prune() although they compile, fit "
        f"{arch} and spill no registers (prune may only drop what the compiler or the device rejects; "
        f"problem-size heuristics belong in config_space()):\n{_show(pruned_but_fit)}"
    )


# Problems that take the other code paths of the kernels: operands stored transposed,
# 1x1 convolutions read by plain tiled TMA, channel counts padded for TMA, strided windows.
VARIANTS = {
    "matmul": [
        {"M": 1000, "N": 520, "K": 96, "dtype": "float16", "a_layout": "col", "b_layout": "col"},
        {"M": 64, "N": 4096, "K": 4096, "dtype": "bfloat16", "a_layout": "row", "b_layout": "col"},
    ],
    "conv2d_fprop": [
        {"N": 8, "H": 28, "W": 28, "Ci": 64, "Co": 128, "R": 1, "S": 1, "stride": 1, "padding": 0, "dtype": "float16"},
        # few tiles (batch 1 at 7x7): the default splits K (the split binary and its reduction)
        {"N": 1, "H": 7, "W": 7, "Ci": 512, "Co": 512, "R": 3, "S": 3, "stride": 1, "padding": 1, "dtype": "bfloat16"},
        # and a batch-1 1x1 (x read by plain tiled TMA) that splits; an image head (a 16-wide N tile)
        {
            "N": 1,
            "H": 14,
            "W": 14,
            "Ci": 1024,
            "Co": 256,
            "R": 1,
            "S": 1,
            "stride": 1,
            "padding": 0,
            "dtype": "float16",
        },  # noqa: E501
        {"N": 1, "H": 64, "W": 64, "Ci": 128, "Co": 3, "R": 3, "S": 3, "stride": 1, "padding": 1, "dtype": "bfloat16"},
        {"N": 4, "H": 224, "W": 224, "Ci": 3, "Co": 64, "R": 7, "S": 7, "stride": 2, "padding": 3, "dtype": "bfloat16"},
    ],
    "conv2d_wgrad": [
        {"N": 8, "H": 28, "W": 28, "Ci": 64, "Co": 128, "R": 1, "S": 1, "stride": 1, "padding": 0, "dtype": "float16"},
        {"N": 2, "H": 14, "W": 14, "Ci": 5, "Co": 96, "R": 3, "S": 3, "stride": 2, "padding": 1, "dtype": "bfloat16"},
    ],
    # a pointwise 1x1 (grad_out tiled, TMA store), the stem at stride 2 (w's rows padded, 2-byte
    # stores into the phases), 3 output channels (grad_out padded)
    "conv2d_dgrad": [
        {"N": 8, "H": 28, "W": 28, "Ci": 64, "Co": 128, "R": 1, "S": 1, "stride": 1, "padding": 0, "dtype": "float16"},
        {"N": 4, "H": 224, "W": 224, "Ci": 3, "Co": 64, "R": 7, "S": 7, "stride": 2, "padding": 3, "dtype": "bfloat16"},
        {"N": 1, "H": 64, "W": 64, "Ci": 128, "Co": 3, "R": 3, "S": 3, "stride": 1, "padding": 1, "dtype": "bfloat16"},
        # few tiles at stride 1: the Hopper default splits K (the split binary and its reduction)
        {"N": 1, "H": 64, "W": 64, "Ci": 4, "Co": 512, "R": 3, "S": 3, "stride": 1, "padding": 1, "dtype": "bfloat16"},
    ],
}


@pytest.mark.parametrize("backend", sorted(TARGETS))
@pytest.mark.parametrize("op", OPS)
def test_default_config_compiles_on_other_code_paths(op, backend):
    mod = _module(op, backend)
    arch = TARGETS[backend]
    device = device_for(arch)
    problems = [canonical_problem(op, v) for v in VARIANTS[op]]
    problems = [p for p in problems if mod.supports(p, device)]
    if not problems:
        pytest.skip(f"{mod.KERNEL} supports none of the variant problems")
    for p in problems:
        cfg = mod.default_config(p, device)
        assert cfg in mod.prune(mod.config_space(p, device), p, device), f"default {cfg} is not a candidate for {p}"
        (report,) = compile_configs(mod, p, [cfg], device)
        assert report.ok, f"{mod.KERNEL} default config {cfg} on {p}: {report.error}"


# ---- the compile path itself -------------------------------------------------------------------


def test_the_allocation_alone_gives_the_whole_compiles_memory():
    """A dropped config that needs only be shown not to fit stops at the compiler's memory
    allocation (the space checks above): that reports the whole compile's shared and tensor
    memory, for the shallowest ring prune() drops of a tile of each target."""
    for op, backend in (("conv2d_wgrad", "hopper"), ("matmul", "hopper"), ("conv2d_wgrad", "blackwell")):
        mod, arch = _module(op, backend), TARGETS[backend]
        device, problem = device_for(arch), canonical_problem(op)
        space = list(space_for(mod.KERNEL))
        kept = {json.dumps(c, sort_keys=True) for c in mod.prune(space, problem, device)}
        fams = list(_families(space).values())
        is_kept = [[json.dumps(c, sort_keys=True) in kept for c in f] for f in fams]
        fam, flags = next((f, k) for f, k in zip(fams, is_kept) if k[0] and not k[-1])
        dropped = fam[flags.index(False)]
        (whole,) = compile_configs(mod, problem, [dropped], device)
        (stopped,) = compile_configs(mod, problem, [dropped], device, unfit_suffices=lambda c: True)
        assert whole.compiled and not whole.ok, (op, backend, whole.error)
        assert not stopped.compiled and "as allocated" in stopped.error, (op, backend, stopped.error)
        assert (stopped.shared, stopped.tmem) == (whole.shared, whole.tmem), (op, backend)


def test_a_config_the_compiler_rejects_is_reported_not_raised():
    from tunecache_kernels import matmul_blackwell as mod

    device = device_for("sm_100a")
    p = canonical_problem("matmul")
    good = mod.default_config(p, device)
    # a 256-row tile needs a 2-CTA MMA the kernel does not use; 7 stages of 128x256x128 do
    # not fit shared memory: neither is in the space, both must come back as reports
    bad_mma = dict(good, BLOCK_M=256)
    too_big = dict(good, BLOCK_N=256, BLOCK_K=128, NUM_BUFFERS=7)
    reports = compile_configs(mod, p, [bad_mma, good, too_big, good], device)
    assert [r.config for r in reports] == [bad_mma, good, too_big, good]
    assert not reports[0].compiled and not reports[0].ok and reports[0].error
    assert reports[1].ok and reports[1].error is None and reports[1].shared > 0 and reports[1].tmem
    assert reports[2].compiled and not reports[2].ok and "shared memory" in reports[2].error
    assert reports[3].ok and reports[3].kernels[0].reused  # the same kernel, compiled once


def test_cli_prints_one_json_line_per_candidate():
    from typer.testing import CliRunner

    from tunecache.cli import app
    from tunecache_kernels import matmul_blackwell as mod

    result = CliRunner().invoke(
        app,
        [
            "compile",
            "--op",
            "matmul",
            "--backend",
            "blackwell",
            "--arch",
            "sm_100a",
            "--problem",
            "M=64,N=64,K=64,dtype=float16",
        ],
    )
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    p = canonical_problem("matmul", {"M": 64, "N": 64, "K": 64, "dtype": "float16"})
    device = device_for("sm_100a")
    assert [d["config"] for d in lines] == mod.prune(mod.config_space(p, device), p, device)
    for d in lines:
        assert d["kernel"] == "matmul.blackwell" and d["arch"] == "sm_100a"
        assert d["ok"] and not d["pruned"] and d["shared"] > 0 and d["tmem"] > 0 and d["regs"] > 0
        assert set(d) >= {"ok", "shared", "tmem", "regs", "seconds", "error"}

    bad = CliRunner().invoke(app, ["compile", "--op", "matmul", "--backend", "blackwell", "--arch", "sm_80"])
    assert bad.exit_code == 2 and "unknown target" in bad.output
