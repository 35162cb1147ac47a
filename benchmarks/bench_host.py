"""The host's share of a tuned call (issue 15): what a small layer costs when the GPU waits on Python.

A batch-1 1x1 conv is a 3-6 us kernel; a call through `tunecache.ops` is tens of microseconds of
Python, dispatch and launch before it. An inference loop then runs at the host's pace, and
do_bench's per-call L2 flush (about 90 us of GPU time) hides that only while the host stays
under it. For each layer, after its first call (tuned at default settings), ours and the
vendor's op in the same run:

  host  microseconds of host time per call (calls queued behind a GPU sleep: none waits)
  loop  microseconds per call of back-to-back calls, no flush, synchronized at the end: what an
        inference loop sees (ratio vendor / ours, > 1: tunecache is faster)

    python benchmarks/bench_host.py [--layers resnet50-b1/layer1.conv1,...] [--breakdown]

--layer-calls also times the calls a model makes (issue 39): `tunecache.nn.Conv2d` / `Linear`
forward (no grad, and recorded by autograd) and forward + backward, `tunecache.ops.conv2d` /
`linear`, on tiny shapes where the host is all there is, each against torch's own layer or
function on the same tensors (`summary["layer_calls"]`: our host time / torch's, goal <= 1.1);
--profile-layers adds each of our calls' top functions (cProfile) to the JSON.

--breakdown also times each stage of our call (the memo lookup and views of `tunecache.ops`,
the entry's launch, the plan's, the C launcher's alone, an output allocation). Writes JSON with a
`summary` (per op: geomean and min of the loop ratio, host microseconds of both) to
benchmarks/results/host-<device>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_models import cases, layers_named, suite  # noqa: E402
from common import device_info, geomean, host_us, kernels_of, write_results  # noqa: E402

CALLS = 200  # calls per timing, the median of 5 batches (host_us, loop_us)


def loop_us(fn, calls: int = CALLS) -> float:
    """Median over 5 batches of microseconds per call, back to back, synchronized at the end."""
    import torch

    out = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(out)


def timeline(fn, calls: int = 6) -> str:
    """The GPU work of `calls` back-to-back calls: each kernel's name, start (us from the first)
    and duration."""
    return "; ".join(f"{k['name'][:40]} @{k['start_us']:.1f} +{k['us']:.1f}" for k in kernels_of(fn, calls))


def breakdown(op: str, ours, vendor) -> dict:
    """Host microseconds of each stage of one of our calls (the entry it memoized last)."""
    import torch

    from tunecache.ops import OP_LAUNCHERS
    from tunecache_kernels import gluon_launch as direct

    found = [o for o in OP_LAUNCHERS.values() if o.memo]
    stages = {"ops call": host_us(ours, CALLS, 5)}
    # the entry this call runs: the one whose run() sees a call of ours()
    seen: list = []
    for o in found:
        for e in o.memo.values():
            run = e.run

            def spy(*args, _run=run, _e=e):
                seen.append((_e, args))
                return _run(*args)

            e.run = spy
            try:
                ours()
            finally:
                e.run = run
            if seen:
                break
        if seen:
            break
    if not seen:
        return stages
    entry, args = seen[0]
    stages["entry.run (memo bypassed)"] = host_us(lambda: entry.run(*args), CALLS, 5)
    plan = getattr(entry.run, "plan", None)
    stages["device and stream"] = host_us(direct.current_device_and_stream, CALLS, 5)
    if plan is not None:
        stream = direct.current_device_and_stream()[1]
        stages["plan.run"] = host_us(lambda: plan.run(args[0], args[1], stream), CALLS, 5)
        captured: list = []
        ld = plan.launcher

        class Capture:
            def __getattr__(self, k):
                return getattr(ld, k)

            def __call__(self, grid0, stream, a):
                captured.append((grid0, stream, list(a)))
                ld(grid0, stream, a)

        plan.launcher = Capture()
        try:
            plan.run(args[0], args[1], stream)
        finally:
            plan.launcher = ld
        if captured:
            g0, st, la = captured[0]
            stages["C launcher alone"] = host_us(lambda: ld(g0, st, la), CALLS, 5)
            stages["C launcher alone, loop"] = loop_us(lambda: ld(g0, st, la))
        stages["plan.run, loop"] = loop_us(lambda: plan.run(args[0], args[1], stream))
    stages["ops call, loop"] = loop_us(ours)
    stages["gpu timeline"] = timeline(ours)
    stages["vendor gpu timeline"] = timeline(vendor)
    t = args[0]
    stages["new_empty (the output)"] = host_us(lambda: t.new_empty(t.shape), CALLS, 5)
    stages["is_current_stream_capturing"] = host_us(torch.cuda.is_current_stream_capturing, CALLS, 5)
    stages["entry"] = f"{entry.kernel} {entry.config} planned={plan is not None}"
    return stages


def layer_cases() -> list[tuple[str, object, object]]:
    """(name, ours, torch's) for the calls a model makes, on tiny bf16 channels_last shapes."""
    import torch
    import torch.nn.functional as F

    import tunecache.nn
    import tunecache.ops

    torch.manual_seed(0)
    dev, dt, cl = "cuda", torch.bfloat16, torch.channels_last
    conv_t = torch.nn.Conv2d(16, 16, 3, padding=1).to(dev, dt, memory_format=cl)
    conv_o = tunecache.nn.convert(torch.nn.Conv2d(16, 16, 3, padding=1)).to(dev, dt, memory_format=cl)
    conv_o.load_state_dict(conv_t.state_dict())
    lin_t = torch.nn.Linear(64, 64).to(dev, dt)
    lin_o = tunecache.nn.convert(torch.nn.Linear(64, 64)).to(dev, dt)
    lin_o.load_state_dict(lin_t.state_dict())
    x = torch.randn(2, 16, 8, 8, device=dev, dtype=dt).to(memory_format=cl)
    xg = x.detach().clone().requires_grad_(True)
    gy = torch.randn(2, 16, 8, 8, device=dev, dtype=dt).to(memory_format=cl)
    a = torch.randn(16, 64, device=dev, dtype=dt)
    ag = a.detach().clone().requires_grad_(True)
    ga = torch.randn(16, 64, device=dev, dtype=dt)

    def no_grad(fn):
        def call():
            with torch.no_grad():
                return fn()

        return call

    def fwd_bwd(layer, inp, grad):
        return lambda: layer(inp).backward(grad)

    cw, cb = conv_t.weight.detach(), conv_t.bias.detach()
    lw, lb = lin_t.weight.detach(), lin_t.bias.detach()
    xn, wn = x.permute(0, 2, 3, 1), cw.permute(0, 2, 3, 1)  # NHWC views, as a compiled graph passes them
    aten_conv = torch.ops.aten.convolution.default
    return [
        ("nn.Conv2d forward, no grad", no_grad(lambda: conv_o(x)), no_grad(lambda: conv_t(x))),
        ("nn.Conv2d forward", lambda: conv_o(xg), lambda: conv_t(xg)),
        ("nn.Conv2d forward+backward", fwd_bwd(conv_o, xg, gy), fwd_bwd(conv_t, xg, gy)),
        ("ops.conv2d", lambda: tunecache.ops.conv2d(x, cw, cb, 1, 1), lambda: F.conv2d(x, cw, cb, 1, 1)),
        ("nn.Linear forward, no grad", no_grad(lambda: lin_o(a)), no_grad(lambda: lin_t(a))),
        ("nn.Linear forward", lambda: lin_o(ag), lambda: lin_t(ag)),
        ("nn.Linear forward+backward", fwd_bwd(lin_o, ag, ga), fwd_bwd(lin_t, ag, ga)),
        ("ops.linear", lambda: tunecache.ops.linear(a, lw, lb), lambda: F.linear(a, lw, lb)),
        # a torch.compile'd model's conv: Inductor calls the custom op, or aten's convolution
        (
            "compiled graph's conv op, no grad",
            no_grad(lambda: torch.ops.tunecache.conv2d_nhwc.default(xn, wn, [1, 1], [1, 1])),
            no_grad(lambda: aten_conv(x, cw, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)),
        ),
    ]


def profile_of(fn, calls: int = 300, top: int = 25) -> list[str]:
    """The top functions of `calls` calls of `fn` by own time (cProfile)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue().splitlines()


def _entries() -> dict:
    from tunecache.ops.tuned import OP_LAUNCHERS

    return {(name, raw): e for name, op in OP_LAUNCHERS.items() for raw, e in op.memo.items()}


def winners_of(fn) -> list[str]:
    """fn called once: the winners its calls resolved that were not in the memo before (the
    vendor's op, or the kernel and its config): which launch the host time is of."""
    before = _entries()
    fn()
    new = [(k[0], e) for k, e in _entries().items() if k not in before]
    return [f"{op}: vendor" if e.vendor else f"{op}: {e.kernel} {e.config}" for op, e in new]


def layer_calls(profile: bool) -> list[dict]:
    import torch

    rows = []
    for name, ours, theirs in layer_cases():
        won = winners_of(ours)
        for fn in (theirs, ours, theirs):  # tuned, warm
            fn()
        torch.cuda.synchronize()
        row = {"call": name, "host_us_ours": host_us(ours, CALLS, 7), "host_us_torch": host_us(theirs, CALLS, 7)}
        row["winners"] = won
        row["ratio"] = row["host_us_ours"] / row["host_us_torch"]
        if profile:
            row["profile"] = profile_of(ours)
        rows.append(row)
        print(
            f"{name:32s} host {row['host_us_ours']:6.1f} us (torch {row['host_us_torch']:6.1f})  {row['ratio']:.2f}x",
            flush=True,
        )
        for line in row.get("profile", [])[:45]:
            print("    " + line)
    return rows


def _decode(lay) -> bool:
    """Llama-3-8B's GEMMs at decode sizes (M 1 and 16), bf16: host-bound like batch-1 convs."""
    return lay.model == "llama3-8b" and lay.dtype == "bfloat16" and lay.shape["M"] in (1, 16)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--layers",
        default="",
        help="comma-separated model/name of the suite (default: resnet50-b1's, Llama-3-8B's at M 1, 16)",
    )
    ap.add_argument("--ops", default="conv2d_fprop,matmul", help="the ops timed, of those each layer has")
    ap.add_argument("--breakdown", action="store_true", help="also time each stage of our call")
    ap.add_argument("--layer-calls", action="store_true", help="also time layer and functional calls vs torch's")
    ap.add_argument("--only-layer-calls", action="store_true", help="time only those (no suite layers)")
    ap.add_argument("--profile-layers", action="store_true", help="with the layer calls: our calls' cProfile")
    ap.add_argument("--out", default=None, help="results file name (default host-<device>)")
    args = ap.parse_args(argv)
    import torch

    os.environ.setdefault(
        "TUNECACHE_DB_URL", f"sqlite:///{Path(tempfile.mkdtemp(prefix='tunecache-host-')) / 's.sqlite'}"
    )
    if args.layers:
        layers = layers_named(args.layers, ap)
    else:
        layers = [lay for lay in suite() if lay.model == "resnet50-b1" or _decode(lay)]
    if args.only_layer_calls:
        layers = []
    wanted = set(args.ops.split(","))
    rows = []
    for lay in layers:
        name = f"{lay.model}/{lay.name}"
        for op, ours, vendor in cases(lay):
            if op not in wanted:
                continue
            won = winners_of(ours)
            vendor()
            torch.cuda.synchronize()
            row = {"layer": name, "op": op, "winners": won}
            row["host_us_ours"], row["host_us_vendor"] = host_us(ours, CALLS, 5), host_us(vendor, CALLS, 5)
            row["loop_us_ours"], row["loop_us_vendor"] = loop_us(ours), loop_us(vendor)
            row["loop_ratio"] = row["loop_us_vendor"] / row["loop_us_ours"]
            if args.breakdown:
                row["stages_us"] = breakdown(op, ours, vendor)
            rows.append(row)
            print(f"{name}: {'; '.join(won) or 'tuned before'}")
            print(
                f"{name:38s} {op:13s} host {row['host_us_ours']:6.1f} us (vendor {row['host_us_vendor']:5.1f})"
                f"  loop {row['loop_us_ours']:6.1f} us (vendor {row['loop_us_vendor']:5.1f})  {row['loop_ratio']:.3f}x",
                flush=True,
            )
            for k, v in row.get("stages_us", {}).items():
                print(f"    {k:32s} {v:.1f}" if isinstance(v, float) else f"    {k}: {v}")
    calls = layer_calls(args.profile_layers) if args.layer_calls or args.only_layer_calls else []
    info = device_info()
    summary: dict = {"device": info.get("device")}
    if calls:
        summary["layer_calls"] = {r["call"]: round(r["ratio"], 3) for r in calls}
        summary["layer_calls_max_ratio"] = max(r["ratio"] for r in calls)
    for op in sorted({r["op"] for r in rows}):
        rs = [r for r in rows if r["op"] == op]
        summary[op] = {
            "loop_geomean": geomean([r["loop_ratio"] for r in rs]),
            "loop_min": min(r["loop_ratio"] for r in rs),
            "host_us_ours_median": statistics.median(r["host_us_ours"] for r in rs),
            "host_us_vendor_median": statistics.median(r["host_us_vendor"] for r in rs),
            "layers": len(rs),
        }
    summary["command"] = "python benchmarks/bench_host.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(summary)
    name = args.out or f"host-{(info.get('device') or 'gpu').replace(' ', '_')}"
    path = write_results(name, {"summary": summary, "rows": rows, "layer_calls": calls})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
