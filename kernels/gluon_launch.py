"""Launching a compiled Gluon kernel directly, past JITFunction.run (the Hopper backends).

`kernel[grid](...)` costs 40-100 us of CPU per call in JITFunction.run (binding and specializing
every argument, hashing the cache key) and in the launcher, which rebuilds each TMA descriptor's
CUtensorMap (cuTensorMapEncode*) from the TensorDescriptor on every launch. For short kernels
that host time is the runtime. A backend instead keeps, per (config, problem), a plan holding
the CompiledKernel that its first JIT launch returned and launches it through Triton's C
launcher with the arguments already expanded; the CUtensorMaps are cached per base address.

A CUtensorMap is a pure function of (base address, dtype, shape, strides, block, swizzle, im2col
geometry); a plan fixes everything but the address, so a map cached under (slot, address) is
right for any tensor at that address, even one allocated after the first was freed: the cache
holds no tensor and keeps no memory alive.

A planned split-K launch keeps its second pass too (SplitReduce), and its fp32 partials in a
buffer kept per stream (stream_workspace): the Hopper backends' alone, so they live here.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch

from . import gluon_host as gh
from .gluon_host import cdiv
from .gluon_split_k import SPLIT_K_REDUCE_WARPS, per_stream, split_k_reduce_block

# On unless the runtime turns it off: tunecache passes its setting (TUNECACHE_GLUON_DIRECT_LAUNCH)
# through `set_direct_launch`; the kernels read no settings of their own.
DIRECT_LAUNCH = True


def set_direct_launch(on: bool) -> None:
    global DIRECT_LAUNCH
    DIRECT_LAUNCH = bool(on)


def direct_launch_enabled() -> bool:
    """Off when turned off (`set_direct_launch`), and while a Triton launch hook (a profiler such
    as proton) is installed: those hooks only run on JITFunction.run's path."""
    if not DIRECT_LAUNCH:
        return False
    rt = _knobs_runtime()
    return _hook_idle(rt.launch_enter_hook) and _hook_idle(rt.launch_exit_hook)


@functools.lru_cache(maxsize=1)
def _knobs_runtime():
    from triton import knobs

    return knobs.runtime


@functools.lru_cache(maxsize=1)
def _hook_chain_type():
    try:
        from triton.knobs import HookChain
    except ImportError:  # older Triton: hooks are plain callables or None
        return None
    return HookChain


def _hook_idle(h) -> bool:
    """No launch hook: None, or (Triton 3.9) an empty HookChain."""
    if h is None:
        return True
    chain = _hook_chain_type()
    return chain is not None and type(h) is chain and not h.calls


def current_device_and_stream() -> tuple[int, int]:
    """(device index, raw stream handle), as JITFunction.run picks them."""
    fns = _DEVICE_FNS or _device_fns()
    dev = fns[0]()
    return dev, fns[1](dev)


_DEVICE_FNS: tuple | None = None


def _device_fns() -> tuple:
    """The active Triton driver's (current device, current stream) functions; with PyTorch's,
    the current device without torch.cuda.current_device's lazy-init check (a plan launches only
    after a JIT launch has initialized CUDA): a plan's launch is this host's hot path."""
    global _DEVICE_FNS
    from triton.runtime import driver

    d = driver.active
    dev_fn, stream_fn = d.get_current_device, d.get_current_stream
    try:
        import torch

        if dev_fn is torch.cuda.current_device and torch.cuda.is_initialized():
            dev_fn = torch._C._cuda_getDevice
    except (ImportError, AttributeError):
        pass
    _DEVICE_FNS = (dev_fn, stream_fn)
    return _DEVICE_FNS


def look_up(plans: "PlanCache", plan_key, config: dict, args: tuple) -> tuple:
    """(plan key, plan or None, device index, stream) of the call `args` under `config`: a
    backend's launch asks this first; the key is None where the arguments cannot key a plan."""
    dev, stream = current_device_and_stream()
    key = plan_key(dev, config, *args)
    return key, None if key is None else plans.get(key), dev, stream


def plan_for(plans: "PlanCache", plan_key, config: dict, args: tuple):
    """(plan, device index) of the call `args` under `config`, once its first launch made one;
    else None. A memo entry (tunecache.ops.launcher) keeps it: its key fixes everything the plan
    depends on but the device, which the entry checks per call."""
    if not direct_launch_enabled():
        return None
    _, plan, dev, _ = look_up(plans, plan_key, config, args)
    return None if plan is None else (plan, dev)


class DirectLauncher:
    """Launches one CompiledKernel through Triton's C launcher, without JITFunction.run.

    `args` is the kernel's full argument list in parameter order, constexprs included (the
    launcher skips them), with each TMA descriptor replaced by its expansion
    (`expand_desc`): [CUtensorMap, *shape, *strides], flattened in place.
    Build with `DirectLauncher.of(compiled)`, which gives None where this Triton's launcher
    does something per launch that the direct path would skip (scratch buffers, GSan, no
    descriptor metadata); callers then stay on the JIT path.
    """

    __slots__ = (
        "compiled",
        "function",
        "packed",
        "coop",
        "pdl",
        "annotations",
        "kernel_signature",
        "desc_meta",
        "n_args",
        "_launch",
    )

    @classmethod
    def of(cls, compiled) -> "DirectLauncher | None":
        if compiled is None or not DIRECT_LAUNCH:
            return None
        try:
            return cls(compiled)
        except _Unsupported:
            return None

    def __init__(self, compiled):
        from triton.runtime import driver

        cl = compiled.run  # the CudaLauncher (loads the module on first use)
        try:
            if getattr(cl, "gsan_enabled", False) or cl.global_scratch_size or cl.profile_scratch_size:
                raise _Unsupported
            self.coop, self.pdl = cl.launch_cooperative_grid, cl.launch_pdl
            self.annotations, self.kernel_signature = cl.arg_annotations, cl.kernel_signature
            self._launch = driver.active.utils.launch
        except AttributeError:
            raise _Unsupported from None
        sig = list(compiled.src.signature.values())
        n_desc = sum(1 for t in sig if isinstance(t, str) and t.startswith("tensordesc"))
        meta = getattr(compiled.metadata, "tensordesc_meta", None)
        if n_desc and (not meta or len(meta) != n_desc):
            raise _Unsupported  # descriptors decomposed to pointers: not worth a direct path
        self.desc_meta = list(meta) if meta else []
        # the C launcher indexes the argument list by the annotations without a bounds check
        self.n_args = len(self.annotations)
        self.compiled = compiled
        self.function = compiled.function
        self.packed = compiled.packed_metadata

    def expand_desc(self, slot: int, desc) -> list:
        """[CUtensorMap, *shape, *strides] of the `slot`-th descriptor argument, as the launcher
        builds it from a TensorDescriptor(Im2Col)."""
        from triton.backends.nvidia.driver import make_tensordesc_arg

        return make_tensordesc_arg(desc, self.desc_meta[slot], None)

    def __call__(self, grid0: int, stream: int, args) -> None:
        if len(args) != self.n_args:
            raise RuntimeError(
                f"{self.compiled.name}: {len(args)} launch arguments, the launcher expects {self.n_args}"
            )
        self._launch(
            grid0,
            1,
            1,
            stream,
            self.function,
            self.coop,
            self.pdl,
            self.packed,
            None,
            None,
            None,
            None,
            None,
            self.annotations,
            self.kernel_signature,
            args,
        )


class _Unsupported(Exception):
    pass


class PlanCache:
    """Bounded dict of a backend's launch plans, keyed on everything a plan depends on; cleared
    when full."""

    __slots__ = ("plans", "limit")
    LIMIT = 512

    def __init__(self, limit: int | None = None):
        self.plans: dict = {}
        self.limit = self.LIMIT if limit is None else limit

    def get(self, key):
        return self.plans.get(key)

    def put(self, key, plan):
        if len(self.plans) >= self.limit:
            self.plans.clear()
        self.plans[key] = plan
        return plan

    def clear(self):
        self.plans.clear()

    def __len__(self):
        return len(self.plans)


class DescMaps(PlanCache):
    """Per-plan cache of descriptor expansions: (slot, base address) -> [CUtensorMap, ...].
    Bounded like PlanCache, at fewer entries (a plan sees few distinct buffers: the caching
    allocator hands the same blocks back)."""

    __slots__ = ()
    LIMIT = 64


def config_key(config: dict) -> tuple:
    """A config dict as a hashable key (insertion order kept: equal dicts in another order only
    get their own plan)."""
    return tuple(config.items())


def int_pair_key(v):
    """An int or a 2-tuple of ints as a plan-key part, or None where problems.pair() must check
    it (bools, lists, anything else: the slow path validates and raises as before)."""
    t = type(v)
    if t is int:
        return (v, v)
    if t is tuple and len(v) == 2 and type(v[0]) is int and type(v[1]) is int:
        return v
    return None


def kernel_args(fn, positional: Sequence, constexprs: dict) -> tuple:
    """`fn`'s arguments in parameter order, as JITFunction.run binds them: `positional` first,
    then each remaining parameter from `constexprs` (KeyError if one is missing)."""
    names = fn.arg_names
    return tuple(positional) + tuple(constexprs[n] for n in names[len(positional) :])


def new_plan(cls, key, compiled, fn, leading: int, ints: tuple, constexprs: dict, grid0: int, split=None):
    """A plan of class `cls` (a backend's: see DirectLauncher) for a JIT launch of `fn` that
    compiled to `compiled`, holding what every plan does: the kernel's launcher, an empty
    DescMaps, grid0 and the tail of its arguments after its `leading` tensors and descriptors
    (kernel_args), and, in a plan with a `reduce` slot, the SplitReduce that replays the
    launch's reduction (split = (the reduction's CompiledKernel, ws, out)) or None. None where
    key is None or Triton's launcher cannot take the kernel or its reduction directly: no plan."""
    if key is None:
        return None
    ld = DirectLauncher.of(compiled)
    rd = None if split is None else SplitReduce.of(*split)
    if ld is None or (split is not None and rd is None):
        return None
    plan = cls()
    plan.launcher, plan.maps, plan.grid0 = ld, DescMaps(), grid0
    plan.tail = kernel_args(fn, (None,) * leading + tuple(ints), constexprs)[leading:]
    if "reduce" in cls.__slots__:
        plan.reduce = rd
    return plan


# ---- split-K of a planned launch ---------------------------------------------------------------


_WORKSPACES: dict = {}


# a planned split launch's fp32 partials up to this many bytes come from a buffer kept per
# stream (stream_workspace); larger ones are allocated per call (their kernels are long enough
# that the allocation's host time is hidden, and a kept one would pin that memory)
KEPT_WORKSPACE_BYTES = 16 << 20


def stream_workspace(like: torch.Tensor, stream: int, shape: tuple) -> torch.Tensor:
    """Room for fp32 split-K partials of `shape`, for a planned launch on `stream` (which takes
    its address: the tensor may be larger, and is not shaped). Up to KEPT_WORKSPACE_BYTES, one
    buffer per (device, stream), grown as needed: safe to share, as the split kernel writes
    every element its reduction reads (split_k_workspace) and launches on one stream run in
    order; it saves an allocation's host time, which is a batch-1 layer's. Larger, and under
    CUDA-graph capture (a graph's replays must not share one with work outside it), a fresh one."""
    numel = math.prod(shape)
    if numel * 4 > KEPT_WORKSPACE_BYTES or torch.cuda.is_current_stream_capturing():
        return like.new_empty(shape, dtype=torch.float32)
    return per_stream(
        _WORKSPACES, like.device, stream, numel, lambda n: like.new_empty(max(n, 1 << 16), dtype=torch.float32)
    )


class SplitReduce:
    """A planned split-K launch's second pass (the plans of gluon_launch): the fp32 workspace
    [splits, ...] the kernel fills and the split_k_reduce launch that sums it into the output."""

    __slots__ = ("launcher", "ws_shape", "grid0", "tail")

    @classmethod
    def of(cls, compiled, ws: torch.Tensor, out: torch.Tensor) -> "SplitReduce | None":
        """From the reduction's first (JIT) launch over ws into out; None where Triton's
        launcher cannot take it directly (the plan is then not made)."""
        launcher = DirectLauncher.of(compiled)
        if launcher is None:
            return None
        r = cls()
        r.launcher, r.ws_shape = launcher, tuple(ws.shape)
        block = split_k_reduce_block(out.numel(), gh.num_sms(out.device))
        r.grid0 = cdiv(out.numel(), block)
        r.tail = (out.numel(), ws.shape[0], block, SPLIT_K_REDUCE_WARPS)  # the constexprs last, in order
        return r

    def workspace(self, like: torch.Tensor, stream: int) -> torch.Tensor:
        """The split kernel's partials (stream_workspace: launches take its address)."""
        return stream_workspace(like, stream, self.ws_shape)

    def __call__(self, stream: int, ws: torch.Tensor, out: torch.Tensor) -> None:
        self.launcher(self.grid0, stream, (ws.data_ptr(), out.data_ptr(), *self.tail))  # ints: no driver query
