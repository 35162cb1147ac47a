"""Host-side argument checks, canonical problems, tuning inputs and references of the ops.

Shared by every backend of an op (portable, hopper, blackwell): the problem dict is the
part of the key that says what the kernel computes, so it must not depend on the backend.
Tensors are NHWC: x is (N, H, W, Ci), w is (Co, R, S, Ci), y and grad_out are (N, P, Q, Co).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from . import geometry


def _dtypes() -> dict[str, torch.dtype]:
    """geometry.DTYPES by name -> torch dtype, made when asked: importing a kernel module must
    not import torch (compile workers compile without it, see tunecache.tuning.isolated_main)."""
    return {n: getattr(torch, n) for n in geometry.DTYPES}


def __getattr__(name: str) -> Any:
    """DTYPES (name -> torch dtype) and GEMM_DTYPES (the ops' dtypes), made when first read."""
    if name == "DTYPES":
        return _dtypes()
    if name == "GEMM_DTYPES":
        return tuple(_dtypes().values())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def torch_dtype(name: str) -> torch.dtype:
    """'bfloat16' -> torch.bfloat16 (one of geometry.DTYPES; KeyError otherwise)."""
    return _dtypes()[name]


def dtype_name(dtype: Any) -> str:
    """torch.bfloat16 or "bfloat16" -> "bfloat16" (a name is taken as it is)."""
    return str(dtype).removeprefix("torch.")


def fp32_precision(kind: str) -> str:
    """How torch computes float32 products now (geometry.FP32_PRECISIONS): "tf32" where it
    allows TensorFloat-32 (matmuls: `torch.backends.cuda.matmul.allow_tf32`, which
    `torch.set_float32_matmul_precision("high")` sets; convolutions:
    `torch.backends.cudnn.allow_tf32`), else "ieee". `kind`: "matmul" or "conv"."""
    if kind == "matmul":
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    return "tf32" if torch.backends.cudnn.allow_tf32 else "ieee"


def use_precision(p: dict) -> None:
    """Make torch compute float32 products at problem p's precision (the trial runner's
    reference and vendor op, which run in a process of their own)."""
    if "precision" in p:
        tf32 = p["precision"] == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32


def dot_precision(t: torch.Tensor, kind: str) -> str:
    """tl.dot's input_precision for operands like t: torch's float32 precision for float32
    (fp32_precision), tf32 (the default, unused) for the half types."""
    return fp32_precision(kind) if t.dtype == torch.float32 else "tf32"


def pair(value: Any, name: str, *, minimum: int) -> tuple[int, int]:
    """int or (h, w) -> (h, w), each >= minimum; the error names the argument."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")
    if isinstance(value, int):
        value = (value, value)
    try:
        h, w = value
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}") from None
    for v in (h, w):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")
        if v < minimum:
            what = "positive" if minimum == 1 else "non-negative"
            raise ValueError(f"{name} must be {what}, got {value!r}")
    return int(h), int(w)


def stride_padding(stride: Any, padding: Any) -> tuple[tuple[int, int], tuple[int, int]]:
    """A conv's stride (positive) and padding (non-negative), each an int or (h, w), as pairs."""
    return pair(stride, "stride", minimum=1), pair(padding, "padding", minimum=0)


def _int_arg(name: str, v: Any, what: str) -> int:
    """A size argument (R, S, H, W): a positive int, else an error naming it."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} ({what}) must be an int, got {v!r}")
    if v < 1:
        raise ValueError(f"{name} ({what}) must be positive, got {v}")
    return v


def _check_tensor(t: Any, name: str, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    dtypes = tuple(_dtypes().values())
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {[dtype_name(d) for d in dtypes]}")
    if t.device.type not in ("cuda", "cpu", "meta"):  # meta: keys computed from shapes alone
        raise ValueError(f"{name} is on {t.device}; tunecache runs on CUDA (or the CPU interpreter)")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)})")


def _same_device_dtype(tensors: dict[str, torch.Tensor]) -> None:
    (n0, t0), *rest = tensors.items()
    for n, t in rest:
        if t.device != t0.device:
            raise ValueError(f"{n} is on {t.device} but {n0} is on {t0.device}")
        if t.dtype != t0.dtype:
            raise TypeError(f"{n} has dtype {t.dtype} but {n0} has {t0.dtype}")


def _contiguous_nhwc(t: torch.Tensor, name: str) -> None:
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous NHWC tensor of shape (N, H, W, C) (e.g. "
            f"x_nchw.permute(0, 2, 3, 1).contiguous()); got strides {t.stride()}"
        )


def _check_nhwc(tensors: dict[str, torch.Tensor]) -> list[tuple[int, ...]]:
    """A conv's two tensors (name -> tensor): 4-D, of one device and dtype, contiguous NHWC;
    returns their shapes as ints."""
    for name, t in tensors.items():
        _check_tensor(t, name, 4)
    _same_device_dtype(tensors)
    for name, t in tensors.items():
        _contiguous_nhwc(t, name)
    return [tuple(int(v) for v in t.shape) for t in tensors.values()]


def _check_conv_args(tensors: dict[str, torch.Tensor], sizes: dict, stride, padding, agree: tuple) -> tuple:
    """A conv op's arguments checked: its two tensors (_check_nhwc), which must agree on one
    extent (agree = (its dim in the first, its dim in the second, what the second's is, as a
    format of its value)), its size arguments (name -> (value, what it is): _int_arg) and stride
    and padding (stride_padding); returns (the tensors' shapes..., the sizes, (stride, padding))."""
    shapes = _check_nhwc(tensors)
    sized = tuple(_int_arg(name, v, what) for name, (v, what) in sizes.items())
    st_pd = stride_padding(stride, padding)
    (a, b), (i, j, what) = tensors, agree
    if shapes[0][i] != shapes[1][j]:
        says = f"{b} has {what.format(shapes[1][j])} ({b}.shape[{j}]) but {a} has {shapes[0][i]} ({a}.shape[{i}])"
        raise ValueError(says)
    return (*shapes, sized, st_pd)


def matrix_layout(t: torch.Tensor, name: str) -> str:
    """'row' (row-major) or 'col' (a transposed view of a row-major matrix)."""
    rows, cols = t.shape
    if t.stride(1) == 1 and (t.stride(0) == cols or rows == 1):
        return "row"
    if t.stride(0) == 1 and (t.stride(1) == rows or cols == 1):
        return "col"
    raise ValueError(
        f"{name} must be row-major or a transpose of a row-major matrix; "
        f"got strides {t.stride()} for shape {tuple(t.shape)} (call .contiguous())"
    )


def _random(p: dict, device: str, *dims: str) -> torch.Tensor:
    """A random tensor of problem p's dtype whose shape is p's sizes `dims` ("N", "H", ...)."""
    return torch.randn(*(p[d] for d in dims), device=device, dtype=torch_dtype(p["dtype"]))


def _computable(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The operands of a reference as PyTorch computes them: in fp32 on the CPU, which has no
    half-precision GEMMs or convolutions; as they are elsewhere."""
    if tensors[0].device.type == "cpu" and tensors[0].dtype != torch.float32:
        return tuple(t.float() for t in tensors)
    return tensors


def _nchw(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """NHWC tensors as the NCHW views torch's convolutions take, computable (_computable)."""
    return _computable(*(t.permute(0, 3, 1, 2) for t in tensors))


def _nhwc(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """An NCHW result of torch's convolutions as a contiguous NHWC tensor of like's dtype."""
    return t.permute(0, 2, 3, 1).to(like.dtype).contiguous()


def _conv_args(p: dict) -> tuple:
    """The (stride, padding) arguments of problem p's op."""
    return (p["stride_h"], p["stride_w"]), (p["pad_h"], p["pad_w"])


# ---- matmul: c[M, N] = a[M, K] @ b[K, N] ------------------------------------------------


def matmul_problem(a: torch.Tensor, b: torch.Tensor) -> dict:
    _check_tensor(a, "a", 2)
    _check_tensor(b, "b", 2)
    _same_device_dtype({"a": a, "b": b})
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a is {tuple(a.shape)} and b is {tuple(b.shape)}: a.shape[1] must equal b.shape[0]")
    return geometry.matmul(
        int(a.shape[0]),
        int(b.shape[1]),
        int(a.shape[1]),
        dtype_name(a.dtype),
        matrix_layout(a, "a"),
        matrix_layout(b, "b"),
        fp32_precision("matmul") if a.dtype == torch.float32 else None,
    )


def matmul_inputs(p: dict, device: str) -> tuple:
    a, b = _random(p, device, "M", "K"), _random(p, device, "K", "N")
    if p["a_layout"] == "col":
        a = a.t().contiguous().t()
    if p["b_layout"] == "col":
        b = b.t().contiguous().t()
    return (a, b)


def matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    af, bf = _computable(a, b)
    return (af @ bf).to(a.dtype)


def matmul_flops(p: dict) -> float:
    return 2.0 * p["M"] * p["N"] * p["K"]


# ---- conv2d: shared geometry ---------------------------------------------------------------


out_size = geometry.out_size


def _conv_geometry(N, H, W, Ci, Co, R, S, stride, padding, dtype) -> dict:
    precision = fp32_precision("conv") if dtype == torch.float32 else None
    return geometry.conv(N, H, W, Ci, Co, R, S, stride, padding, dtype_name(dtype), precision)


def _forward_of(grad_out_pq: tuple[int, int], *conv: Any, given: str, advice: str = "") -> dict:
    """The forward conv's problem (_conv_geometry(*conv)) of a gradient, whose grad_out must be
    that conv's output; the error says what `given` makes the output instead."""
    p = _conv_geometry(*conv)
    if (p["P"], p["Q"]) != grad_out_pq:
        P, Q = grad_out_pq
        raise ValueError(f"grad_out is {P}x{Q} (grad_out.shape[1:3]) but {given} gives {p['P']}x{p['Q']}{advice}")
    return p


def conv2d_fprop_problem(x: torch.Tensor, w: torch.Tensor, stride=1, padding=0) -> dict:
    tensors, agree = {"x": x, "w": w}, (3, 3, "{} input channels")
    (N, H, W, Ci), (Co, R, S, _), _, (st, pd) = _check_conv_args(tensors, {}, stride, padding, agree)
    return _conv_geometry(N, H, W, Ci, Co, R, S, st, pd, x.dtype)


def conv2d_fprop_inputs(p: dict, device: str) -> tuple:
    return (_random(p, device, "N", "H", "W", "Ci"), _random(p, device, "Co", "R", "S", "Ci"), *_conv_args(p))


def conv2d_fprop_reference(x, w, stride=1, padding=0) -> torch.Tensor:
    st, pd = stride_padding(stride, padding)
    xf, wf = _nchw(x, w)
    return _nhwc(torch.nn.functional.conv2d(xf, wf, stride=st, padding=pd), x)


def conv2d_flops(p: dict) -> float:
    return 2.0 * p["gemm_M"] * p["gemm_N"] * p["gemm_K"]


# ---- conv2d wgrad: grad_w[Co, R, S, Ci] from x and grad_out --------------------------------


def conv2d_wgrad_problem(x: torch.Tensor, grad_out: torch.Tensor, R: int, S: int, stride=1, padding=0) -> dict:
    tensors, filter_size = {"x": x, "grad_out": grad_out}, {"R": (R, "filter size"), "S": (S, "filter size")}
    (N, H, W, Ci), (_, P, Q, Co), (R, S), (st, pd) = _check_conv_args(
        tensors, filter_size, stride, padding, (0, 0, "batch {}")
    )
    given = f"x {H}x{W} with a {R}x{S} filter, stride {st} and padding {pd}"
    p = _forward_of((P, Q), N, H, W, Ci, Co, R, S, st, pd, x.dtype, given=given)
    return geometry.wgrad(p)


def conv2d_wgrad_inputs(p: dict, device: str) -> tuple:
    x, g = _random(p, device, "N", "H", "W", "Ci"), _random(p, device, "N", "P", "Q", "Co")
    return (x, g, p["R"], p["S"], *_conv_args(p))


def _backward(which: int, grad_out: torch.Tensor, given: torch.Tensor, wanted: tuple, stride, padding) -> torch.Tensor:
    """cuDNN's convolution backward as a channels_last model calls it, NHWC in and out: the
    gradient `which` (0: the input's, from w; 1: the weight's, from x) from grad_out and the
    `given` operand; the operand asked for, of NHWC shape `wanted`, is a placeholder. torch takes
    NCHW views of the NHWC tensors and the placeholder in the same layout (torch.nn.grad's
    expanded placeholders run a slower NCHW path)."""
    st, pd = stride_padding(stride, padding)
    gf, known = _nchw(grad_out, given)
    hole = gf.new_empty(wanted).permute(0, 3, 1, 2)
    x, w = (known, hole) if which == 1 else (hole, known)
    mask = [which == 0, which == 1, False]
    grad = torch.ops.aten.convolution_backward(gf, x, w, None, list(st), list(pd), [1, 1], False, [0, 0], 1, mask)
    return _nhwc(grad[which], grad_out)


def conv2d_wgrad_reference(x, grad_out, R, S, stride=1, padding=0) -> torch.Tensor:
    return _backward(1, grad_out, x, (grad_out.shape[3], R, S, x.shape[3]), stride, padding)


# ---- conv2d dgrad: grad_x[N, H, W, Ci] from grad_out and w -------------------------------------


def conv2d_dgrad_problem(grad_out: torch.Tensor, w: torch.Tensor, H: int, W: int, stride=1, padding=0) -> dict:
    input_size = {"H": (H, "the input's height"), "W": (W, "the input's width")}
    agree = (3, 0, "{} output channels")
    (N, P, Q, Co), (_, R, S, Ci), (H, W), (st, pd) = _check_conv_args(
        {"grad_out": grad_out, "w": w}, input_size, stride, padding, agree
    )
    advice = f" at stride {st} and padding {pd}: pass the forward call's H, W, stride and padding"
    p = _forward_of(
        (P, Q), N, H, W, Ci, Co, R, S, st, pd, grad_out.dtype, given=f"an input of H={H}, W={W}", advice=advice
    )
    return geometry.dgrad(p)


def conv2d_dgrad_inputs(p: dict, device: str) -> tuple:
    g, w = _random(p, device, "N", "P", "Q", "Co"), _random(p, device, "Co", "R", "S", "Ci")
    return (g, w, p["H"], p["W"], *_conv_args(p))


def conv2d_dgrad_reference(grad_out, w, H, W, stride=1, padding=0) -> torch.Tensor:
    return _backward(0, grad_out, w, (grad_out.shape[0], H, W, w.shape[3]), stride, padding)


def conv2d_dgrad_flops(p: dict) -> float:
    """The forward convolution's multiply-adds: the phases do no others."""
    return 2.0 * p["N"] * p["P"] * p["Q"] * p["Co"] * p["R"] * p["S"] * p["Ci"]


# ---- what every backend of an op shares ----------------------------------------------------


class OpFunctions(NamedTuple):
    """The backend contract's functions that are the op's, not the backend's (backend.Backend):
    a backend module takes them with its names from backend_names()."""

    problem: Callable[..., dict]
    inputs: Callable[[dict, str], tuple]
    reference: Callable[..., torch.Tensor]
    flops: Callable[[dict], float]


OP_FUNCTIONS = {
    "matmul": OpFunctions(matmul_problem, matmul_inputs, matmul_reference, matmul_flops),
    "conv2d_fprop": OpFunctions(conv2d_fprop_problem, conv2d_fprop_inputs, conv2d_fprop_reference, conv2d_flops),
    "conv2d_wgrad": OpFunctions(conv2d_wgrad_problem, conv2d_wgrad_inputs, conv2d_wgrad_reference, conv2d_flops),
    "conv2d_dgrad": OpFunctions(conv2d_dgrad_problem, conv2d_dgrad_inputs, conv2d_dgrad_reference, conv2d_dgrad_flops),
}


def backend_names(op: str, backend: str) -> tuple:
    """What a backend module names first, in one line:
    `OP, BACKEND, KERNEL, problem, inputs, reference, flops = problems.backend_names(op, backend)`,
    KERNEL being "op.backend" and the four functions the op's OP_FUNCTIONS."""
    return (op, backend, f"{op}.{backend}", *OP_FUNCTIONS[op])
