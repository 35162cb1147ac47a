"""Hopper kernels against cuBLAS / cuDNN, measured in one run.

For each shape of the issue's set: TFLOP/s of the tuned Gluon kernel (hopper backend), of its
default config, of the tuned portable kernel and of torch (cuBLAS for matmul, cuDNN for the
convolutions), with the ratios to torch and their geomeans per op. JSON goes to
benchmarks/results/.

    python benchmarks/bench_kernels.py --quick              # ~10 min on an H100 (matmul 2.5, fprop 2, wgrad 5)
    python benchmarks/bench_kernels.py --ops conv2d_wgrad   # one op
    python benchmarks/bench_kernels.py --full               # the whole pruned space (slow)

Tuning goes through tunecache.tuning.tuner.tune (store=None: nothing is persisted), over the whole
pruned space with --full, or with --quick over a subset per shape (the deepest pipeline that
fits for each tile shape, a few split-K factors): tuning every shape over the full space
takes far longer than a benchmark run should. Every tuned candidate is checked against the
PyTorch reference before it is timed; timings are medians of CUDA-event runs with an L2 flush,
taken after all tuning of a shape, the columns in turn over --rounds rounds.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

from tunecache.shapes import OPS

HERE = Path(__file__).resolve().parent

MATMUL_SHAPES = [
    (8192, 8192, 8192),
    (4096, 4096, 4096),
    (8192, 8192, 512),
    (2048, 2048, 2048),
    (16384, 1024, 4096),
    (128, 8192, 8192),
]
# (name, N, H, W, Ci, Co, R, S, stride, padding): ResNet-50's 3x3 layers and two 1x1 layers at
# batch 128, and the seeds' 384-channel 64x64 3x3 layer
CONV_SHAPES = [
    ("r50_3x3_64@56", 128, 56, 56, 64, 64, 3, 3, 1, 1),
    ("r50_3x3_128@28", 128, 28, 28, 128, 128, 3, 3, 1, 1),
    ("r50_3x3_256@14", 128, 14, 14, 256, 256, 3, 3, 1, 1),
    ("r50_3x3_512@7", 128, 7, 7, 512, 512, 3, 3, 1, 1),
    ("r50_1x1_256to64@56", 128, 56, 56, 256, 64, 1, 1, 1, 0),
    ("r50_1x1_1024to256@14", 128, 14, 14, 1024, 256, 1, 1, 1, 0),
    ("seed_3x3_384@64", 128, 64, 64, 384, 384, 3, 3, 1, 1),
]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def quick_candidates(op: str, mod, p: dict, device) -> list[dict]:
    """A small subset of the pruned space worth timing for this shape (the tuner's own
    first candidates, see gluon_hopper.quick_subset)."""
    from tunecache_kernels import gluon_hopper as ghop

    pruned = mod.prune(mod.config_space(p, device), p, device)
    return ghop.quick_subset(op, pruned, p, device.sm_count)


def portable_candidates(mod, p: dict, device, n: int) -> list[dict]:
    """The portable kernel's largest-tile configs (their space is big; a few suffice here)."""
    pruned = mod.prune(mod.config_space(p, device), p, device)

    def score(c):
        return (c["BLOCK_M"] * c["BLOCK_N"], c.get("BLOCK_K", 0), c["num_stages"] == 3, c["num_warps"] == 8)

    pruned = [c for c in pruned if c.get("GROUP_M", 8) == 8 and c["num_stages"] in (3, 4)]
    if "SPLIT_K" in (pruned[0] if pruned else {}):

        def tiles(c):
            return -(-p["Co"] // c["BLOCK_M"]) * -(-p["gemm_N"] // c["BLOCK_N"])

        pruned = [
            c
            for c in pruned
            if tiles(c) * c["SPLIT_K"] >= device.sm_count and tiles(c) * c["SPLIT_K"] <= 4 * device.sm_count
        ]
    return sorted(pruned, key=score, reverse=True)[:n]


def torch_fn(op: str, args):
    import torch

    if op == "matmul":
        a, b = args
        return lambda: a @ b
    if op == "conv2d_fprop":
        x, w, st, pd = args
        xn, wn = x.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2)  # channels_last views: cuDNN NHWC
        return lambda: torch.nn.functional.conv2d(xn, wn, stride=st, padding=pd)
    x, g, R, S, st, pd = args
    xn, gn = x.permute(0, 3, 1, 2), g.permute(0, 3, 1, 2)
    wn = torch.empty((g.shape[3], R, S, x.shape[3]), device=x.device, dtype=x.dtype).permute(0, 3, 1, 2)
    return lambda: torch.ops.aten.convolution_backward(
        gn, xn, wn, None, list(st), list(pd), [1, 1], False, [0, 0], 1, [False, True, False]
    )


def problems_for(op: str, dtypes: list[str]):
    import torch

    from tunecache_kernels import problems

    def meta(*shape, dt):
        return torch.empty(shape, dtype=problems.DTYPES[dt], device="meta")

    if op == "matmul":
        for dt in dtypes:
            for M, N, K in MATMUL_SHAPES:
                yield f"{M}x{N}x{K}", problems.matmul_problem(meta(M, K, dt=dt), meta(K, N, dt=dt))
        return
    for name, N, H, W, Ci, Co, R, S, st, pd in CONV_SHAPES:
        x = meta(N, H, W, Ci, dt="bfloat16")
        if op == "conv2d_fprop":
            yield name, problems.conv2d_fprop_problem(x, meta(Co, R, S, Ci, dt="bfloat16"), st, pd)
        else:
            P, Q = problems.out_size(H, R, st, pd), problems.out_size(W, S, st, pd)
            yield name, problems.conv2d_wgrad_problem(x, meta(N, P, Q, Co, dt="bfloat16"), R, S, st, pd)


def geomean(xs):
    xs = [x for x in xs if x and math.isfinite(x) and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default=",".join(OPS), help="comma-separated: matmul,conv2d_fprop,conv2d_wgrad")
    ap.add_argument("--dtypes", default="float16,bfloat16", help="matmul dtypes (convs run in bfloat16)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", default=True, help="tune a subset per shape (default)")
    mode.add_argument("--full", action="store_true", help="tune over the whole pruned space")
    ap.add_argument("--portable-candidates", type=int, default=3, help="portable configs tuned per shape")
    ap.add_argument("--no-portable", action="store_true", help="skip the portable kernels")
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds per column (the median is kept)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/hopper-<time>.json)")
    args = ap.parse_args(argv)

    import torch
    import triton

    from tunecache.errors import short
    from tunecache.key import cuda_device
    from tunecache.tuning import timing
    from tunecache.tuning.tuner import tune

    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = cuda_device(0)
    if device.capability != (9, 0):
        print(f"bench_kernels: the hopper kernels need sm_90, this is {device}", file=sys.stderr)
        return 2
    import importlib

    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    out_path = (
        Path(args.out)
        if args.out
        else HERE / "results" / ("hopper-" + _dt.datetime.now().strftime("%Y%m%d-%H%M%S") + ".json")
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "device": torch.cuda.get_device_name(0),
        "device_class": str(device),
        "triton": triton.__version__,
        "torch": torch.__version__,
        "host": platform.node(),
        "mode": "full" if args.full else "quick",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "rows": [],
        "geomean": {},
    }
    t_start = time.perf_counter()
    for op in ops:
        hop = importlib.import_module(f"tunecache_kernels.{op}_hopper")
        por = importlib.import_module(f"tunecache_kernels.{op}_portable")
        for name, p in problems_for(op, dtypes):
            t0 = time.perf_counter()
            row = {"op": op, "shape": name, "dtype": p["dtype"], "problem": p}
            args_ = hop.inputs(p, "cuda")
            fl = hop.flops(p)
            dflt = hop.default_config(p, device)
            cands = None if args.full else quick_candidates(op, hop, p, device)
            if cands is not None and dflt not in cands:
                cands.append(dflt)
            tr = tune(hop, p, device, configs=cands)
            fns = {
                "torch": torch_fn(op, args_),
                "gluon_default": lambda: hop.launch(dflt, *args_),
                "gluon_tuned": lambda: hop.launch(tr.config, *args_),
            }
            row["gluon_default"] = {"config": dflt}
            row["gluon_tuned"] = {"config": tr.config, "candidates": tr.candidates, "tuner_ms": tr.median_ms}
            if not args.no_portable:
                try:
                    pc = portable_candidates(por, p, device, args.portable_candidates)
                    pr = tune(por, p, device, configs=pc)
                    fns["portable_tuned"] = lambda: por.launch(pr.config, *args_)
                    row["portable_tuned"] = {"config": pr.config, "candidates": pr.candidates}
                except Exception as e:  # the portable kernel is a reference point, not the subject
                    row["portable_tuned"] = {"error": short(e, 500)}
            # every column timed in the same rounds, after all tuning, in turn: a clock that
            # drifts over the run (the GPU warms up while tuning) moves them all alike
            samples = {k: [] for k in fns}
            for _ in range(args.rounds):
                for k, fn in fns.items():
                    samples[k].append(timing.time_ms(fn, True))
            for k, ms_list in samples.items():
                ms = statistics.median(ms_list)
                row.setdefault(k, {}).update(ms=ms, tflops=fl / (ms * 1e-3) / 1e12)
            tt = row["torch"]["tflops"]
            for k in ("gluon_tuned", "gluon_default", "portable_tuned"):
                if "tflops" in row.get(k, {}):
                    row[k]["vs_torch"] = row[k]["tflops"] / tt
            row["seconds"] = round(time.perf_counter() - t0, 1)
            result["rows"].append(row)
            print(
                f"{op:13s} {name:22s} {p['dtype']:8s} tuned {row['gluon_tuned']['tflops']:6.1f} "
                f"default {row['gluon_default']['tflops']:6.1f} "
                f"portable {row.get('portable_tuned', {}).get('tflops', float('nan')):6.1f} "
                f"torch {tt:6.1f}  tuned/torch {row['gluon_tuned']['vs_torch']:.3f}  "
                f"{tr.config}  ({row['seconds']}s)",
                flush=True,
            )
            json.dump(result, open(out_path, "w"), indent=1)
            args_ = fns = None  # fns["torch"] holds the inputs too: drop both before emptying the cache
            torch.cuda.empty_cache()
        rows = [r for r in result["rows"] if r["op"] == op]
        result["geomean"][op] = {
            k: geomean([r.get(k, {}).get("vs_torch") for r in rows])
            for k in ("gluon_tuned", "gluon_default", "portable_tuned")
        }
        json.dump(result, open(out_path, "w"), indent=1)

    print(
        f"\n{'op':13s} {'shape':22s} {'dtype':8s} {'tuned':>7s} {'default':>7s} {'portable':>8s} {'torch':>7s}"
        f" {'tun/t':>6s} {'def/t':>6s} {'por/t':>6s}   (TFLOP/s)"
    )
    for r in result["rows"]:
        pt = r.get("portable_tuned", {})
        print(
            f"{r['op']:13s} {r['shape']:22s} {r['dtype']:8s} {r['gluon_tuned']['tflops']:7.1f} "
            f"{r['gluon_default']['tflops']:7.1f} {pt.get('tflops', float('nan')):8.1f} {r['torch']['tflops']:7.1f} "
            f"{r['gluon_tuned']['vs_torch']:6.3f} {r['gluon_default']['vs_torch']:6.3f} "
            f"{pt.get('vs_torch', float('nan')):6.3f}"
        )
    targets = {"matmul": 0.95, "conv2d_fprop": 0.9, "conv2d_wgrad": 0.9}
    for op, g in result["geomean"].items():
        print(
            f"geomean {op:13s} tuned/torch {g['gluon_tuned']:.3f} (target {targets[op]})  "
            f"default/torch {g['gluon_default']:.3f}  portable/torch {g['portable_tuned']:.3f}"
        )
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    json.dump(result, open(out_path, "w"), indent=1)
    print(f"wrote {out_path} ({result['seconds']}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
