"""Host-side argument checks, canonical problems, tuning inputs and references of the ops.

Shared by every backend of an op (portable, hopper, blackwell): the problem dict is the
part of the key that says what the kernel computes, so it must not depend on the backend.
Tensors are NHWC: x is (N, H, W, Ci), w is (Co, R, S, Ci), y and grad_out are (N, P, Q, Co).
"""

from __future__ import annotations

from typing import Any

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
    )


def matmul_inputs(p: dict, device: str) -> tuple:
    dt = torch_dtype(p["dtype"])
    a = torch.randn(p["M"], p["K"], device=device, dtype=dt)
    b = torch.randn(p["K"], p["N"], device=device, dtype=dt)
    if p["a_layout"] == "col":
        a = a.t().contiguous().t()
    if p["b_layout"] == "col":
        b = b.t().contiguous().t()
    return (a, b)


def matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.device.type == "cpu" and a.dtype != torch.float32:
        return (a.float() @ b.float()).to(a.dtype)
    return a @ b


def matmul_flops(p: dict) -> float:
    return 2.0 * p["M"] * p["N"] * p["K"]


# ---- conv2d: shared geometry ---------------------------------------------------------------


out_size = geometry.out_size


def _conv_geometry(N, H, W, Ci, Co, R, S, stride, padding, dtype) -> dict:
    return geometry.conv(N, H, W, Ci, Co, R, S, stride, padding, dtype_name(dtype))


def conv2d_fprop_problem(x: torch.Tensor, w: torch.Tensor, stride=1, padding=0) -> dict:
    _check_tensor(x, "x", 4)
    _check_tensor(w, "w", 4)
    _same_device_dtype({"x": x, "w": w})
    _contiguous_nhwc(x, "x")
    _contiguous_nhwc(w, "w")
    st = pair(stride, "stride", minimum=1)
    pd = pair(padding, "padding", minimum=0)
    N, H, W, Ci = (int(v) for v in x.shape)
    Co, R, S, Ci_w = (int(v) for v in w.shape)
    if Ci_w != Ci:
        raise ValueError(f"w has {Ci_w} input channels (w.shape[3]) but x has {Ci} (x.shape[3])")
    return _conv_geometry(N, H, W, Ci, Co, R, S, st, pd, x.dtype)


def conv2d_fprop_inputs(p: dict, device: str) -> tuple:
    dt = torch_dtype(p["dtype"])
    x = torch.randn(p["N"], p["H"], p["W"], p["Ci"], device=device, dtype=dt)
    w = torch.randn(p["Co"], p["R"], p["S"], p["Ci"], device=device, dtype=dt)
    return (x, w, (p["stride_h"], p["stride_w"]), (p["pad_h"], p["pad_w"]))


def conv2d_fprop_reference(x, w, stride=1, padding=0) -> torch.Tensor:
    st, pd = pair(stride, "stride", minimum=1), pair(padding, "padding", minimum=0)
    xf, wf = x.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2)
    if x.device.type == "cpu" and x.dtype != torch.float32:
        xf, wf = xf.float(), wf.float()
    y = torch.nn.functional.conv2d(xf, wf, stride=st, padding=pd)
    return y.permute(0, 2, 3, 1).to(x.dtype).contiguous()


def conv2d_flops(p: dict) -> float:
    return 2.0 * p["gemm_M"] * p["gemm_N"] * p["gemm_K"]


# ---- conv2d wgrad: grad_w[Co, R, S, Ci] from x and grad_out --------------------------------


def conv2d_wgrad_problem(x: torch.Tensor, grad_out: torch.Tensor, R: int, S: int, stride=1, padding=0) -> dict:
    _check_tensor(x, "x", 4)
    _check_tensor(grad_out, "grad_out", 4)
    _same_device_dtype({"x": x, "grad_out": grad_out})
    _contiguous_nhwc(x, "x")
    _contiguous_nhwc(grad_out, "grad_out")
    R, S = _int_arg("R", R, "filter size"), _int_arg("S", S, "filter size")
    st = pair(stride, "stride", minimum=1)
    pd = pair(padding, "padding", minimum=0)
    N, H, W, Ci = (int(v) for v in x.shape)
    No, P, Q, Co = (int(v) for v in grad_out.shape)
    if No != N:
        raise ValueError(f"grad_out has batch {No} (grad_out.shape[0]) but x has {N}")
    p = _conv_geometry(N, H, W, Ci, Co, R, S, st, pd, x.dtype)
    if (p["P"], p["Q"]) != (P, Q):
        raise ValueError(
            f"grad_out is {P}x{Q} (grad_out.shape[1:3]) but x {H}x{W} with a {R}x{S} filter, stride "
            f"{st} and padding {pd} gives {p['P']}x{p['Q']}"
        )
    return geometry.wgrad(p)


def conv2d_wgrad_inputs(p: dict, device: str) -> tuple:
    dt = torch_dtype(p["dtype"])
    x = torch.randn(p["N"], p["H"], p["W"], p["Ci"], device=device, dtype=dt)
    g = torch.randn(p["N"], p["P"], p["Q"], p["Co"], device=device, dtype=dt)
    return (x, g, p["R"], p["S"], (p["stride_h"], p["stride_w"]), (p["pad_h"], p["pad_w"]))


def conv2d_wgrad_reference(x, grad_out, R, S, stride=1, padding=0) -> torch.Tensor:
    st, pd = pair(stride, "stride", minimum=1), pair(padding, "padding", minimum=0)
    xf, gf = x.permute(0, 3, 1, 2), grad_out.permute(0, 3, 1, 2)
    if x.device.type == "cpu" and x.dtype != torch.float32:
        xf, gf = xf.float(), gf.float()
    Co, Ci = grad_out.shape[3], x.shape[3]
    gw = torch.nn.grad.conv2d_weight(xf, (Co, Ci, R, S), gf, stride=st, padding=pd)
    return gw.permute(0, 2, 3, 1).to(x.dtype).contiguous()


# ---- conv2d dgrad: grad_x[N, H, W, Ci] from grad_out and w -------------------------------------


def conv2d_dgrad_problem(grad_out: torch.Tensor, w: torch.Tensor, H: int, W: int, stride=1, padding=0) -> dict:
    _check_tensor(grad_out, "grad_out", 4)
    _check_tensor(w, "w", 4)
    _same_device_dtype({"grad_out": grad_out, "w": w})
    _contiguous_nhwc(grad_out, "grad_out")
    _contiguous_nhwc(w, "w")
    H, W = _int_arg("H", H, "the input's height"), _int_arg("W", W, "the input's width")
    st = pair(stride, "stride", minimum=1)
    pd = pair(padding, "padding", minimum=0)
    N, P, Q, Co = (int(v) for v in grad_out.shape)
    Co_w, R, S, Ci = (int(v) for v in w.shape)
    if Co_w != Co:
        raise ValueError(f"w has {Co_w} output channels (w.shape[0]) but grad_out has {Co} (grad_out.shape[3])")
    p = _conv_geometry(N, H, W, Ci, Co, R, S, st, pd, grad_out.dtype)
    if (p["P"], p["Q"]) != (P, Q):
        raise ValueError(
            f"grad_out is {P}x{Q} (grad_out.shape[1:3]) but an input of H={H}, W={W} gives {p['P']}x{p['Q']} at "
            f"stride {st} and padding {pd}: pass the forward call's H, W, stride and padding"
        )
    return geometry.dgrad(p)


def conv2d_dgrad_inputs(p: dict, device: str) -> tuple:
    dt = torch_dtype(p["dtype"])
    g = torch.randn(p["N"], p["P"], p["Q"], p["Co"], device=device, dtype=dt)
    w = torch.randn(p["Co"], p["R"], p["S"], p["Ci"], device=device, dtype=dt)
    return (g, w, p["H"], p["W"], (p["stride_h"], p["stride_w"]), (p["pad_h"], p["pad_w"]))


def conv2d_dgrad_reference(grad_out, w, H, W, stride=1, padding=0) -> torch.Tensor:
    st, pd = pair(stride, "stride", minimum=1), pair(padding, "padding", minimum=0)
    gf, wf = grad_out.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2)
    if grad_out.device.type == "cpu" and grad_out.dtype != torch.float32:
        gf, wf = gf.float(), wf.float()
    N, Ci = grad_out.shape[0], w.shape[3]
    gx = torch.nn.grad.conv2d_input((N, Ci, H, W), wf, gf, stride=st, padding=pd)
    return gx.permute(0, 2, 3, 1).to(grad_out.dtype).contiguous()


def conv2d_dgrad_flops(p: dict) -> float:
    """The forward convolution's multiply-adds: the phases do no others."""
    return 2.0 * p["N"] * p["P"] * p["Q"] * p["Co"] * p["R"] * p["S"] * p["Ci"]
