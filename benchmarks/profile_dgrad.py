"""Where a conv dgrad's time goes (issue 16): host or device, and which kernels.

For each layer (bench_models' suite, by name), after its first call (tuning at default
settings): the do_bench time of `ops.conv2d_dgrad` and of cuDNN's dgrad in the same run; the
host's time per call (calls queued behind a GPU sleep, so the host never waits on the GPU);
the kernels one call runs (and the vendor's), with their device times (torch.profiler), and the
config the cache chose.

    python benchmarks/profile_dgrad.py [--layers resnet50-b32/layer4.conv2_first,...]

Writes JSON with a `summary` to benchmarks/results/profile-dgrad-<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_models import layers_named, op_cases  # noqa: E402
from common import device_info, geomean, host_us, kernels_of, write_results  # noqa: E402

DEFAULT_LAYERS = (
    "resnet50-b32/layer4.conv2_first",
    "resnet50-b32/layer2.conv2_first",
    "resnet50-b128/layer3.conv2_first",
    "sd-vae/encoder.down0",
    "resnet50-b32/layer4.conv2",
    "resnet50-b32/layer4.conv1",
    "resnet50-b128/layer2.downsample",
    "resnet50-b32/layer1.conv2",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default=",".join(DEFAULT_LAYERS), help="comma-separated model/name of the suite")
    ap.add_argument("--op", default="conv2d_dgrad", help="the op to profile (conv2d_dgrad, conv2d_fprop, ...)")
    args = ap.parse_args(argv)
    import torch

    from tunecache.tuning.timing import time_ms

    layers = layers_named(args.layers, ap)
    rows = []
    op = args.op
    for name, ours, vendor in op_cases(layers, op):
        ours()
        torch.cuda.synchronize()
        t_ours = statistics.median(time_ms(ours, True) for _ in range(3))
        t_vendor = statistics.median(time_ms(vendor, True) for _ in range(3))
        ks, vks = kernels_of(ours), kernels_of(vendor)
        from tunecache.ops import OP_LAUNCHERS

        entry = list(OP_LAUNCHERS[op].memo.values())[-1] if OP_LAUNCHERS[op].memo else None
        row = {
            "layer": name,
            "op": op,
            "ours_ms": t_ours,
            "vendor_ms": t_vendor,
            "ratio": t_vendor / t_ours,
            "host_us_ours": host_us(ours),
            "host_us_vendor": host_us(vendor),
            "device_us_ours": sum(k["us"] for k in ks),
            "device_us_vendor": sum(k["us"] for k in vks),
            "kernels": ks,
            "vendor_kernels": vks,
            "kernel": getattr(entry, "kernel", None),
            "config": getattr(entry, "config", None),
        }
        rows.append(row)
        print(
            f"{name:36s} ours {t_ours * 1e3:8.1f} us  vendor {t_vendor * 1e3:8.1f} us  {row['ratio']:.3f}x | "
            f"host {row['host_us_ours']:7.1f} us (vendor {row['host_us_vendor']:6.1f})  device "
            f"{row['device_us_ours']:7.1f} us (vendor {row['device_us_vendor']:6.1f}), {len(ks)} kernels",
            flush=True,
        )
        print(f"    ours: {row['kernel']} {row['config']}")
        for k in ks:
            print(f"    {k['us']:8.1f} us  {k['name']}")
        for k in vks:
            print(f"    {k['us']:8.1f} us  vendor: {k['name']}")
    info = device_info()
    summary = {
        "device": info.get("device"),
        args.op: {"geomean": geomean([r["ratio"] for r in rows]), "min": min(r["ratio"] for r in rows)},
        "command": "python benchmarks/profile_dgrad.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    path = write_results(
        f"profile-dgrad-{(info.get('device') or 'gpu').replace(' ', '_')}", {"summary": summary, "rows": rows}, None
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
