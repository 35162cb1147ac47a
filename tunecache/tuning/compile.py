"""Compile a Gluon backend's configs for an explicit target, on any host, no GPU needed.

`triton.compile(GluonASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 100, 32))`
runs the whole pipeline (Gluon IR -> TTGIR -> LLVM -> PTX -> ptxas cubin) on the CPU. Each
backend module says what to compile through `compile_specs(problem, config, device)`: one
KernelSpec per kernel launch of the op (a split-K wgrad is the GEMM plus the reduction).

Per config this reports what the compiler says: did it compile, the shared memory it asks
for (metadata), the tensor memory columns it allocates (metadata, sm_100), registers per
thread and the stack frame that holds spilled registers (ptxas' resource usage, read from
the cubin with cuobjdump: the `n_regs` Triton reports needs a GPU to load the binary),
compile seconds, and the error.

This module is what a compile worker runs (`compile_in_worker`, `asm_in_worker`) and the
reports it answers; `tunecache.tuning.compile_pool` hands configs to those workers.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any, Iterable, Mapping

from tunecache.errors import short
from tunecache.key import DeviceClass
from tunecache_kernels import hardware

# Explicit targets, named as `--arch` takes them: each architecture of the hardware table with
# its arch-specific ("a") features (WGMMA on sm_90a, tcgen05 and tensor memory on sm_100a).
# name -> (compute capability as Triton spells it, SM count of the usual part)
ARCHES = {f"{a.name}a": (10 * a.capability[0] + a.capability[1], a.usual_sm_count) for a in hardware.ARCHES.values()}
# per-block opt-in dynamic shared memory, and tensor memory columns per SM (0: none)
SMEM_LIMIT_BYTES = {f"{a.name}a": a.smem_per_block for a in hardware.ARCHES.values()}
TMEM_COLUMNS = {f"{a.name}a": a.tmem_columns for a in hardware.ARCHES.values()}

ERROR_CHARS = 4000


@dataclass
class KernelReport:
    """The compiler's word on one kernel of a config."""

    name: str
    compiled: bool
    shared: int | None = None
    tmem: int | None = None
    regs: int | None = None
    stack_bytes: int | None = None
    seconds: float = 0.0
    error: str | None = None
    reused: bool = False  # an identical spec was compiled for an earlier config of this run


@dataclass
class ConfigReport:
    """One config: `compiled` (every kernel compiled) and `ok` (compiled and fits the device:
    shared memory within the per-block limit, tensor memory within 512 columns). `error`
    says why not. Resource figures are the maximum over the config's kernels."""

    config: dict
    arch: str
    compiled: bool
    ok: bool
    shared: int | None = None
    tmem: int | None = None
    regs: int | None = None
    stack_bytes: int | None = None
    seconds: float = 0.0
    error: str | None = None
    pruned: bool | None = None  # set by compile_space: would the backend's prune() drop it?
    kernels: list[KernelReport] = field(default_factory=list)

    def to_json(self) -> dict:
        d = asdict(self)
        if self.pruned is None:
            d.pop("pruned")
        return d


# ---- targets ---------------------------------------------------------------------------------


def arch_of(target: str | DeviceClass) -> str:
    """'sm_100a' | 'sm_100' | DeviceClass -> 'sm_100a' (the explicit target's name)."""
    if isinstance(target, DeviceClass):
        cap = target.capability
        if cap is None:
            raise ValueError(f"{target} is the CPU interpreter: there is nothing to compile for it")
        name = f"sm_{cap[0]}{cap[1]}a"
    else:
        name = target if target.endswith("a") else f"{target}a"
    if name not in ARCHES:
        raise ValueError(f"unknown target {target!r}; expected one of {sorted(ARCHES)}")
    return name


def device_for(arch: str, sm_count: int | None = None) -> DeviceClass:
    """The DeviceClass a compile for `arch` stands for (its usual SM count unless given)."""
    arch = arch_of(arch)
    return DeviceClass(arch.removesuffix("a"), sm_count or ARCHES[arch][1], f"compile target {arch}")


def backend_module(op: str, backend: str) -> ModuleType:
    import importlib

    name = f"tunecache_kernels.{op}_{backend}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        raise ValueError(f"no backend {backend!r} for op {op!r} (module {name} not found)") from None


# ---- problems --------------------------------------------------------------------------------

# One problem per op that exercises every config of the spaces: large enough in every GEMM
# dimension that no tile is pruned for being larger than the problem, NHWC channel counts that
# need no padding, a 3x3 filter with padding (im2col offsets and a partial window).
_CONV = {
    "N": 32,
    "H": 56,
    "W": 56,
    "Ci": 256,
    "Co": 256,
    "R": 3,
    "S": 3,
    "stride": 1,
    "padding": 1,
    "dtype": "bfloat16",
}
# the conv's three ops share it: its forward, its weight gradient and its input gradient
REPRESENTATIVE = {
    "matmul": {"M": 4096, "N": 4096, "K": 4096, "dtype": "bfloat16"},
    "conv2d_fprop": _CONV,
    "conv2d_wgrad": _CONV,
    "conv2d_dgrad": _CONV,
}


def canonical_problem(op: str, given: dict | None = None) -> dict:
    """A shape as typed (the op's representative one if None) -> its canonical problem."""
    from tunecache.shapes import canonical_problem as canonical

    return canonical(op, REPRESENTATIVE[op] if given is None else given)


# ---- compiling one spec ------------------------------------------------------------------------


def spec_key(spec: Any, arch: str) -> str:
    """Identity of a compile: same key, same binary."""
    fn = spec.fn
    fn_name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', getattr(fn, '__name__', repr(fn)))}"
    ce = {str(k): repr(v) for k, v in spec.constexprs.items()}
    return json.dumps(
        [
            arch,
            fn_name,
            spec.signature,
            ce,
            spec.num_warps,
            spec.num_stages,
            spec.num_ctas,
            {k: repr(v) for k, v in sorted(spec.options.items())},
        ],
        sort_keys=True,
    )


def _resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers per thread, stack frame bytes per thread) of a cubin, from cuobjdump.

    The stack frame is where ptxas spills registers (these kernels keep no local arrays), so
    a nonzero one means the config does not fit the register file. With warp specialization
    the register count is the launch allocation (setmaxnreg moves registers between the
    partitions at run time)."""
    try:
        from triton import knobs

        tool = knobs.nvidia.cuobjdump.path
    except Exception:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None, None
    regs = [int(v) for v in re.findall(r"REG:(\d+)", out)]
    stack = [int(v) for v in re.findall(r"STACK:(\d+)", out)]
    return (max(regs) if regs else None), (max(stack) if stack else None)


_INT_TYPES = ("i1", "i8", "i16", "i32", "i64", "u1", "u8", "u16", "u32", "u64")


def jit_attrs(spec: Any) -> dict:
    """The attributes a launch's JIT gives the kernel's arguments (JITFunction._pack_args):
    none for a constexpr, 16-byte divisibility for a pointer (the backends' buffers are
    allocations, aligned), nothing for a tensor descriptor or an unspecialized int. They are
    part of Triton's cache key: a compile without them is compiled again at the first launch.
    An int the JIT specializes by value cannot be known here, so backends mark their shape
    arguments do_not_specialize (ValueError otherwise)."""
    from triton.backends.compiler import BaseBackend

    attrs = {}
    for i, param in enumerate(spec.fn.params):
        ty = spec.signature[param.name]
        if ty == "constexpr":
            attrs[(i,)] = BaseBackend.parse_attr("")
        elif ty.startswith("*") and not param.do_not_specialize:
            attrs[(i,)] = BaseBackend.parse_attr("" if param.do_not_specialize_on_alignment else "D")
        elif ty in _INT_TYPES and not param.do_not_specialize:
            raise ValueError(
                f"{spec.name or spec.fn.__name__}: int argument {param.name!r} is specialized by value at launch; "
                "mark it do_not_specialize so one compile serves every value"
            )
    return attrs


def spec_source(spec: Any, arch: str) -> tuple[Any, dict]:
    """(source, options) of one KernelSpec exactly as a launch's JIT would compile it: same
    signature text, attributes and options, so the launch finds the binary in Triton's cache."""
    from triton.compiler import ASTSource

    is_gluon = getattr(spec.fn, "is_gluon", lambda: False)()
    if is_gluon:
        from triton.experimental.gluon import GluonASTSource as source_cls
    else:
        source_cls = ASTSource
    options = dict(num_warps=spec.num_warps, num_ctas=spec.num_ctas)
    if spec.num_stages is not None:
        options["num_stages"] = spec.num_stages
    options.update(spec.options)
    return source_cls(spec.fn, spec.signature, spec.constexprs, jit_attrs(spec)), options


def target_of(arch: str):
    """Triton's GPUTarget for an explicit target name."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", ARCHES[arch_of(arch)][0], 32)


def compile_spec(spec: Any, arch: str):
    """`triton.compile` one KernelSpec for an explicit target (as a launch would, see
    spec_source); returns the CompiledKernel."""
    import triton

    src, options = spec_source(spec, arch)
    return triton.compile(src, target=target_of(arch), options=options)


class _Allocated(Exception):
    """Raised by allocation_of's stand-in for the LLVM stage: the memory the passes allocated."""

    def __init__(self, shared: int | None, tmem: int | None) -> None:
        super().__init__(shared, tmem)
        self.shared, self.tmem = shared, tmem


def _allocation_hook(*args):
    """Triton's add_stages_inspection_hook for allocation_of: called bare for the cache key it
    adds (so nothing it leaves in Triton's cache is taken for a whole compile), then with the
    backend's stages, whose LLVM stage becomes make_llir's passes up to the shared- and
    tensor-memory allocation (Triton 3.9's nvidia backend), which then stops the compile."""
    if not args:
        return "tunecache-allocation-only", "tunecache-allocation-only"
    backend, stages, options, _language, capability = args

    def allocate(src, metadata):
        from triton._C.libtriton import ir, nvidia, passes
        from triton.backends.nvidia.compiler import get_ptx_version_from_options

        ptx_version = get_ptx_version_from_options(options, backend.target.arch)
        pm = ir.pass_manager(src.context)
        passes.ttgpuir.add_combine_tensor_select_and_if(pm)
        passes.ttgpuir.add_allocate_warp_groups(pm, False)
        passes.convert.add_scf_to_cf(pm)
        passes.gluon.add_inliner(pm)
        nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, capability, ptx_version)
        nvidia.passes.ttnvgpuir.add_allocate_tensor_memory(pm)
        pm.run(src, "tunecache_allocation")
        raise _Allocated(src.get_int_attr("ttg.shared"), src.get_int_attr("ttg.tensor_memory_size"))

    stages["llir"] = allocate


def allocation_of(spec: Any, arch: str) -> tuple[int | None, int | None]:
    """(shared bytes, tensor-memory columns) of a spec as the compiler allocates them, without
    lowering to LLVM or running ptxas (most of a compile's time): enough to show that a config
    cannot fit, not that it compiles."""
    from triton import knobs

    before = knobs.runtime.add_stages_inspection_hook
    knobs.runtime.add_stages_inspection_hook = _allocation_hook
    try:
        kernel = compile_spec(spec, arch)
    except _Allocated as a:
        return a.shared, a.tmem
    finally:
        knobs.runtime.add_stages_inspection_hook = before
    md = kernel.metadata  # the compile ran whole (the hook went unused): its own figures
    return int(md.shared), getattr(md, "tmem_size", None)


def report_spec(spec: Any, arch: str, unfit_suffices: bool = False) -> KernelReport:
    """Compile one spec and read what the compiler says about it; never raises.
    unfit_suffices: a spec whose allocation alone does not fit the target is reported as not
    compiled, without the rest of the compile (allocation_of)."""
    name = spec.name or getattr(spec.fn, "__name__", "kernel")
    t0 = time.perf_counter()
    if unfit_suffices:
        try:
            shared, tmem = allocation_of(spec, arch)
        except Exception:  # noqa: BLE001 - the whole compile below reports it
            shared = tmem = None
        probe = KernelReport(name, False, shared=shared, tmem=tmem, seconds=time.perf_counter() - t0)
        why = resource_error(probe, arch)
        if why is not None:
            probe.error = f"{why} as allocated (not compiled further)"
            return probe
    try:
        kernel = compile_spec(spec, arch)
    except Exception as e:  # a compile error is a result, not a failure of this tool
        return KernelReport(name, False, seconds=time.perf_counter() - t0, error=short(_describe(e), ERROR_CHARS))
    seconds = time.perf_counter() - t0
    md = kernel.metadata
    tmem = getattr(md, "tmem_size", None)
    regs, spill = _resource_usage(kernel.asm["cubin"]) if "cubin" in kernel.asm else (None, None)
    return KernelReport(
        name,
        True,
        shared=int(md.shared),
        tmem=None if tmem is None else int(tmem),
        regs=regs,
        stack_bytes=spill,
        seconds=seconds,
    )


def _describe(e: BaseException) -> str:
    """The error and its causes, innermost last (a CompilationError's cause says what broke)."""
    parts = []
    while e is not None and len(parts) < 5:
        parts.append("".join(traceback.format_exception_only(type(e), e)).strip())
        e = e.__cause__ or (e.__context__ if not e.__suppress_context__ else None)
    return "\nCaused by: ".join(parts)


# ---- what a compile worker runs --------------------------------------------------------------------------


def compile_in_worker(
    module_name: str,
    problem: dict,
    config: dict,
    index: int,
    arch: str,
    device: tuple[str, int],
    unfit_suffices: bool = False,
) -> KernelReport:
    import importlib

    mod = importlib.import_module(module_name)
    spec = mod.compile_specs(problem, config, DeviceClass(*device))[index]
    return report_spec(spec, arch, unfit_suffices)


def asm_in_worker(
    module_name: str, problem: dict, config: dict, index: int, arch: str, device: tuple[str, int]
) -> dict:
    import importlib

    mod = importlib.import_module(module_name)
    spec = mod.compile_specs(problem, config, DeviceClass(*device))[index]
    kernel = compile_spec(spec, arch)
    return {"asm": {k: v for k, v in kernel.asm.items() if isinstance(v, str)}, "shared": int(kernel.metadata.shared)}


def config_report(cfg: dict, arch: str, entry, results: Mapping[int, KernelReport]) -> ConfigReport:
    if isinstance(entry, str):
        return ConfigReport(cfg, arch, compiled=False, ok=False, error=entry)
    kernels = []
    for idx, shared in entry:
        r = results[idx]
        kernels.append(
            KernelReport(**{**asdict(r), "reused": shared, "seconds": 0.0 if shared else round(r.seconds, 3)})
        )
    compiled = all(k.compiled for k in kernels)

    def most(attr):
        vals = [getattr(k, attr) for k in kernels if getattr(k, attr) is not None]
        return max(vals) if vals else None

    rep = ConfigReport(
        cfg,
        arch,
        compiled=compiled,
        ok=False,
        shared=most("shared"),
        tmem=most("tmem"),
        regs=most("regs"),
        stack_bytes=most("stack_bytes"),
        seconds=round(sum(k.seconds for k in kernels), 3),
        kernels=kernels,
    )
    if not compiled:
        rep.error = next(k.error for k in kernels if not k.compiled)
        return rep
    rep.error = resource_error(rep, arch)
    rep.ok = rep.error is None
    return rep


def resource_error(rep: ConfigReport | KernelReport, arch: str) -> str | None:
    """Why a compiled config cannot launch on the target (None: it fits)."""
    limit = SMEM_LIMIT_BYTES[arch]
    if rep.shared is not None and rep.shared > limit:
        return f"shared memory {rep.shared} B exceeds the {arch} limit of {limit} B per block"
    columns = TMEM_COLUMNS[arch]
    if rep.tmem is not None and rep.tmem > columns:
        return f"tensor memory {rep.tmem} columns exceeds the {columns} of an SM"
    return None


def report_lines(reports: list[ConfigReport], *, kernel: str) -> Iterable[str]:
    """One JSON object per config (the `tunecache compile` output)."""
    for r in reports:
        d = r.to_json()
        d["kernel"] = kernel
        d.pop("kernels")
        d["kernels"] = [{k: v for k, v in asdict(kr).items() if v is not None} for kr in r.kernels]
        yield json.dumps(d, sort_keys=False)
