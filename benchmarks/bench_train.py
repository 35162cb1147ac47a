"""A training step of ResNet-50 on tunecache's ops against the same step on cuDNN / cuBLAS.

Two copies of one ResNet-50 (torchvision's when it is installed, else the same architecture
defined here: v1.5, the stride in each stage's first 3x3), bf16, channels_last, batch
`--batch`, synthetic data: one stays torch's, the other is `tunecache.nn.convert`ed. Its
shapes are pre-tuned first (`tunecache manifest --from-model` of this very model, then
`tunecache pretune`, resumable: a second run tunes nothing). Then, in the same run:

- step time (forward + backward + SGD step), `--steps` timed steps per round after warm-up,
  the two models in turn over `--rounds` rounds (CUDA events, median per round);
- the loss of `--loss-steps` steps of each from the same seed and data, plotted to a PNG.

    python benchmarks/bench_train.py [--batch 128] [--steps 20] [--rounds 3] [--loss-steps 50]
        [--max-candidates 48] [--no-pretune] [--first-step model,inline,default]

--first-step model,inline,default times the model's first step on an empty store and an empty
Triton cache, each way in a fresh process (`first_steps`: tune_model first, each miss as met,
policy default beside a worker), and torch's (the summary's first_step_s); with --steps 0 only
that.
    python benchmarks/bench_train.py --model small_cnn --batch 32 --modes eager,compile,reduce-overhead,cuda-graph

--model small_cnn is the host-bound case (issue 39): ten 3x3 convolutions and a Linear on 32x32
images, where a step's kernels are a few microseconds each and the host's time per layer call
decides. --modes times each way of running a step, torch's model and tunecache's each the same
way in the same run: eager, `torch.compile` (default mode), `torch.compile(mode="reduce-overhead")`
(CUDA graphs under Inductor) and a whole step captured by `torch.cuda.graph` and replayed.

JSON (with `summary`: step_ratio = torch step / tunecache step, the loss curves' largest
relative gap) and the PNG go to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import RESULTS, device_info, write_results  # noqa: E402


class Bottleneck(torch.nn.Module):
    """torchvision's ResNet-50 block (v1.5)."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.conv1, self.bn1 = torch.nn.Conv2d(cin, width, 1, bias=False), torch.nn.BatchNorm2d(width)
        self.conv2 = torch.nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(width)
        self.conv3, self.bn3 = torch.nn.Conv2d(width, cout, 1, bias=False), torch.nn.BatchNorm2d(cout)
        self.relu = torch.nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = torch.nn.Sequential(
                torch.nn.Conv2d(cin, cout, 1, stride=stride, bias=False), torch.nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


def resnet50(num_classes: int = 1000) -> torch.nn.Module:
    """torchvision.models.resnet50() if torchvision is installed, else the same network."""
    try:
        import torchvision

        return torchvision.models.resnet50(num_classes=num_classes)
    except ImportError:
        pass
    layers: list[torch.nn.Module] = [
        torch.nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
        torch.nn.BatchNorm2d(64),
        torch.nn.ReLU(inplace=True),
        torch.nn.MaxPool2d(3, stride=2, padding=1),
    ]
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
            cin = width * 4
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(cin, num_classes)]
    return torch.nn.Sequential(*layers)


def small_cnn(num_classes: int = 10) -> torch.nn.Module:
    """Ten 3x3 convolutions (BatchNorm, ReLU; stride 2 at the 3rd, 5th and 7th) and a Linear."""
    chans = (3, 32, 32, 64, 64, 128, 128, 256, 256, 256, 256)
    layers: list[torch.nn.Module] = []
    for i in range(10):
        stride = 2 if i in (2, 4, 6) else 1
        layers += [
            torch.nn.Conv2d(chans[i], chans[i + 1], 3, stride=stride, padding=1, bias=False),
            torch.nn.BatchNorm2d(chans[i + 1]),
            torch.nn.ReLU(inplace=True),
        ]
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(chans[-1], num_classes)]
    return torch.nn.Sequential(*layers)


# model name -> (factory, one sample's shape, classes)
MODELS = {"resnet50": (resnet50, (3, 224, 224), 1000), "small_cnn": (small_cnn, (3, 32, 32), 10)}
MODES = ("eager", "compile", "reduce-overhead", "cuda-graph")


def build(seed: int, convert: bool, name: str = "resnet50") -> torch.nn.Module:
    torch.manual_seed(seed)
    model = MODELS[name][0]()
    if convert:
        import tunecache.nn

        tunecache.nn.convert(model)
    return model.to("cuda", torch.bfloat16, memory_format=torch.channels_last).train()


def batches(n: int, batch: int, seed: int, name: str = "resnet50"):
    _, sample, classes = MODELS[name]
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(n):
        x = torch.randn(batch, *sample, device="cuda", dtype=torch.bfloat16, generator=g)
        y = torch.randint(0, classes, (batch,), device="cuda", generator=g)
        yield x.contiguous(memory_format=torch.channels_last), y


def step(model, opt, x, y) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    loss.backward()
    opt.step()
    return loss


def pretune(args) -> float:
    """`tunecache manifest --from-model` of this script's model, then `tunecache pretune`."""
    manifest = Path(tempfile.mkdtemp()) / f"{args.model}.toml"
    sample = ",".join(map(str, MODELS[args.model][1]))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    if args.max_candidates is not None:
        env["TUNECACHE_MAX_CANDIDATES"] = str(args.max_candidates)
    t0 = time.perf_counter()
    cli = [sys.executable, "-m", "tunecache.cli"]
    subprocess.run(
        [
            *cli,
            "manifest",
            "--from-model",
            f"bench_train:{args.model}",
            "--batch",
            str(args.batch),
            "--input",
            sample,
            "-o",
            str(manifest),
        ],
        env=env,
        check=True,
    )
    subprocess.run([*cli, "pretune", str(manifest)], env=env, check=True)
    return time.perf_counter() - t0


def time_steps(run, data, n: int) -> float:
    """Milliseconds per step of `n` steps of `run(x, y)` back to back (CUDA events around them
    all: the host's time per step counts where it is longer than the GPU's)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for x, y in data[:n]:
        run(x, y)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


FIRST_STEP_WAYS = ("model", "inline", "default")


def first_steps(args, ways: list[str]) -> dict:
    """Seconds of each model's first training step on an empty store and an empty Triton cache
    (--first-step WAYS), each way in a fresh process of its own:
      model    `tunecache.tune_model(model, x)` then the step: the step's shapes read from the
               model and tuned together (the next shapes compile while this one's are timed)
      inline   the step alone: each miss tuned as the step meets it (policy `tune`)
      default  policy `default` with a `tunecache worker` already serving on the host: the step
               runs torch's ops and tunes nothing; later steps pick the winners up as the worker
               publishes them (TUNECACHE_RECHECK_S=1), counted until every layer runs one
    and torch's first step (its cuDNN algorithm picks) in this process."""
    out: dict = {}
    for way in ways:
        d = Path(tempfile.mkdtemp(prefix=f"tunecache-first-{way}-"))
        env = dict(os.environ, TUNECACHE_DB_URL=f"sqlite:///{d / 's.sqlite'}", TRITON_CACHE_DIR=str(d / "triton"))
        cmd = [sys.executable, __file__, "--model", args.model, "--batch", str(args.batch), "--first-step-child", way]
        cmd += ["--first-step-wait", str(args.first_step_wait)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"--first-step {way} failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
        out[way] = json.loads(lines[-1])
        print(f"{args.model} first step, batch {args.batch}, empty store, {way}: {out[way]}", flush=True)
    x, y = next(batches(1, args.batch, seed=3, name=args.model))
    model = build(0, convert=False, name=args.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(model, opt, x, y)
    torch.cuda.synchronize()
    out["torch"] = {"first_step_s": time.perf_counter() - t0}
    print(f"{args.model} first step, batch {args.batch}: torch {out['torch']['first_step_s']:.1f} s", flush=True)
    return out


def _first_step_summary(first_step: dict) -> dict:
    """The summary's first-step fields: seconds per way (and torch's), and each way's record."""
    return {"first_step_s": {k: v["first_step_s"] for k, v in first_step.items()}, "first_step": first_step}


def first_step_child(args) -> None:
    """One way of --first-step (its store and Triton cache are the caller's fresh ones): prints
    a JSON line."""
    import tunecache

    way = args.first_step_child
    worker = None
    if way == "default":
        os.environ.update(TUNECACHE_MISS_POLICY="default", TUNECACHE_RECHECK_S="1")
        log = Path(tempfile.mkdtemp(prefix="tunecache-worker-")) / "worker.log"
        with log.open("w") as f:
            worker = subprocess.Popen(
                [sys.executable, "-m", "tunecache.cli", "worker", "--poll-s", "0.5"],
                env=dict(os.environ),
                stdout=subprocess.DEVNULL,
                stderr=f,
            )
        # a worker already serving on the host, as the step meets it (its start is not the step's)
        t_ready = time.perf_counter()
        while "serving" not in log.read_text() and time.perf_counter() - t_ready < 120:
            time.sleep(0.2)
        time.sleep(3)  # its trial runner's start
    x, y = next(batches(1, args.batch, seed=3, name=args.model))
    model = build(0, convert=True, name=args.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out: dict = {"way": way}
    if way == "model":
        report = tunecache.tune_model(model, x)
        out.update(shapes=report.total, tuned=report.tuned, failed=len(report.failed))
        out["tune_model_s"] = time.perf_counter() - t0
    step(model, opt, x, y)
    torch.cuda.synchronize()
    out["first_step_s"] = time.perf_counter() - t0
    if worker is not None:
        from tunecache.ops import OP_LAUNCHERS

        def provisional() -> int:
            return sum(e.provisional for op in OP_LAUNCHERS.values() for e in op.memo.values())

        out["provisional_after_first_step"] = provisional()
        steps, deadline = 1, time.perf_counter() + args.first_step_wait
        while provisional() and time.perf_counter() < deadline:
            step(model, opt, x, y)
            torch.cuda.synchronize()
            steps += 1
        out.update(steps_until_winners=steps, seconds_until_winners=time.perf_counter() - t0)
        out["provisional_left"] = provisional()
        worker.terminate()
        worker.wait(30)
    print(json.dumps(out), flush=True)


def stepper(mode: str, model, opt, example):
    """A step `run(x, y)` of `model` run the `mode` way (MODES)."""
    if mode == "eager":
        return lambda x, y: step(model, opt, x, y)
    if mode in ("compile", "reduce-overhead"):
        compiled = torch.compile(model, mode=None if mode == "compile" else "reduce-overhead")
        return lambda x, y: step(compiled, opt, x, y)
    # a whole step (forward, backward, SGD) captured once and replayed on copies of the inputs,
    # as torch's CUDA graph docs capture a network; warmed up on a side stream first
    static_x, static_y = example[0].clone(), example[1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(model, opt, static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        loss = torch.nn.functional.cross_entropy(model(static_x).float(), static_y)
        loss.backward()
        opt.step()

    def replay(x, y):
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        return loss

    return replay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="resnet50")
    ap.add_argument("--modes", default="eager", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--loss-steps", type=int, default=50)
    ap.add_argument("--max-candidates", type=int, default=None, help="TUNECACHE_MAX_CANDIDATES for the pre-tuning")
    ap.add_argument("--no-pretune", action="store_true", help="the store is tuned already (or tune on first use)")
    ap.add_argument(
        "--first-step",
        default="",
        help=f"time the model's first step on an empty store, comma-separated ways of {', '.join(FIRST_STEP_WAYS)}",
    )
    ap.add_argument("--first-step-child", choices=FIRST_STEP_WAYS, help=argparse.SUPPRESS)
    ap.add_argument(
        "--first-step-wait", type=float, default=1200, help="--first-step default: seconds to step until every winner"
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="only plot the loss curves of a results JSON to a PNG")
    args = ap.parse_args()
    if args.first_step_child:
        first_step_child(args)
        return
    if args.plot:
        print(f"plot {plot(args.plot)}")
        return

    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {', '.join(bad)}; choose from {', '.join(MODES)}")
    first_step = None
    if args.first_step:
        ways = [w for w in args.first_step.split(",") if w]
        bad = [w for w in ways if w not in FIRST_STEP_WAYS]
        if bad:
            ap.error(f"--first-step: unknown {', '.join(bad)}; choose from {', '.join(FIRST_STEP_WAYS)}")
        first_step = first_steps(args, ways)
        if args.steps == 0:  # the first steps only
            summary = {"model": args.model, "batch": args.batch, **_first_step_summary(first_step)}
            summary["device"] = device_info().get("device")
            print(summary)
            write_results(f"first-step-{args.model}-b{args.batch}", {"summary": summary})
            return
    # the steps below run on this process's own store, pre-tuned (the first steps had their own)
    tune_s = None if args.no_pretune else pretune(args)
    data = list(batches(max(args.steps, args.warmup), args.batch, seed=1, name=args.model))
    ms_by_mode: dict[str, dict[str, float]] = {}
    rounds_by_mode: dict[str, dict[str, list[float]]] = {}
    for mode in modes:
        models = {k: build(0, convert=k == "tunecache", name=args.model) for k in ("torch", "tunecache")}
        opts = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for k, m in models.items()}
        runs = {}
        for k, m in models.items():
            runs[k] = stepper(mode, m, opts[k], data[0])
            for x, y in data[: args.warmup]:  # warm-up: first calls, cuDNN's algorithm search, compiles
                runs[k](x, y)
        torch.cuda.synchronize()
        rounds = {k: [] for k in models}
        for _ in range(args.rounds):
            for k in models:
                rounds[k].append(time_steps(runs[k], data, args.steps))
        rounds_by_mode[mode] = rounds
        ms_by_mode[mode] = {k: statistics.median(v) for k, v in rounds.items()}
        ms = ms_by_mode[mode]
        print(
            f"{args.model} step, batch {args.batch}, {mode}: torch {ms['torch']:.2f} ms, tunecache "
            f"{ms['tunecache']:.2f} ms ({ms['torch'] / ms['tunecache']:.3f}x)",
            flush=True,
        )

    # the loss of the same steps from the same seed and data (eager)
    losses = {}
    for k in ("torch", "tunecache"):
        model = build(0, convert=k == "tunecache", name=args.model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        data2 = batches(args.loss_steps, args.batch, seed=2, name=args.model)
        losses[k] = [step(model, opt, x, y).item() for x, y in data2]
    gap = max(abs(a - b) / abs(b) for a, b in zip(losses["tunecache"], losses["torch"]))

    name = args.out.stem if args.out else f"train-{args.model}-b{args.batch}"
    out_dir = args.out.parent if args.out else RESULTS
    first = ms_by_mode[modes[0]]
    summary = {
        "model": args.model,
        "step_ratio": first["torch"] / first["tunecache"],  # the first mode's (eager by default)
        "step_ms": first,
        "step_ratio_by_mode": {m: v["torch"] / v["tunecache"] for m, v in ms_by_mode.items()},
        "step_ms_by_mode": ms_by_mode,
        "loss_max_rel_gap": gap,
        "batch": args.batch,
        "pretune_s": tune_s,
        **(_first_step_summary(first_step) if first_step else {}),
        "device": device_info().get("device"),
    }
    print(f"{summary['step_ratio_by_mode']}; loss curves within {gap:.3%}")
    # the JSON first: a GPU host without matplotlib keeps the run (plot it elsewhere: --plot)
    path = write_results(name, {"summary": summary, "rounds_ms": rounds_by_mode, "losses": losses}, out_dir)
    print(f"wrote {path}")
    try:
        print(f"plot {plot(path)}")
    except ImportError:
        print(f"no matplotlib here: plot it where there is, python {Path(__file__).name} --plot {path}")


def plot(results: Path) -> Path:
    """The loss curves of a results JSON, as a PNG beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(results).read_text())
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, v in data["losses"].items():
        ax.plot(range(1, len(v) + 1), v, label=k)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    model = data["summary"].get("model", "resnet50")
    ax.set_title(f"{model}, batch {data['summary']['batch']}, bf16, same seed and data")
    ax.legend()
    png = Path(results).with_name(Path(results).stem + "-loss.png")
    fig.savefig(png, dpi=120, bbox_inches="tight")
    return png


if __name__ == "__main__":
    main()
