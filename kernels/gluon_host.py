"""Host-side code shared by the Gluon backends (hopper and blackwell).

TMA descriptors (tiled and im2col) and the signature strings that name them for an explicit
compile, channel padding for TMA's 16-byte stride rule, persistent grids, and split-K: its
fp32 workspace and a deterministic two-pass reduction (the partials are summed in a fixed
order, so the same inputs always give the same bits, unlike atomics).

Nothing here launches a GEMM; the backends build on these pieces. Keep the names stable:
other backends import them (add new helpers rather than renaming old ones).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Sequence

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor, TensorDescriptorIm2Col

from . import KernelSpec

# Every TMA descriptor's base address and outer strides must be multiples of 16 bytes.
TMA_ALIGN_BYTES = 16
# Dynamic shared memory a CTA may use on sm_90 and sm_100 (227 KB); a kernel's own barriers
# and the compiler's scratch come out of it too.
SMEM_LIMIT_BYTES = 227 * 1024

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
# names used in kernel signatures (`triton.compile`) and in Gluon code
SIG_DTYPE = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
GL_DTYPE = {"float16": gl.float16, "bfloat16": gl.bfloat16, "float32": gl.float32}


def dtype_name(dtype: Any) -> str:
    """torch.bfloat16 or "bfloat16" -> "bfloat16"."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return str(dtype)


def gl_dtype(dtype: Any):
    return GL_DTYPE[dtype_name(dtype)]


def tma_multiple(dtype: Any) -> int:
    """How many elements make 16 bytes: a contiguous dim that strides must be a multiple of it."""
    return TMA_ALIGN_BYTES // ITEMSIZE[dtype_name(dtype)]


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_tma_compatible(t: torch.Tensor) -> bool:
    """Last dim contiguous, base and every outer stride 16-byte aligned."""
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        return False
    es = t.element_size()
    if t.data_ptr() % TMA_ALIGN_BYTES:
        return False
    return all((s * es) % TMA_ALIGN_BYTES == 0 for s in t.stride()[:-1])


def padded_channels(c: int, dtype: Any) -> int:
    """Channel count rounded up so an NHWC tensor's strides satisfy TMA."""
    return round_up(c, tma_multiple(dtype))


def pad_last_dim(t: torch.Tensor, size: int) -> torch.Tensor:
    """A contiguous zero-padded copy of `t` whose last dim is `size` (t itself if it already is
    contiguous with that size). The zeros make padded channels add nothing to a GEMM."""
    if t.shape[-1] == size and t.is_contiguous():
        return t
    out = t.new_zeros((*t.shape[:-1], size))
    out[..., : t.shape[-1]] = t
    return out


def pad_channels(t: torch.Tensor) -> torch.Tensor:
    """Pad the last (channel) dim of a contiguous NHWC/KRSC tensor for TMA; no copy if aligned."""
    return pad_last_dim(t, padded_channels(t.shape[-1], t.dtype))


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """`t` if TMA can read it as is, else a contiguous copy with its last dim padded."""
    if is_tma_compatible(t):
        return t
    out = pad_last_dim(t.contiguous(), padded_channels(t.shape[-1], t.dtype))
    if out.data_ptr() % TMA_ALIGN_BYTES:
        out = out.clone()  # a contiguous view whose base TMA cannot take: a fresh allocation can
    return out


# ---- shared-memory layouts and descriptors ---------------------------------------------------


def shared_layout(block_shape: Sequence[int], dtype: Any, transposed: bool = False) -> gl.NVMMASharedLayout:
    """The widest-swizzle NVMMA layout for a TMA block that WGMMA/tcgen05 reads directly."""
    return _shared_layout(tuple(block_shape), dtype, transposed)


@functools.lru_cache(maxsize=4096)
def _shared_layout(block_shape: tuple, dtype: Any, transposed: bool) -> gl.NVMMASharedLayout:
    # ~35 us to compute and built on every launch (three descriptors per matmul): cached,
    # it leaves the launch path; layouts are immutable values, safe to share.
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), gl_dtype(dtype), transposed=transposed)


def tiled_desc(t: torch.Tensor, block_shape: Sequence[int], layout=None) -> TensorDescriptor:
    """Tiled TMA descriptor over `t` (any rank 1-5, last dim contiguous); OOB reads give zeros,
    OOB parts of stores are dropped."""
    block_shape = list(block_shape)
    if layout is None:
        layout = shared_layout(block_shape, t.dtype)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block_shape, layout)


def im2col_pixel_box(H: int, W: int, P: int, Q: int, stride: Sequence[int], padding: Sequence[int]):
    """(lower, upper) corners of the im2col pixel box for an NHWC input.

    The box starts at -pad and is sized so that stepping it by `stride` visits exactly P x Q
    pixels per image: (P - 1) * stride_h + 1 rows, i.e. upper = that - H - pad_h. TMA then
    walks BLOCK pixels from any (n, p, q) start, wrapping rows and images by itself.
    """
    (sh, sw), (ph, pw) = stride, padding
    lower = [-ph, -pw]
    upper = [(P - 1) * sh + 1 - H - ph, (Q - 1) * sw + 1 - W - pw]
    return lower, upper


# rank-4 (NHWC) im2col corners are signed 8-bit in the descriptor
IM2COL_CORNER_RANGE = (-128, 127)


def im2col_ok(H: int, W: int, P: int, Q: int, stride, padding) -> bool:
    """Whether the TMA im2col descriptor can express this geometry (strides <= 8, corners in
    range); callers fall back to another backend when it cannot."""
    (sh, sw) = stride
    if not (1 <= sh <= 8 and 1 <= sw <= 8):
        return False
    lo, hi = IM2COL_CORNER_RANGE
    lower, upper = im2col_pixel_box(H, W, P, Q, stride, padding)
    return all(lo <= v <= hi for v in lower + upper)


def conv_geometry_ok(p: dict) -> bool:
    """im2col_ok() for a conv problem dict: can TMA im2col walk this geometry?"""
    return im2col_ok(p["H"], p["W"], p["P"], p["Q"], (p["stride_h"], p["stride_w"]), (p["pad_h"], p["pad_w"]))


def im2col_desc(x: torch.Tensor, block_shape: Sequence[int], *, stride: Sequence[int],
                padding: Sequence[int], out_hw: Sequence[int], layout=None) -> TensorDescriptorIm2Col:
    """TMA im2col descriptor over NHWC `x`: a load at coord [n, p*sh - ph, q*sw - pw, c] with
    offsets [r, s] fills a [pixels, channels] block with the (r, s) filter tap's inputs for
    `pixels` consecutive output positions, zeros where the window hangs over the padding."""
    N, H, W, C = x.shape
    P, Q = out_hw
    block_shape = list(block_shape)
    if layout is None:
        layout = shared_layout(block_shape, x.dtype)
    lower, upper = im2col_pixel_box(H, W, P, Q, stride, padding)
    return TensorDescriptorIm2Col(
        base=x, shape=list(x.shape), strides=list(x.stride()), block_shape=block_shape, layout=layout,
        padding="zero", element_strides=[1, int(stride[0]), int(stride[1]), 1],
        pixel_box_lower_corner=lower, pixel_box_upper_corner=upper)


def desc_sig(dtype: Any, block_shape: Sequence[int], layout=None) -> str:
    """Signature string of a tiled descriptor argument, as the JIT would specialize it."""
    block_shape = list(block_shape)
    if layout is None:
        layout = shared_layout(block_shape, dtype)
    return f"tensordesc<{SIG_DTYPE[dtype_name(dtype)]}[{','.join(map(str, block_shape))}],{layout!r}>"


def im2col_desc_sig(dtype: Any, block_shape: Sequence[int], layout=None, input_rank: int = 4) -> str:
    """Signature string of an im2col descriptor argument over a rank-`input_rank` tensor."""
    block_shape = list(block_shape)
    if layout is None:
        layout = shared_layout(block_shape, dtype)
    return (f"tensordesc_im2col<{SIG_DTYPE[dtype_name(dtype)]}[{','.join(map(str, block_shape))}],"
            f"input_rank={input_rank},{layout!r}>")


def ptr_sig(dtype: Any) -> str:
    return "*" + SIG_DTYPE[dtype_name(dtype)]


# ---- persistent grids ------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: Any = None) -> int:
    """SM count of a torch device (or index, or a tunecache DeviceClass)."""
    if hasattr(device, "sm_count"):
        return int(device.sm_count)
    if isinstance(device, torch.device):
        device = device.index
    return _sm_count(torch.cuda.current_device() if device is None else int(device))


def persistent_grid(num_tiles: int, sms: int, ctas_per_sm: int = 1) -> tuple[int]:
    """One CTA per SM (or per `ctas_per_sm` slot), never more CTAs than tiles."""
    return (max(1, min(num_tiles, sms * ctas_per_sm)),)


# ---- split-K -----------------------------------------------------------------------------------


def split_k_plan(k_iters: int, split_k: int) -> tuple[int, int]:
    """(active splits, k-iterations per split): every active split gets at least one iteration,
    so asking for more splits than iterations never launches empty work."""
    k_iters = max(1, k_iters)
    per = cdiv(k_iters, max(1, split_k))
    return cdiv(k_iters, per), per


def split_k_workspace(splits: int, rows: int, cols: int, device) -> torch.Tensor:
    """fp32 partials, one [rows, cols] slab per split. Every element is written by the GEMM
    kernel, so it is not zeroed."""
    return torch.empty((splits, rows, cols), device=device, dtype=torch.float32)


@gluon.jit
def split_k_reduce_kernel(ws_ptr, out_ptr, numel, splits, BLOCK: gl.constexpr, num_warps: gl.constexpr):
    """out[i] = sum_s ws[s, i] in split order (deterministic), cast to out's dtype."""
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [num_warps], [0])
    pid = gl.program_id(0)
    offs = pid.to(gl.int64) * BLOCK + gl.arange(0, BLOCK, layout).to(gl.int64)
    mask = offs < numel
    acc = gl.zeros([BLOCK], gl.float32, layout)
    for s in range(splits):
        acc += gl.load(ws_ptr + s * numel + offs, mask=mask, other=0.0)
    gl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


SPLIT_K_REDUCE_BLOCK = 1024
SPLIT_K_REDUCE_WARPS = 4


def split_k_reduce(ws: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Sum the [splits, ...] fp32 workspace into contiguous `out` (same element count per split)."""
    split_k_reduce_jit(ws, out)
    return out


def split_k_reduce_jit(ws: torch.Tensor, out: torch.Tensor):
    """split_k_reduce through JITFunction.run; returns the CompiledKernel it launched, which a
    DirectLauncher can launch again for the same (dtype, numel, splits)."""
    assert out.is_contiguous() and ws.is_contiguous()
    numel = out.numel()
    assert ws.numel() == ws.shape[0] * numel
    return split_k_reduce_kernel[split_k_reduce_grid(numel)](ws, out, numel, ws.shape[0], BLOCK=SPLIT_K_REDUCE_BLOCK,
                                                             num_warps=SPLIT_K_REDUCE_WARPS)


def split_k_reduce_grid(numel: int) -> tuple[int]:
    return (cdiv(numel, SPLIT_K_REDUCE_BLOCK),)


def split_k_reduce_tail() -> tuple:
    """The reduction's constexpr arguments, in parameter order, for a DirectLauncher."""
    return (SPLIT_K_REDUCE_BLOCK, SPLIT_K_REDUCE_WARPS)


def split_k_reduce_spec(out_dtype: Any) -> KernelSpec:
    """The reduction's compile, for CPU-only checks of a backend's compile_specs."""
    return KernelSpec(
        fn=split_k_reduce_kernel,
        signature={"ws_ptr": "*fp32", "out_ptr": ptr_sig(out_dtype), "numel": "i64", "splits": "i32",
                   "BLOCK": "constexpr", "num_warps": "constexpr"},
        constexprs={"BLOCK": SPLIT_K_REDUCE_BLOCK, "num_warps": SPLIT_K_REDUCE_WARPS},
        num_warps=SPLIT_K_REDUCE_WARPS, num_stages=1, name="split_k_reduce")


# ---- compiling a KernelSpec for an explicit target (no GPU needed) ----------------------------


def compile_spec(spec: KernelSpec, arch: int = 90):
    """triton.compile one KernelSpec for sm_<arch> (90 -> sm_90a, 100 -> sm_100a) on any host."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    src = GluonASTSource(spec.fn, spec.signature, spec.constexprs)
    options = dict(num_warps=spec.num_warps, num_stages=spec.num_stages, num_ctas=spec.num_ctas)
    options.update(spec.options)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def smem_bytes_of(compiled) -> int:
    """Shared memory a compiled kernel asks for (its metadata), for pruning after compile."""
    return int(compiled.metadata.shared)


# ---- launching a compiled kernel directly --------------------------------------------------------
#
# `kernel[grid](...)` costs 40-100 us of CPU per call in JITFunction.run (binding and specializing
# every argument, hashing the cache key) and in the launcher, which rebuilds each TMA descriptor's
# CUtensorMap (cuTensorMapEncode*) from the TensorDescriptor on every launch. For short kernels
# that host time is the runtime. A backend instead keeps, per (config, problem), a plan holding
# the CompiledKernel that its first JIT launch returned and launches it through Triton's C
# launcher with the arguments already expanded; the CUtensorMaps are cached per base address.
#
# A CUtensorMap is a pure function of (base address, dtype, shape, strides, block, swizzle, im2col
# geometry); a plan fixes everything but the address, so a map cached under (slot, address) is
# right for any tensor at that address, even one allocated after the first was freed: the cache
# holds no tensor and keeps no memory alive.

DIRECT_LAUNCH = os.environ.get("TUNECACHE_GLUON_DIRECT_LAUNCH", "1") not in ("0", "false", "no")


def direct_launch_enabled() -> bool:
    """Off with TUNECACHE_GLUON_DIRECT_LAUNCH=0, and while a Triton launch hook (a profiler such
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
    from triton.runtime import driver

    d = driver.active
    dev = d.get_current_device()
    return dev, d.get_current_stream(dev)


class DirectLauncher:
    """Launches one CompiledKernel through Triton's C launcher, without JITFunction.run.

    `args` is the kernel's full argument list in parameter order, constexprs included (the
    launcher skips them), with each TMA descriptor replaced by its expansion
    (`expand_desc`): [CUtensorMap, *shape, *strides], flattened in place.
    Build with `DirectLauncher.of(compiled)`, which gives None where this Triton's launcher
    does something per launch that the direct path would skip (scratch buffers, GSan, no
    descriptor metadata); callers then stay on the JIT path.
    """

    __slots__ = ("compiled", "function", "packed", "coop", "pdl", "annotations", "kernel_signature", "desc_meta",
                 "n_args", "_launch")

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
            raise RuntimeError(f"{self.compiled.name}: {len(args)} launch arguments, the launcher expects "
                               f"{self.n_args}")
        self._launch(grid0, 1, 1, stream, self.function, self.coop, self.pdl, self.packed, None, None, None, None,
                     None, self.annotations, self.kernel_signature, args)


class _Unsupported(Exception):
    pass


class DescMaps:
    """Per-plan cache of descriptor expansions: (slot, base address) -> [CUtensorMap, ...].
    Bounded: cleared when full (a plan sees few distinct buffers: the caching allocator hands
    the same blocks back)."""

    __slots__ = ("maps", "limit")

    def __init__(self, limit: int = 64):
        self.maps: dict = {}
        self.limit = limit

    def get(self, key):
        return self.maps.get(key)

    def put(self, key, value):
        if len(self.maps) >= self.limit:
            self.maps.clear()
        self.maps[key] = value
        return value


class PlanCache:
    """Bounded dict of a backend's launch plans, keyed on everything a plan depends on."""

    __slots__ = ("plans", "limit")

    def __init__(self, limit: int = 512):
        self.plans: dict = {}
        self.limit = limit

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
    return tuple(positional) + tuple(constexprs[n] for n in names[len(positional):])


# ---- candidate order ------------------------------------------------------------------------


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def wgmma_resources_ok(c: dict, smem_bytes: int) -> bool:
    """What the compiler decides for a WGMMA kernel: shared memory within the limit, the fp32
    accumulator within the register budget (past 128 values per thread it spills)."""
    return smem_bytes <= SMEM_LIMIT_BYTES and c["BLOCK_M"] * c["BLOCK_N"] // (32 * c["num_warps"]) <= 128


def quick_subset(op: str, configs: list[dict], p: dict, sm_count: int) -> list[dict]:
    """The configs most worth timing first, from configs that fit: per tile shape the deepest
    ring (and one shallower), BLOCK_K 64 (or a whole filter tap for small-channel fprop),
    GROUP_M 8, two warpgroups exactly on tiles of 128x128 and up; for wgrad stream-K, the modeled split
    and the splits around the one that fills the GPU. The tuner times these before the rest of the space,
    so a capped tuning run (TUNECACHE_MAX_CANDIDATES) still sees the likely winners."""
    best: dict[tuple, dict] = {}
    if op == "conv2d_wgrad":
        for c in configs:
            if c["BLOCK_K"] != 64 and not (c["BLOCK_K"] == 128 and c["BLOCK_N"] <= 64):
                continue
            k = (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"], c["num_warps"])
            if k not in best or c["num_stages"] > best[k]["num_stages"]:
                best[k] = c
        out = []
        for c in best.values():
            tiles = -(-p["Co"] // c["BLOCK_M"]) * p["R"] * p["S"] * -(-p["Ci"] // c["BLOCK_N"])
            fill = max(1, pow2_at_least(-(-max(1, sm_count) // tiles)))
            if c["SPLIT_K"] in (-1, 0, fill, max(1, fill // 2)) and (c["num_warps"] == 8) == (
                    c["BLOCK_M"] * c["BLOCK_N"] >= 128 * 128):
                out.append(c)
        return out
    for c in configs:
        if c["BLOCK_K"] != 64 and not (op == "conv2d_fprop" and c["BLOCK_K"] >= pow2_at_least(p["Ci"])):
            continue
        if c.get("GROUP_M", 8) != 8:
            continue
        if (c["num_warps"] == 8) != (c["BLOCK_M"] * c["BLOCK_N"] >= 128 * 128):
            continue
        k = (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_warps"])
        if k not in best or c["num_stages"] > best[k]["num_stages"]:
            best[k] = c
    out = list(best.values())
    shallower = [dict(c, num_stages=c["num_stages"] - 1) for c in out if c["num_stages"] > 3]
    return out + [c for c in shallower if c in configs]


def quick_first(op: str, configs: list[dict], p: dict, sm_count: int) -> list[dict]:
    """`configs` reordered with quick_subset() first."""
    first = quick_subset(op, configs, p, sm_count)
    return first + [c for c in configs if c not in first]
