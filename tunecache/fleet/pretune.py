"""`tunecache pretune MANIFEST`: tune every shape of a manifest on the local GPUs, resumably.

A manifest is a small TOML file: a list of shapes, each one op (or several, e.g. a conv
layer's fprop and wgrad) and the sizes `tunecache tune --problem` takes:

    name = "resnet50"
    ops = ["conv2d_fprop", "conv2d_wgrad"]       # the ops of every shape unless it names its own
    [defaults]
    N = 32
    dtype = "bfloat16"
    [[shape]]
    name = "conv1"
    H = 224; W = 224; Ci = 3; Co = 64; R = 7; S = 7; stride = 2; padding = 3

Every shape becomes a job in the queue (the fleet's if TUNECACHE_SERVER_URL is set, else the
local store's), then one worker per local GPU runs until the manifest's jobs are finished.
The state lives in the queue and the store, not in this process: a shape with a stored
config is skipped, enqueueing is idempotent, and a job left running by an interrupted run
is released (Ctrl-C) or claimed again when its lease runs out (kill -9). So a rerun of a
finished manifest does nothing, and a rerun of an interrupted one resumes.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from tunecache.key import DeviceClass, TuneKey
from tunecache.shapes import OPS

if TYPE_CHECKING:
    from tunecache.fleet.protocol import Fleet

log = logging.getLogger("tunecache.fleet.pretune")

MANIFEST_DIR = Path(__file__).resolve().parents[1] / "manifests"  # tunecache/manifests


class ManifestError(ValueError):
    """The manifest cannot be read or names something unknown; the message says where."""


@dataclass
class Shape:
    op: str
    given: dict  # as written (after defaults), e.g. {"M": 4096, "N": 4096, "K": 4096, "dtype": "bfloat16"}
    problem: dict  # canonical, as a library call computes it
    name: str = ""


@dataclass
class Manifest:
    name: str
    path: Path
    description: str = ""
    shapes: list[Shape] = field(default_factory=list)


def manifest_path(name_or_path: str | os.PathLike) -> Path:
    """A file path, or the name of a shipped manifest ("resnet50" -> manifests/resnet50.toml)."""
    p = Path(name_or_path)
    if p.exists():
        return p
    shipped = MANIFEST_DIR / f"{p.name.removesuffix('.toml')}.toml"
    if shipped.exists():
        return shipped
    known = sorted(f.stem for f in MANIFEST_DIR.glob("*.toml"))
    raise ManifestError(f"no manifest {str(name_or_path)!r}: not a file, and not a shipped one ({', '.join(known)})")


def _toml_load(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ManifestError("reading TOML manifests on Python 3.10 needs `pip install tomli`") from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ManifestError(f"cannot read manifest {path}: {e}") from None


def shape_identity(op: str, problem: dict) -> str:
    """Two shapes of a manifest with this identity are one tuning job."""
    return f"{op}:{sorted(problem.items())}"


def load_manifest(name_or_path: str | os.PathLike) -> Manifest:
    """Parse a manifest and compute each shape's canonical problem (the op's own checks)."""
    from tunecache.shapes import canonical_problem

    path = manifest_path(name_or_path)
    data = _toml_load(path)
    defaults = data.get("defaults", {})
    default_ops = data.get("ops", data.get("op"))
    entries = data.get("shape", [])
    if not isinstance(entries, list) or not entries:
        raise ManifestError(f"{path}: no [[shape]] entries")
    m = Manifest(name=str(data.get("name", path.stem)), path=path, description=str(data.get("description", "")))
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ManifestError(f"{path}: shape #{i + 1} is not a table")
        given = {**defaults, **entry}
        name = str(given.pop("name", f"#{i + 1}"))
        ops = given.pop("ops", given.pop("op", default_ops))
        ops = [ops] if isinstance(ops, str) else ops
        if not ops:
            raise ManifestError(f"{path}: shape {name} names no op (set `op` or `ops`)")
        for op in ops:
            if op not in OPS:
                raise ManifestError(f"{path}: shape {name}: unknown op {op!r}; known: {', '.join(OPS)}")
            try:
                problem = canonical_problem(op, given)
            except (ValueError, TypeError) as e:
                raise ManifestError(f"{path}: shape {name} ({op}): {e}") from None
            ident = shape_identity(op, problem)
            if ident not in seen:  # e.g. a downsample conv that repeats a main-path shape
                seen.add(ident)
                m.shapes.append(Shape(op, given, problem, name))
    return m


@dataclass
class Planned:
    shape: Shape
    kernel: str
    key: TuneKey


def plan(manifest: Manifest, device: DeviceClass, backend: str | None = None) -> list[Planned]:
    """The key each shape has on `device` (the backend a library call would pick there)."""
    from tunecache import backends, settings
    from tunecache.tuning.tuner import make_key

    out = []
    for s in manifest.shapes:
        mod = backends.backend_for(s.op, device, s.problem, backend or settings.backend_override())
        out.append(Planned(s, mod.KERNEL, make_key(mod, s.problem, device)))
    return out


def longest_first(planned: list[Planned], device: DeviceClass) -> list[Planned]:
    """`planned` in the order to enqueue it: the tunes expected to take longest first, so that
    the GPUs run out of work together instead of one finishing a long tune alone at the end.
    The measure is the size of the shape's pruned space (on an H100 a tune's seconds follow
    it: 290 configs 4.5 s, 1,000-1,800 configs 9-11 s; its compile workers build more of a
    larger space), and the problem's FLOPs (the backend's own `flops`) break ties."""
    from tunecache import backends

    def cost(p: Planned) -> tuple[int, float]:
        try:
            mod = backends.module_for_kernel(p.kernel)
            problem = p.shape.problem
            return len(mod.prune(mod.config_space(problem, device), problem, device)), mod.flops(problem)
        except Exception:  # noqa: BLE001 - an order only: the tune says what is wrong with the shape
            return 0, 0.0

    return sorted(planned, key=cost, reverse=True)


@dataclass
class Report:
    total: int
    already: int  # had a config before this run
    tuned: int = 0
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0
    interrupted: bool = False


def local_gpus() -> list[int]:
    import torch

    from tunecache.key import interpreting

    return [] if interpreting() else list(range(torch.cuda.device_count()))


def worker_env(workers: int) -> dict[str, str]:
    """The environment of one of `workers` workers on this host: each compiles with its share
    of the CPU cores (TUNECACHE_COMPILE_WORKERS, unless set), so that workers tuning side by
    side do not each start a compile process per core and slow one another down."""
    from tunecache.tuning.compile_pool import default_workers

    env = dict(os.environ)
    if workers > 1 and not env.get("TUNECACHE_COMPILE_WORKERS", "").strip():
        env["TUNECACHE_COMPILE_WORKERS"] = str(max(1, default_workers() // workers))
    return env


def _spawn_worker(
    gpu: int, lease_s: float, poll_s: float, log_dir: Path | None, env: dict[str, str] | None = None
) -> Any:
    """A `tunecache worker --burst` for `gpu` (a subprocess.Popen or a forkserver.ForkedProcess)."""
    cmd = [
        sys.executable,
        "-m",
        "tunecache.cli",
        "worker",
        "--gpu",
        str(gpu),
        "--burst",
        "--lease-s",
        str(lease_s),
        "--poll-s",
        str(poll_s),
        "--source",
        "pretune",
    ]
    from tunecache.tuning import forkserver

    env = dict(os.environ if env is None else env)
    out = open(log_dir / f"worker-gpu{gpu}.log", "ab") if log_dir is not None else open(os.devnull, "wb")
    with out, open(os.devnull, "rb") as nothing:
        # forked from the host's runner server (torch imported: the worker's start is not
        # seconds of imports, which a run on more GPUs would not divide); SIGTERM when we exit
        fds = (nothing.fileno(), out.fileno(), out.fileno())
        forked = forkserver.spawn("tunecache.cli", cmd[3:], env, fds, signal.SIGTERM)
        if forked is not None:
            return forked
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)


def _die_with_parent() -> None:
    """In the child: SIGTERM when pretune dies, even by kill -9, so no worker is orphaned
    (SIGTERM makes the worker release its job). Linux only; elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def pretune(
    manifest: Manifest,
    *,
    gpus: list[int] | None = None,
    queue: Fleet | None = None,
    lease_s: float = 60.0,
    poll_s: float = 1.0,
    priority: int = 10,
    log_dir: Path | None = None,
    on_progress: Callable[[int, int, dict[str, str]], None] | None = None,
    on_plan: Callable[[int, int], None] | None = None,
) -> Report:
    """Enqueue every shape of `manifest` without a config, run workers until they are done."""
    from tunecache.fleet import default_fleet
    from tunecache.fleet.worker import worker_device
    from tunecache.tuning import forkserver

    t0 = time.perf_counter()
    gpus = local_gpus() if gpus is None else gpus
    env = worker_env(len(gpus or [0]))
    forkserver.ensure_server(env)  # it imports torch while the manifest is planned and enqueued
    device, _ = worker_device(gpus[0] if gpus else 0)
    queue = queue or default_fleet()
    planned = plan(manifest, device)
    # the shapes without a config are enqueued, longest tunes first; the others are done
    tuned = queue.enqueue_missing([p.key for p in longest_first(planned, device)], priority=priority)
    if tuned is None:
        raise RuntimeError(f"cannot enqueue into {queue.where}: the service is unreachable or refused")
    todo = [p for p in planned if p.key.digest not in tuned]
    report = Report(total=len(planned), already=len(planned) - len(todo))
    if on_plan:
        on_plan(len(planned), len(todo))
    if not todo:
        report.seconds = time.perf_counter() - t0
        return report
    digests = [p.key.digest for p in todo]
    forkserver.ensure_server(env, wait_s=60.0)
    workers = {g: _spawn_worker(g, lease_s, poll_s, log_dir, env) for g in (gpus or [0])}
    restarts = {g: 0 for g in workers}
    statuses: dict[str, str] = {}
    try:
        while True:
            statuses = queue.statuses(digests) or statuses  # a failed poll keeps what was known
            finished = sum(statuses.get(d) in ("done", "failed") for d in digests)
            if on_progress:
                on_progress(finished, len(digests), statuses)
            if finished == len(digests):
                break
            for g, proc in list(workers.items()):
                if proc.poll() is not None:  # a burst worker exits when its queue is empty
                    if restarts[g] >= 3:
                        raise RuntimeError(
                            f"the worker on GPU {g} keeps exiting (code {proc.returncode}) "
                            f"with {len(digests) - finished} job(s) left; see its log"
                        )
                    restarts[g] += 1
                    workers[g] = _spawn_worker(g, lease_s, poll_s, log_dir, env)
            time.sleep(poll_s)
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        for proc in workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # releases its job: a rerun resumes at once
        for proc in workers.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    statuses = queue.statuses(digests) or statuses  # the fleet unreachable now: the last answer
    report.tuned = sum(statuses.get(d) == "done" for d in digests)
    report.failed = [f"{p.shape.name} {p.shape.op}" for p in todo if statuses.get(p.key.digest) == "failed"]
    report.seconds = time.perf_counter() - t0
    return report
