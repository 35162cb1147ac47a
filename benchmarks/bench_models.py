"""Layers of real models through `tunecache.ops`, against cuDNN / cuBLAS in the same rounds.

The suite (issue 15): every distinct convolution of ResNet-50 at batch 1, 32 and 128; the
convolutions of Stable Diffusion's VAE (3-channel input and output included); an Inception-v3
1x7 / 7x1 block; the GEMMs of a Llama-3-8B and a Llama-3-70B layer and of a small MoE expert at
M = 1, 16, 128, 4096, in fp16 and bf16. Convolutions are bf16 NHWC. Each layer is called
through `tunecache.ops` at default settings (what a user gets: the first call tunes it), then
timed against the vendor's op over --rounds rounds, the columns in turn. Convolutions are
timed as forward (fprop), weight gradient (wgrad) and input gradient (dgrad: `ops.conv2d_dgrad`,
tunecache's per-phase forward convolutions, against cuDNN's dgrad).

    python benchmarks/bench_models.py --list                       # the suite, with sources
    python benchmarks/bench_models.py [--ops matmul,conv2d_fprop] [--only resnet50] [--shard 1/3]

Prints tuned / vendor per layer and per op, and writes JSON with a `summary` (per op:
geomean, min and count of tuned / vendor; the device) to benchmarks/results/models-<device>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import RESULTS, device_info, geomean, write_results  # noqa: E402

CONV_OPS = ("conv2d_fprop", "conv2d_wgrad", "conv2d_dgrad")


@dataclass(frozen=True)
class Layer:
    model: str
    name: str
    op: str  # "matmul" or "conv"
    shape: dict  # matmul: M, N, K; conv: N, H, W, Ci, Co, R, S, stride, padding (pairs or ints)
    dtype: str = "bfloat16"
    ops: tuple[str, ...] = ()  # the conv ops timed (all of CONV_OPS unless given)
    source: str = ""

    @property
    def id(self) -> str:
        dims = ",".join(f"{k}={v}" for k, v in self.shape.items())
        return f"{self.model}/{self.name}[{dims},{self.dtype}]"


# ---- the suite ---------------------------------------------------------------------------------

RESNET50 = "torchvision.models.resnet50 (v1.5: the stride on the 3x3), 224x224 input"
# (name, H=W of the input, Ci, Co, kernel, stride, padding): every distinct conv of ResNet-50
_RESNET50_CONVS = [
    ("conv1", 224, 3, 64, 7, 2, 3),
    ("layer1.conv1_first", 56, 64, 64, 1, 1, 0),
    ("layer1.conv1", 56, 256, 64, 1, 1, 0),
    ("layer1.conv2", 56, 64, 64, 3, 1, 1),
    ("layer1.conv3", 56, 64, 256, 1, 1, 0),  # layer1's downsample is this same conv
    ("layer2.conv1_first", 56, 256, 128, 1, 1, 0),
    ("layer2.conv2_first", 56, 128, 128, 3, 2, 1),
    ("layer2.downsample", 56, 256, 512, 1, 2, 0),
    ("layer2.conv1", 28, 512, 128, 1, 1, 0),
    ("layer2.conv2", 28, 128, 128, 3, 1, 1),
    ("layer2.conv3", 28, 128, 512, 1, 1, 0),
    ("layer3.conv1_first", 28, 512, 256, 1, 1, 0),
    ("layer3.conv2_first", 28, 256, 256, 3, 2, 1),
    ("layer3.downsample", 28, 512, 1024, 1, 2, 0),
    ("layer3.conv1", 14, 1024, 256, 1, 1, 0),
    ("layer3.conv2", 14, 256, 256, 3, 1, 1),
    ("layer3.conv3", 14, 256, 1024, 1, 1, 0),
    ("layer4.conv1_first", 14, 1024, 512, 1, 1, 0),
    ("layer4.conv2_first", 14, 512, 512, 3, 2, 1),
    ("layer4.downsample", 14, 1024, 2048, 1, 2, 0),
    ("layer4.conv1", 7, 2048, 512, 1, 1, 0),
    ("layer4.conv2", 7, 512, 512, 3, 1, 1),
    ("layer4.conv3", 7, 512, 2048, 1, 1, 0),
]

VAE = "Stable Diffusion's VAE (diffusers AutoencoderKL, block channels 128/256/512/512), 512x512 image"
# (name, H=W, Ci, Co, kernel, stride, padding); the downsamplers pad (0, 1, 0, 1) by hand in
# diffusers: here stride 2 with padding 1, the same work
_VAE_CONVS = [
    ("encoder.conv_in", 512, 3, 128, 3, 1, 1),
    ("encoder.128@512", 512, 128, 128, 3, 1, 1),
    ("encoder.down0", 512, 128, 128, 3, 2, 1),
    ("encoder.128to256@256", 256, 128, 256, 3, 1, 1),
    ("encoder.256@256", 256, 256, 256, 3, 1, 1),
    ("encoder.256to512@128", 128, 256, 512, 3, 1, 1),
    ("encoder.512@64", 64, 512, 512, 3, 1, 1),
    ("encoder.conv_out", 64, 512, 8, 3, 1, 1),
    ("decoder.conv_in", 64, 4, 512, 3, 1, 1),
    ("decoder.512@128", 128, 512, 512, 3, 1, 1),
    ("decoder.512@256", 256, 512, 512, 3, 1, 1),
    ("decoder.512to256@512", 512, 512, 256, 3, 1, 1),
    ("decoder.256to128@512", 512, 256, 128, 3, 1, 1),
    ("decoder.128@512", 512, 128, 128, 3, 1, 1),
    ("decoder.conv_out", 512, 128, 3, 3, 1, 1),
]

INCEPTION = "torchvision.models.inception_v3 Mixed_6b-e (17x17, 768 channels), batch 32"
_INCEPTION_CONVS = [
    ("Mixed_6b.branch7x7_2", 17, 128, 128, (1, 7), 1, (0, 3)),
    ("Mixed_6b.branch7x7_3", 17, 128, 192, (7, 1), 1, (3, 0)),
    ("Mixed_6c.branch7x7dbl_2", 17, 160, 160, (7, 1), 1, (3, 0)),
    ("Mixed_6e.branch7x7_2", 17, 192, 192, (1, 7), 1, (0, 3)),
]

LLAMA = "Meta Llama-3 config.json (hidden, intermediate, heads and kv heads of 128 dims)"
MOE = "DeepSeek-V2-Lite config.json: a routed expert (hidden 2048, moe_intermediate_size 1408)"
# (name, N, K) of y = x @ W: fused q/k/v, the attention output, fused gate/up, down
_GEMMS = {
    "llama3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
    "llama3-70b": [("qkv", 10240, 8192), ("o", 8192, 8192), ("gate_up", 57344, 8192), ("down", 8192, 28672)],
    "moe-expert": [("gate_up", 2816, 2048), ("down", 2048, 1408)],
}
GEMM_M = (1, 16, 128, 4096)


def _conv(model, name, h, ci, co, k, st, pd, batch, source, ops=CONV_OPS) -> Layer:
    from tunecache_kernels.problems import pair

    r, s = pair(k, "kernel", minimum=1)
    (ph, pw) = pair(pd, "padding", minimum=0)
    pads = dict(padding=ph) if ph == pw else dict(pad_h=ph, pad_w=pw)
    shape = dict(N=batch, H=h, W=h, Ci=ci, Co=co, R=r, S=s, stride=st, **pads)
    return Layer(model, name, "conv", shape, ops=ops, source=source)


def suite() -> list[Layer]:
    layers = []
    for batch in (1, 32, 128):
        for row in _RESNET50_CONVS:
            # inference at batch 1; training (all three) at 32 and 128
            ops = ("conv2d_fprop",) if batch == 1 else CONV_OPS
            layers.append(_conv(f"resnet50-b{batch}", *row, batch, RESNET50, ops))
    for row in _VAE_CONVS:
        layers.append(_conv("sd-vae", *row, 1, VAE))
    for row in _INCEPTION_CONVS:
        layers.append(_conv("inception-v3", *row, 32, INCEPTION))
    for model, gemms in _GEMMS.items():
        for dtype in ("float16", "bfloat16"):
            for m in GEMM_M:
                for name, n, k in gemms:
                    src = MOE if model == "moe-expert" else LLAMA
                    layers.append(Layer(model, f"{name}@M={m}", "matmul", dict(M=m, N=n, K=k), dtype, source=src))
    return layers


# ---- timing ------------------------------------------------------------------------------------


@dataclass
class Row:
    layer: dict
    op: str
    first_call_s: float
    tuned_ms: float
    vendor_ms: float
    kernel: str = ""
    # what the first call memoized: each entry's kernel, config and whether later calls launch
    # through a direct plan (without one, a call's host time is Triton's launcher's)
    entries: list = field(default_factory=list)
    ratio: float = field(init=False)

    def __post_init__(self) -> None:
        self.ratio = self.vendor_ms / self.tuned_ms  # > 1: tunecache is faster


def layers_named(names: str, ap: argparse.ArgumentParser) -> list[Layer]:
    """The suite's layers in a comma-separated list of model/name; an unknown name is an
    argument error that says where the names are listed."""
    by_name = {f"{lay.model}/{lay.name}": lay for lay in suite()}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        ap.error(f"--layers: not in the suite: {', '.join(unknown)} (bench_models.py --list names them)")
    return [by_name[n] for n in wanted]


def op_cases(layers: list[Layer], op: str):
    """(the layer's model/name, tunecache's call, the vendor's call) for `op` on each layer that has it."""
    for lay in layers:
        for case_op, ours, vendor in cases(lay):
            if case_op == op:
                yield f"{lay.model}/{lay.name}", ours, vendor


def cases(layer: Layer):
    """(op, tunecache's call, the vendor's call) for each op of the layer, inputs made."""
    import torch
    import torch.nn.functional as F
    from bench_kernels import torch_fn

    from tunecache import ops
    from tunecache.shapes import canonical_problem

    dt = getattr(torch, layer.dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    if layer.op == "matmul":
        sh = layer.shape
        a = torch.randn(sh["M"], sh["K"], device="cuda", dtype=dt, generator=g)
        b = torch.randn(sh["K"], sh["N"], device="cuda", dtype=dt, generator=g)
        yield "matmul", lambda: ops.matmul(a, b), torch_fn("matmul", (a, b))
        return
    p = canonical_problem("conv2d_fprop", {**layer.shape, "dtype": layer.dtype})
    st, pd, R, S = (p["stride_h"], p["stride_w"]), (p["pad_h"], p["pad_w"]), p["R"], p["S"]
    x = torch.randn(p["N"], p["H"], p["W"], p["Ci"], device="cuda", dtype=dt, generator=g)
    w = torch.randn(p["Co"], R, S, p["Ci"], device="cuda", dtype=dt, generator=g) * 0.05
    xn, wn = x.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2)  # channels_last views: cuDNN's NHWC
    y = F.conv2d(xn, wn, stride=st, padding=pd)
    gy = torch.randn(y.shape, device="cuda", dtype=dt, generator=g).to(memory_format=torch.channels_last)
    gy_nhwc = gy.permute(0, 2, 3, 1)
    if "conv2d_fprop" in layer.ops:
        yield "conv2d_fprop", lambda: ops.conv2d_fprop(x, w, st, pd), torch_fn("conv2d_fprop", (x, w, st, pd))
    if "conv2d_wgrad" in layer.ops:
        yield (
            "conv2d_wgrad",
            lambda: ops.conv2d_wgrad(x, gy_nhwc, R, S, st, pd),
            torch_fn("conv2d_wgrad", (x, gy_nhwc, R, S, st, pd)),
        )
    if "conv2d_dgrad" in layer.ops:
        yield (
            "conv2d_dgrad",
            lambda: ops.conv2d_dgrad(gy_nhwc, w, p["H"], p["W"], st, pd),
            lambda: torch.ops.aten.convolution_backward(
                gy, xn, wn, None, list(st), list(pd), [1, 1], False, [0, 0], 1, [True, False, False]
            ),
        )


def run_layer(layer: Layer, rounds: int) -> list[Row]:
    import torch

    from tunecache.ops import OP_LAUNCHERS
    from tunecache.tuning.timing import time_ms

    rows = []
    for op, ours, vendor in cases(layer):
        before = {name: set(o.memo) for name, o in OP_LAUNCHERS.items()}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ours()  # the first call: looked up, or tuned now (default settings)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        samples: dict[str, list[float]] = {"ours": [], "vendor": []}
        for _ in range(rounds):
            samples["ours"].append(time_ms(ours, True))
            samples["vendor"].append(time_ms(vendor, True))
        row = Row(asdict(layer), op, first, statistics.median(samples["ours"]), statistics.median(samples["vendor"]))
        for name, o in OP_LAUNCHERS.items():
            for raw in set(o.memo) - before[name]:
                e = o.memo[raw]
                row.entries.append(
                    {
                        "op": name,
                        "kernel": e.kernel,
                        "config": e.config,
                        "planned": getattr(e.run, "plan", None) is not None,
                    }
                )
        row.kernel = ",".join(sorted({e["kernel"] for e in row.entries}))
        rows.append(row)
    return rows


def summarize(rows: list[dict], device: str | None) -> dict:
    from tunecache import settings
    from tunecache_kernels.spaces import is_vendor

    out: dict = {"device": device}
    for op in ("matmul", *CONV_OPS):
        ratios = [r["ratio"] for r in rows if r["op"] == op]
        if ratios:
            out[op] = {"geomean": geomean(ratios), "min": min(ratios), "layers": len(ratios)}
            # the layers whose tune the vendor's op won (TUNECACHE_VENDOR: on by default)
            out[op]["vendor_won"] = sum(
                any(is_vendor(e["config"]) for e in r["entries"]) for r in rows if r["op"] == op
            )
            out[op]["first_call_s_max"] = max(r["first_call_s"] for r in rows if r["op"] == op)
    out["vendor_competes"] = settings.vendor_competes()
    out["goal"] = {"geomean": 1.0, "min": 0.85, "dgrad_geomean": 0.95, "dgrad_min": 0.8}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print the suite (layers and sources) and exit")
    ap.add_argument("--ops", default="", help="comma-separated ops to time (matmul, conv2d_fprop, ...): all by default")
    ap.add_argument("--only", default="", help="comma-separated model name prefixes (resnet50, sd-vae, llama3-8b, ...)")
    ap.add_argument("--shard", default="1/1", help="i/n: the i-th of n interleaved parts of the suite")
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds per column (the median is kept)")
    ap.add_argument(
        "--out", type=Path, default=None, help="JSON path (default benchmarks/results/models-<device>.json)"
    )
    args = ap.parse_args(argv)

    want_ops = {o.strip() for o in args.ops.split(",") if o.strip()}
    prefixes = [p.strip() for p in args.only.split(",") if p.strip()]
    try:
        i, n = (int(v) for v in args.shard.split("/"))
        if not 1 <= i <= n:
            raise ValueError
    except ValueError:
        ap.error(f"--shard must be i/n with 1 <= i <= n, got {args.shard!r}")
    layers = [lay for lay in suite() if not prefixes or any(lay.model.startswith(p) for p in prefixes)]
    layers = layers[i - 1 :: n]  # before --ops: a shard's layers are the same whichever ops are timed
    if want_ops:
        layers = [
            lay for lay in layers if ("matmul" in want_ops if lay.op == "matmul" else bool(want_ops & set(lay.ops)))
        ]
    if args.list:
        for lay in layers:
            print(f"{lay.id:90s} {','.join(lay.ops) or 'matmul'}  ({lay.source})")
        print(f"{len(layers)} layers")
        return 0

    import torch

    if not torch.cuda.is_available():
        print("bench_models: needs a CUDA GPU (--list prints the suite anywhere)", file=sys.stderr)
        return 2
    os.environ.setdefault(
        "TUNECACHE_DB_URL", f"sqlite:///{Path(tempfile.mkdtemp(prefix='tunecache-models-')) / 's.sqlite'}"
    )
    info = device_info()
    rows: list[dict] = []
    name = args.out.stem if args.out else f"models-{(info.get('device') or 'gpu').replace(' ', '_')}"
    folder = args.out.parent if args.out else RESULTS

    def save(done: int) -> Path:
        """Written after every layer: a run cut short keeps what it measured."""
        summary = summarize(rows, info.get("device"))
        if done < len(layers):
            summary["partial"] = f"{done} of {len(layers)} layers"
        summary["command"] = "python benchmarks/bench_models.py " + " ".join(argv if argv is not None else sys.argv[1:])
        return write_results(name, {"summary": summary, "rows": rows, "device": info}, folder)

    path = save(0)
    for done, lay in enumerate(layers, 1):
        if want_ops and lay.op != "matmul":
            lay = Layer(
                lay.model,
                lay.name,
                lay.op,
                lay.shape,
                lay.dtype,
                tuple(o for o in lay.ops if o in want_ops),
                lay.source,
            )
        for r in run_layer(lay, args.rounds):
            rows.append(asdict(r))
            print(
                f"{r.op:13s} {lay.id:90s} ours {r.tuned_ms:8.4f} ms  vendor {r.vendor_ms:8.4f} ms  "
                f"{r.ratio:5.3f}x  (first call {r.first_call_s:.1f} s)",
                flush=True,
            )
        torch.cuda.empty_cache()
        path = save(done)
    for op, s in summarize(rows, info.get("device")).items():
        if op in ("matmul", *CONV_OPS):
            print(f"{op:13s} geomean {s['geomean']:.3f}x the vendor, min {s['min']:.3f}x, {s['layers']} layers")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
