"""Where a training step's time goes (issue 16): bench_train's ResNet-50, torch's and the
converted one, tuned first: by bench_train.py on the same store, by --pretune, or else by the
warm-up steps' first calls (the default miss policy tunes them).

For each model: the step's wall time (CUDA events), the sum of its kernels' device times, the
GPU's idle share (wall minus busy: the host not keeping up), the step time when steps run back
to back (no wait between them: the larger of host and GPU time), and the kernels that cost the
most device time per step, by name, with their count (torch.profiler).

    python benchmarks/profile_train.py [--batch 128] [--steps 5] [--top 15]

Writes JSON with a `summary` to benchmarks/results/profile-train-<device>.json.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from bench_train import batches, build, pretune, step, time_steps  # noqa: E402
from common import device_info, host_us, write_results  # noqa: E402


def kernels_per_step(model, opt, data, steps: int) -> tuple[dict[str, tuple[float, int]], float]:
    """{kernel name: (device us per step, launches per step)} and the busy us per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for x, y in data[:steps]:
            step(model, opt, x, y)
        torch.cuda.synchronize()
    per: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += ev.device_time_total
            per[ev.name][1] += 1
    out = {k: (v[0] / steps, v[1] // steps) for k, v in per.items()}
    return out, sum(t for t, _ in out.values())


def pipelined_ms_per_step(model, opt, data, steps: int, profile_python: bool = False) -> float:
    """Milliseconds per step of `steps` steps run back to back, as a training loop that does not
    wait for each step runs them: the host queues a step while the GPU runs the one before, so
    this is the larger of the two. With `profile_python`, also print where the host's time goes
    (cProfile; a call that waits for a full launch queue shows as its own time)."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile() if profile_python else None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    if prof:
        prof.enable()
    for x, y in data[:steps]:
        step(model, opt, x, y)
    if prof:
        prof.disable()
    end.record()
    end.synchronize()
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    return start.elapsed_time(end) / steps


def host_per_layer(batch: int, profile_python: bool = False) -> dict[str, float]:
    """Host microseconds per call of one conv layer (ResNet-50's layer3 3x3, bf16,
    channels_last) down the layers of the stack: the op itself, the custom op, the module's
    forward, and the module's forward + backward, against torch.nn.Conv2d's."""
    import tunecache.nn
    from tunecache import ops
    from tunecache.ops import custom as custom_ops

    torch.manual_seed(0)
    cl = torch.channels_last
    x = torch.randn(batch, 256, 14, 14, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=cl)
    ref = torch.nn.Conv2d(256, 256, 3, padding=1, bias=False).to("cuda", torch.bfloat16, memory_format=cl)
    ours = tunecache.nn.convert(torch.nn.Conv2d(256, 256, 3, padding=1, bias=False))
    ours = ours.to("cuda", torch.bfloat16, memory_format=cl)
    xn, wn = x.permute(0, 2, 3, 1), ours.weight.permute(0, 2, 3, 1)
    xg = x.detach().requires_grad_()
    g = torch.randn_like(ref(x))

    def fwd_bwd(m):
        def run():
            m(xg).backward(g)

        return run

    gn = g.permute(0, 2, 3, 1)
    paths = {
        "ops.conv2d_fprop": lambda: ops.conv2d_fprop(xn, wn, (1, 1), (1, 1)),
        "ops.conv2d_dgrad": lambda: ops.conv2d_dgrad(gn, wn, 14, 14, (1, 1), (1, 1)),
        "ops.conv2d_wgrad": lambda: ops.conv2d_wgrad(xn, gn, 3, 3, (1, 1), (1, 1)),
        "custom_ops.conv2d_nhwc": lambda: custom_ops.conv2d_nhwc(xn, wn, [1, 1], [1, 1]),
        "custom_ops.conv2d_dgrad_nhwc": lambda: custom_ops.conv2d_dgrad_nhwc(gn, wn, 14, 14, [1, 1], [1, 1]),
        "custom_ops.conv2d_wgrad_nhwc": lambda: custom_ops.conv2d_wgrad_nhwc(xn, gn, 3, 3, [1, 1], [1, 1]),
        "nn.Conv2d forward (no grad)": lambda: ours(x),
        "nn.Conv2d forward + backward": fwd_bwd(ours),
        "torch forward + backward": fwd_bwd(ref),
        "torch forward (no grad)": lambda: ref(x),
    }
    # the floor under ops.conv2d_fprop: its plan's launch alone, and the parts of that
    ops.conv2d_fprop(xn, wn, (1, 1), (1, 1))
    entry = ops.OP_LAUNCHERS["conv2d_fprop"].memo.get(
        (xn.shape, xn.stride(), xn.dtype, xn.device, wn.shape, wn.stride(), wn.dtype, wn.device, (1, 1), (1, 1))
    )
    plan = getattr(getattr(entry, "run", None), "plan", None)
    if plan is not None:
        from tunecache_kernels import gluon_launch

        stream = torch.cuda.current_stream().cuda_stream
        shape = (xn.shape[0] * 14 * 14, 256)
        paths["fprop plan.run"] = lambda: plan.run(xn, wn, stream)
        paths["current_device_and_stream"] = gluon_launch.current_device_and_stream
        paths["direct_launch_enabled"] = gluon_launch.direct_launch_enabled
        paths["x.new_empty (the output)"] = lambda: xn.new_empty(shape)
    out = {}
    for name, fn in paths.items():
        with torch.enable_grad() if "backward" in name else torch.no_grad():
            for _ in range(3):
                fn()
            out[name] = host_us(fn, calls=30)
        print(f"    host {out[name]:7.1f} us per call  {name}")
    if profile_python:
        import cProfile
        import pstats

        run = fwd_bwd(ours)
        torch.cuda._sleep(2_000_000_000 // 1000 * 50)
        with cProfile.Profile() as prof:
            for _ in range(20):
                run()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5, help="profiled steps per model")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per model")
    ap.add_argument("--pretune", action="store_true", help="tune the model's shapes first (bench_train's)")
    ap.add_argument("--max-candidates", type=int, default=None)
    ap.add_argument("--cprofile", action="store_true", help="also print where a conv layer's host time goes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.pretune:
        pretune(args)
    data = list(batches(args.steps + 5, args.batch, seed=1))
    rows, summary = [], {}
    for name in ("torch", "tunecache"):
        model = build(0, convert=name == "tunecache")
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        for x, y in data[:5]:
            step(model, opt, x, y)
        wall = time_steps(model, opt, data, args.steps) * 1e3
        kernels, busy = kernels_per_step(model, opt, data, args.steps)
        piped = pipelined_ms_per_step(model, opt, data, args.steps)
        summary[name] = {"step_us": wall, "busy_us": busy, "idle_us": wall - busy, "pipelined_step_us": piped * 1e3}
        print(
            f"{name:10s} step {wall / 1e3:7.2f} ms, kernels {busy / 1e3:7.2f} ms, idle {(wall - busy) / 1e3:6.2f} ms, "
            f"back to back {piped:6.2f} ms"
        )
        if args.cprofile and name == "tunecache":
            pipelined_ms_per_step(model, opt, data, args.steps, profile_python=True)
        for k, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[: args.top]:
            print(f"    {us / 1e3:7.3f} ms  x{n:<4d} {k[:110]}")
            rows.append({"model": name, "kernel": k, "us_per_step": us, "launches_per_step": n})
    summary["step_ratio"] = summary["torch"]["step_us"] / summary["tunecache"]["step_us"]
    t, o = summary["torch"]["pipelined_step_us"], summary["tunecache"]["pipelined_step_us"]
    summary["pipelined_step_ratio"] = t / o
    print("one layer's host time per call:")
    summary["host_us_per_call"] = host_per_layer(args.batch, args.cprofile)
    summary["device"] = device_info()["device"]
    payload = {"summary": summary, "rows": rows}
    if args.out:
        out = Path(args.out)
        print("wrote", write_results(out.stem, payload, out.parent))
    else:
        print("wrote", write_results(f"profile-train-{summary['device'].replace(' ', '_')}", payload))


if __name__ == "__main__":
    main()
