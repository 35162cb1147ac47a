"""Portable kernels on a GPU: tuned config vs the untuned default vs torch, per op and shape.

    python benchmarks/bench_portable.py [--out DIR]

Prints TFLOP/s and the tuned-vs-default speedup; writes results/portable_tuning.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TUNECACHE_DB_URL", f"sqlite:///{tempfile.mkdtemp()}/bench.sqlite")

from common import geomean, write_results

SHAPES = [
    ("matmul", dict(M=4096, N=4096, K=4096, dtype="float16")),
    ("matmul", dict(M=128, N=8192, K=8192, dtype="float16")),
    ("matmul", dict(M=1000, N=1000, K=1000, dtype="float32")),
    ("conv2d_fprop", dict(N=32, H=56, W=56, Ci=64, Co=64, R=3, S=3, stride=1, padding=1, dtype="bfloat16")),
    ("conv2d_fprop", dict(N=32, H=14, W=14, Ci=256, Co=256, R=3, S=3, stride=1, padding=1, dtype="float16")),
    ("conv2d_wgrad", dict(N=32, H=56, W=56, Ci=64, Co=64, R=3, S=3, stride=1, padding=1, dtype="bfloat16")),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="directory for the JSON (default benchmarks/results)")
    args = ap.parse_args()

    import torch

    from tunecache import backends
    from tunecache.key import cuda_device
    from tunecache.shapes import canonical_problem
    from tunecache.store import default_store
    from tunecache.tuning import timing
    from tunecache.tuning.accuracy import relative_error
    from tunecache.tuning.tuner import tune

    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    dev = cuda_device(0)
    rows = []
    print(f"{'op':14} {'problem':58} {'default':>9} {'tuned':>9} {'torch':>9} {'tuned/def':>9} {'tune s':>7}")
    for op, given in SHAPES:
        p = canonical_problem(op, given)
        mod = backends.backend_module(op, "portable")
        t0 = time.perf_counter()
        res = tune(mod, p, dev, source="bench")
        default_store().put_config(res.record(dev), res.trials, run_id=res.run_id)
        tune_s = time.perf_counter() - t0
        torch.manual_seed(1)
        inputs = mod.inputs(p, "cuda")
        ref = mod.reference(*inputs)
        default = mod.default_config(p, dev)
        out = {}
        for name, cfg in (("default", default), ("tuned", res.config)):
            err = relative_error(mod.launch(cfg, *inputs), ref)
            assert err < 2e-2, f"{op} {name} config {cfg} is wrong: relative error {err}"
            out[name] = timing.time_ms(lambda: mod.launch(cfg, *inputs), True)
        out["torch"] = timing.time_ms(lambda: mod.reference(*inputs), True)
        flops = mod.flops(p)
        tf = {k: flops / (v * 1e-3) / 1e12 for k, v in out.items()}
        speedup = out["default"] / out["tuned"]
        label = ",".join(f"{k}={v}" for k, v in given.items())
        print(
            f"{op:14} {label:58} {tf['default']:9.1f} {tf['tuned']:9.1f} {tf['torch']:9.1f} "
            f"{speedup:9.2f} {tune_s:7.1f}",
            flush=True,
        )
        rows.append(
            dict(
                op=op,
                problem=given,
                default_config=default,
                tuned_config=res.config,
                ms=out,
                tflops=tf,
                tuned_vs_default=speedup,
                tuned_vs_torch=out["torch"] / out["tuned"],
                candidates=res.candidates,
                tune_seconds=tune_s,
            )
        )
    g = geomean([r["tuned_vs_default"] for r in rows])
    gt = geomean([r["tuned_vs_torch"] for r in rows])
    print(f"geomean tuned/default speedup: {g:.2f}x; tuned portable vs torch: {gt:.2f}x")
    path = write_results(
        "portable_tuning", {"rows": rows, "geomean_tuned_vs_default": g, "geomean_tuned_vs_torch": gt}, args.out
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
