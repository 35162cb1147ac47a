"""Host code both Gluon backends (Hopper and Blackwell) share, whatever the op: the dtypes as
signatures name them, TMA's 16-byte rule and the channel padding it asks for, TMA descriptors
(tiled and im2col; how a conv reads x: conv_x_desc) and the signature strings that name them
for an explicit compile, SM counts
and persistent grids, and the two helpers both architectures' candidate orders use.

What one op's Gluon kernels share lives in a module named for it (gluon_matmul, gluon_dgrad,
gluon_wgrad, gluon_packed_taps), split-K in gluon_split_k, the device helpers both
architectures' kernels call in gluon_device; what one architecture alone uses in gluon_hopper
and gluon_launch (Hopper) or gluon_blackwell. A kernel version hashes the kernel files its
backend references (tunecache's kernel_version), so an edit to one architecture's code
leaves the other's stored configs valid, and an edit to one op's leaves the other ops'.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor, TensorDescriptorIm2Col

from .geometry import pow2_at_least  # noqa: F401 (the Gluon backends' rules read it as gh.pow2_at_least)
from .hardware import arch_for
from .problems import dtype_name

# Every TMA descriptor's base address and outer strides must be multiples of 16 bytes.
TMA_ALIGN_BYTES = 16


ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}

# the operand dtypes the Gluon kernels take (their tensor-core MMAs'): fp32 is the portable backends'
MMA_DTYPES = ("float16", "bfloat16")


# names used in kernel signatures (`triton.compile`) and in Gluon code
SIG_DTYPE = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


GL_DTYPE = {"float16": gl.float16, "bfloat16": gl.bfloat16, "float32": gl.float32}


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
    if size > t.shape[-1]:  # one launch (cat), not a fill and a copy: a small layer's padding is launch-bound
        zero = _ZERO.get((t.device, t.dtype))
        if zero is None:
            zero = _ZERO[(t.device, t.dtype)] = kept_buffer(
                t.device, lambda: torch.zeros((), device=t.device, dtype=t.dtype)
            )
        return torch.cat([t, zero.expand(*t.shape[:-1], size - t.shape[-1])], dim=-1)
    out = t.new_zeros((*t.shape[:-1], size))
    out[..., : t.shape[-1]] = t
    return out


_ZERO: dict = {}


@functools.cache
def _maker() -> Any:
    """The thread kept buffers are made on (one, started at the first)."""
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(1, thread_name_prefix="tunecache-kept-buffers")


def kept_buffer(device: Any, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`make()`, for a CUDA buffer kept across calls, allocated outside any CUDA-graph memory
    pool. While torch.compile's CUDA graphs (mode="reduce-overhead") warm a graph up, they route
    the thread's allocations into the graph's pool, and a tensor of that pool that outlives the
    call without being an output fails their check ("tensors in the cudagraph pool not tracked
    as outputs"); another thread's allocations are the ordinary allocator's. Made there and
    waited for (once per buffer), then marked as used by the caller's stream. Made here on
    another device (`device`: where it will live), and under capture (never for a buffer kept
    across calls of an eager program)."""
    if torch.device(device).type != "cuda" or torch.cuda.is_current_stream_capturing():
        return make()

    def made() -> torch.Tensor:
        t = make()
        torch.cuda.current_stream(t.device).synchronize()
        return t

    t = _maker().submit(made).result()
    t.record_stream(torch.cuda.current_stream(t.device))
    return t


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


def im2col_desc(
    x: torch.Tensor,
    block_shape: Sequence[int],
    *,
    stride: Sequence[int],
    padding: Sequence[int],
    out_hw: Sequence[int],
    layout=None,
) -> TensorDescriptorIm2Col:
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
        base=x,
        shape=list(x.shape),
        strides=list(x.stride()),
        block_shape=block_shape,
        layout=layout,
        padding="zero",
        element_strides=[1, int(stride[0]), int(stride[1]), 1],
        pixel_box_lower_corner=lower,
        pixel_box_upper_corner=upper,
    )


def conv_x_desc(R: int, S: int, stride, padding, out_hw, block_shape: Sequence[int]) -> tuple[bool, Callable]:
    """How a conv's kernel reads x [N, H, W, Ci] (its channels padded for TMA) in `block_shape`
    tiles of (output pixels, channels): (im2col, desc_of), desc_of(x) its descriptor. By TMA
    im2col at the conv's stride and padding over out_hw = (P, Q) outputs, or, for a 1x1 conv of
    stride 1 and no padding (im2col False), x as it lies, plainly tiled as [N*H*W, Ci]."""
    (sh, sw), (ph, pw) = stride, padding
    if (R, S, sh, sw, ph, pw) == (1, 1, 1, 1, 0, 0):
        return False, lambda t: tiled_desc(t.view(-1, t.shape[-1]), block_shape)
    return True, lambda t: im2col_desc(t, block_shape, stride=(sh, sw), padding=(ph, pw), out_hw=out_hw)


def desc_sig(dtype: Any, block_shape: Sequence[int], layout=None) -> str:
    """Signature string of a tiled descriptor argument, as the JIT specializes it (its text is
    part of Triton's cache key: a compile under another spelling is never reused by a launch)."""
    block_shape = list(block_shape)
    if layout is None:
        layout = shared_layout(block_shape, dtype)
    return f"tensordesc<{SIG_DTYPE[dtype_name(dtype)]}{block_shape},{layout!r}>"


def im2col_desc_sig(dtype: Any, block_shape: Sequence[int], layout=None, input_rank: int = 4) -> str:
    """Signature string of an im2col descriptor argument over a rank-`input_rank` tensor."""
    block_shape = list(block_shape)
    if layout is None:
        layout = shared_layout(block_shape, dtype)
    return f"tensordesc_im2col<{SIG_DTYPE[dtype_name(dtype)]}{block_shape},input_rank={input_rank},{layout!r}>"


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


def sm_count_of(device: Any) -> int:
    """The SM count a device class names, or, when it names none (0), the usual part's of its
    architecture (hardware.Arch.usual_sm_count): what the persistent grids and split counts are
    sized for."""
    sms = int(getattr(device, "sm_count", 0) or 0)
    if sms > 0:
        return sms
    return arch_for(getattr(device, "capability", None) or None).usual_sm_count


def persistent_grid(num_tiles: int, sms: int, ctas_per_sm: int = 1) -> tuple[int]:
    """One CTA per SM (or per `ctas_per_sm` slot), never more CTAs than tiles."""
    return (max(1, min(num_tiles, sms * ctas_per_sm)),)


# ---- candidate order -------------------------------------------------------------------------


def tap_k_step(channels: int) -> int:
    """The K step a conv's candidate order leads with: 64, or 32 where a filter tap's channels
    are a multiple of 32 but not of 64. Inception's 160 channels in steps of 64 pad each tap to
    192, a sixth of every MMA on zeros: on an H100 all 15 fastest configs of its 7x1 dgrad stepped
    32 (256x64x32 16.1 us, every 64-step config over 18.8), the best past the capped tune's 48."""
    return 32 if channels > 64 and channels % 64 == 32 else 64


def ring_shortfall(configs: list[dict], ring: str) -> Callable[[dict], int]:
    """c -> how many stages c's ring (the parameter `ring`) is short of the deepest ring among
    `configs` that agree with c on everything else: 0 for each tile's deepest fitting ring,
    which the backends' candidate orders time first."""

    def rest(c: dict) -> tuple:
        return tuple(sorted((k, v) for k, v in c.items() if k != ring))

    deepest: dict[tuple, int] = {}
    for c in configs:
        deepest[rest(c)] = max(deepest.get(rest(c), 0), c[ring])
    return lambda c: deepest[rest(c)] - c[ring]
