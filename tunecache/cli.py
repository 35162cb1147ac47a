"""`tunecache`: every command a thin shell over a library function."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from tunecache.shapes import OPS, canonical_problem, shape_text

app = typer.Typer(
    help="A persistent, fleet-shared autotune cache for Triton/Gluon kernels.",
    no_args_is_help=True,
    add_completion=False,
)
db_app = typer.Typer(help="The store's schema (Alembic).", no_args_is_help=True)
app.add_typer(db_app, name="db")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"tunecache {version('tunecache')}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="print the version and exit"
    ),
) -> None:
    """A persistent, fleet-shared autotune cache for Triton/Gluon kernels."""


# Markup off: what is printed is the user's own text (shapes, manifests, configs, errors), in which
# square brackets are data ("[[shape]]", "[x]=1", [64, 128]); style comes from Text, never markup.
# stdout holds tables that fit the width (a soft-wrapping console would not fit them); messages
# on stderr are not wrapped: a log keeps each on one line, as grep expects
console = Console(markup=False)
err = Console(stderr=True, markup=False, soft_wrap=True)


def _error(msg: object) -> None:
    err.print(Text.assemble(("error:", "red"), " ", str(msg)))


def _store():
    from tunecache.store import Store, StoreError

    try:
        return Store()
    except StoreError as e:
        _error(e)
        raise typer.Exit(2) from None


def _fail(msg: str) -> None:
    _error(msg)
    raise typer.Exit(2)


def parse_problem(text: str) -> dict:
    """'M=4096,N=4096,K=4096,dtype=bfloat16' or a JSON object -> dict."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--problem is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("--problem JSON must be an object")
        return value
    out: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, sep, v = part.partition("=")
        if not sep:
            raise ValueError(f"--problem item {part!r} is not KEY=VALUE")
        out[k.strip()] = int(v) if v.strip().lstrip("-").isdigit() else v.strip()
    return out


def _device_class(device: str | None, gpu: int = 0):
    """The device class a command is for: --device ARCH:SMS, else TUNECACHE_DEVICE, else this
    machine's GPU `gpu`, else the CPU interpreter's (as a library call keys it)."""
    from tunecache.key import DeviceClass, local_device
    from tunecache.settings import device_override

    given = device or device_override()
    try:
        return DeviceClass.parse(given) if given else local_device(gpu)
    except ValueError as e:
        _fail(f"--device: {e}" if device else str(e))


def _backend(op: str, device, problem: dict, backend: str | None):
    """The kernel backend a command runs: --backend, else TUNECACHE_BACKEND, else the device's
    preferred one; an error names whichever of the two asked for it."""
    from tunecache import backends, settings

    forced, by = (backend, "--backend") if backend else (settings.backend_override(), "TUNECACHE_BACKEND")
    try:
        return backends.backend_for(op, device, problem, forced, forced_by=by)
    except (KeyError, ValueError) as e:
        _fail(str(e))


class Ticker:
    """Progress where no terminal shows a bar (a log file, CI, a pipe): the latest state as a
    plain line on stderr every TUNECACHE_PROGRESS_S seconds, from a thread, so a long quiet stage (compiles,
    a slow candidate) still says it is alive. On a terminal it prints nothing: the bar shows it."""

    def __init__(self) -> None:
        import threading
        import time

        from tunecache.settings import progress_s

        self.on = not err.is_terminal
        self.every_s, self.text, self.t0 = progress_s(), "", time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tunecache-ticker")

    def __enter__(self) -> "Ticker":
        if self.on:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def update(self, text: str) -> None:
        self.text = text

    def _run(self) -> None:
        import time

        while not self._stop.wait(self.every_s):
            if self.text:
                err.print(f"{self.text} ({time.monotonic() - self.t0:.0f} s)")


def _fit(text: str, width: int) -> str:
    """`text` cut to `width` characters, the cut shown."""
    return text if len(text) <= width else text[: width - 1] + "…"


def parse_sizes(text: str, option: str) -> tuple[int, ...]:
    """'3,224,224' (or '3x224x224') -> (3, 224, 224); a part that is not a size is named."""
    example = "give one sample's shape as sizes separated by commas, e.g. 3,224,224 (an image) or 2048 (a sequence)"
    sizes: list[int] = []
    for chunk in text.split(","):
        parts = [v.strip() for v in chunk.split("x")]
        if not all(v.isdigit() and int(v) >= 1 for v in parts):
            _fail(f"{option}: {chunk.strip()!r} in {text!r} is not a size (a whole number >= 1); {example}")
        sizes += [int(v) for v in parts]
    return tuple(sizes)


@app.command()
def tune(
    op: str = typer.Argument(..., help="matmul, conv2d_fprop, conv2d_wgrad or conv2d_dgrad"),
    problem: str = typer.Option(
        ...,
        "--problem",
        "-p",
        help="KEY=VALUE,... (matmul: M,N,K,dtype[,a_layout,b_layout]; conv: N,H,W,Ci,Co,R,S,"
        "stride,padding,dtype) or a JSON object",
    ),
    backend: Optional[str] = typer.Option(None, help="force a backend (default: the device's preferred one)"),
    gpu: int = typer.Option(0, help="CUDA device index"),
    force: bool = typer.Option(False, help="tune even if the store has a config"),
) -> None:
    """Tune one shape on this machine's device and keep the winner. With TUNECACHE_SERVER_URL set
    the fleet is asked first (a winner there is copied here, nothing is tuned) and what is tuned
    is published to it, as a library call does."""
    from rich.progress import Progress

    from tunecache.key import local_device, torch_device_for
    from tunecache.tuning.tuner import TuneError, make_key
    from tunecache.tuning.tuner import tune as run_tune

    try:
        p = canonical_problem(op, parse_problem(problem))
    except (ValueError, TypeError) as e:
        _fail(str(e))
    device = local_device(gpu)
    mod = _backend(op, device, p, backend)
    from tunecache.cache.config_cache import CACHE
    from tunecache.ops.launcher import launchable, tune_announcement

    _store()  # a store that cannot be opened at all is an error here, not a warning
    key = make_key(mod, p, device)
    if not force and (rec := CACHE.get(key, launchable(mod, p, device))) is not None:
        where = "in the fleet" if rec.source == "fleet" else "here"
        console.print(
            f"already tuned ({where}): {mod.KERNEL} {json.dumps(rec.config)} ({rec.median_ms:.4f} ms); --force to redo"
        )
        return
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = (
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("timed{task.fields[compiled]} · {task.fields[best]}"),
        TimeElapsedColumn(),
        TextColumn("left"),
        TimeRemainingColumn(),
    )
    where = torch_device_for(device, gpu)
    with Progress(*columns, console=err, transient=True) as bar, Ticker() as ticker:
        what = f"tuning {mod.KERNEL} on {device}"
        task = bar.add_task(what, total=None, compiled="", best="best: —")
        ticker.update(f"{what}: starting")
        # the tuner calls back as candidates compile (Gluon kernels, in parallel before their
        # timing) and as they are timed; the bar counts the timed ones
        state = {"compiled": None, "best": None}

        def progress(stage, i, n, best_ms):
            if stage == "start":  # what is tuned, and roughly how long it takes (the launcher says the same)
                err.print(tune_announcement(mod, p, device, n, where), highlight=False)
            if stage == "compile":
                state["compiled"] = max(state["compiled"] or 0, i)
            else:
                bar.update(task, completed=i)
            if best_ms is not None:
                state["best"] = best_ms
            compiled = "" if state["compiled"] is None else f" · {state['compiled']}/{n} compiled"
            best = "best: —" if state["best"] is None else f"best {state['best']:.4f} ms"
            bar.update(task, total=n, compiled=compiled, best=best)
            timed = bar.tasks[task].completed
            ticker.update(f"{what}: {timed:.0f}/{n} timed{compiled} · {best}")

        try:
            ranking = CACHE.ranking(mod.KERNEL, device)
            result = run_tune(mod, p, device, torch_device=where, source="cli", progress=progress, ranking=ranking)
        except TuneError as e:
            _fail(str(e))
    kept = CACHE.keep_tuned(result, device)
    if not kept.won:
        from tunecache.store import REPLACE_MARGIN

        console.print(
            f"the store keeps its result: {json.dumps(kept.record.config)} ({kept.record.median_ms:.4f} ms); "
            f"a new one replaces it only if {REPLACE_MARGIN:.0%} faster",
            style="dim",
        )
    tf = f", {result.tflops:.1f} TFLOP/s" if result.tflops else ""
    console.print(
        f"{mod.KERNEL} on {device}: {json.dumps(result.config)} — {result.median_ms:.4f} ms{tf}, "
        f"{result.candidates} candidates (digest {key.digest[:12]})",
        soft_wrap=True,
    )
    if kept.published is not None:
        console.print(published_text(kept.published.status, device), soft_wrap=True)


def published_text(status: str, device) -> str:
    """What became of a result sent to the fleet, and what happens next, in words."""
    from tunecache.fleet import protocol as p
    from tunecache.store import REPLACE_MARGIN

    return {
        p.WON: "fleet: published; it is the fleet's winner now",
        p.KEPT_EXISTING: "fleet: published; the fleet keeps its winner "
        f"(a result replaces it only if {REPLACE_MARGIN:.0%} faster)",
        p.QUEUED: "fleet: submitted; the fleet's winner once a worker re-times it (a job is queued for a "
        f"`tunecache worker` of {device}; until then other hosts get no winner for this key). A result counts "
        "at once only from a worker token (TUNECACHE_TOKEN with scope worker)",
        p.RECORDED: "fleet: submitted and recorded; the fleet's winner stays until a worker's measurement beats it "
        "(a publish token's result never replaces a winner by itself)",
        p.REFUSED: "fleet: the result was refused (see the warning above); it is kept on this host only",
        p.UNREACHABLE: "fleet: not published, the fleet could not be reached; it is kept on this host only",
    }.get(status, f"fleet: {status}")


@app.command("ls")
def ls(
    kernel: Optional[str] = typer.Option(None, help="only this kernel, e.g. matmul.hopper"),
    arch: Optional[str] = typer.Option(None, help="only this arch, e.g. sm_90"),
    limit: int = typer.Option(200, help="at most this many rows"),
    wide: bool = typer.Option(False, "--wide", help="every column (the config, TFLOP/s), however wide"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per config, nothing else"),
    fleet: bool = typer.Option(False, "--fleet", help="the fleet's configs (TUNECACHE_SERVER_URL), not this host's"),
) -> None:
    """List tuned configs in the store (fits 80 columns; --wide or --json for everything)."""
    if fleet:
        from tunecache.store.records import ConfigRecord

        rows = [ConfigRecord.from_json(c) for c in _fleet_export(kernel, arch)["configs"][:limit]]
    else:
        rows = _store().list_configs(kernel=kernel, arch=arch, limit=limit)
    if as_json:
        for r in rows:
            sys.stdout.write(json.dumps(r.to_json()) + "\n")
        return
    table = Table("digest", "kernel", "device", "shape", "ms", box=None, pad_edge=False)
    if wide:
        for name in ("TFLOP/s", "source", "config"):
            table.add_column(name)
    for col, width in zip(table.columns, (12, 21, 9, 12, 8)):
        col.overflow = "fold" if wide else "ellipsis"
        col.no_wrap = not wide
        col.min_width = width
    for r in rows:
        shape = shape_text(r.key.problem)
        cells = [r.digest[:12], r.key.kernel, f"{r.key.arch}:{r.key.sm_count}", shape, f"{r.median_ms:.4f}"]
        if wide:
            cells += [f"{r.tflops:.1f}" if r.tflops else "-", r.source, json.dumps(r.config, separators=(",", ":"))]
        table.add_row(*cells)
    (Console(width=max(console.width, 240)) if wide else console).print(
        table, width=None if wide else min(console.width, 80)
    )
    from tunecache.settings import server_url

    console.print(f"{len(rows)} config(s) in {server_url() if fleet else _store().safe_url}")


@app.command()
def show(digest: str = typer.Argument(..., help="a digest or a unique prefix of one")) -> None:
    """Show one tuned config and its trials as JSON."""
    store = _store()
    found = store.find_configs(digest)
    if not found:
        _fail(f"no config with digest {digest!r}")
    if len(found) > 1:
        _fail(f"{digest!r} matches {len(found)} configs; give more of the digest")
    rec = found[0]
    out = rec.to_json()
    out["trials"] = [t.__dict__ for t in store.trials(rec.digest)]
    console.print_json(json.dumps(out, default=str))


def _fleet_export(kernel: str | None, arch: str | None) -> dict:
    """The fleet's export (`GET /v1/export`), or exit 2 saying why not."""
    from tunecache.fleet.client import FleetClient
    from tunecache.settings import server_token, server_url

    url = server_url()
    if not url:
        _fail("--fleet needs TUNECACHE_SERVER_URL (and TUNECACHE_TOKEN)")
    answer = FleetClient(url, server_token(), timeout_s=120, max_bytes=1 << 30).export(kernel, arch)
    if answer is None:
        _fail(f"the fleet at {url} could not be reached (see the warning above)")
    status, body = answer
    if status != 200:
        _fail(f"the fleet answered {status}: {body}")
    return body


@app.command("export")
def export(
    path: Path = typer.Argument(..., help="output JSON file, or - for stdout"),
    kernel: Optional[str] = typer.Option(None),
    arch: Optional[str] = typer.Option(None),
    fleet: bool = typer.Option(False, "--fleet", help="the fleet's configs, not this host's"),
) -> None:
    """Export tuned configs as JSON (for another host, or `tunecache import`); --fleet exports
    the fleet's (TUNECACHE_SERVER_URL) instead of this host's store."""
    from tunecache.store.transfer import export_configs

    data = _fleet_export(kernel, arch) if fleet else export_configs(_store(), kernel=kernel, arch=arch)
    text = json.dumps(data, indent=1, default=str)
    if str(path) == "-":
        sys.stdout.write(text + "\n")
    else:
        path.write_text(text)
        err.print(f"exported {len(data['configs'])} config(s) to {path}")


@app.command("import")
def import_(path: Path = typer.Argument(..., help="a JSON file written by `tunecache export`")) -> None:
    """Import configs; each is validated, and a stored faster one is kept."""
    from tunecache.store.transfer import ImportErrorReport, import_configs

    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        _fail(f"cannot read {path}: {e}")
    try:
        report = import_configs(_store(), data)
    except ImportErrorReport as e:
        _fail(str(e))
    console.print(
        f"imported {report['stored']}, kept existing faster {report['kept']}, rejected {len(report['rejected'])}"
    )
    for msg in report["rejected"][:20]:
        err.print(f"  rejected: {msg}")


@app.command("manifest")
def manifest_cmd(
    from_model: str = typer.Option(
        ..., "--from-model", help="MODULE:FACTORY (called with no arguments) or torchvision:NAME (its model zoo)"
    ),
    batch: int = typer.Option(32, min=1, help="batch size of the training (or inference) step"),
    input_shape: str = typer.Option("3,224,224", "--input", help="one sample's shape: 3,224,224 (an image), 2048, ..."),
    dtype: str = typer.Option("bfloat16", help="the model's dtype: float16, bfloat16, float32"),
    input_dtype: Optional[str] = typer.Option(None, help="the input's dtype if not the model's (int64 for token ids)"),
    inference: bool = typer.Option(False, help="forward ops only (training adds the gradients' ops)"),
    name: Optional[str] = typer.Option(None, help="the manifest's name (default: from the model)"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="write the TOML here (default: standard output)"),
) -> None:
    """Write a `tunecache pretune` manifest from a model: one forward pass on the meta device
    (no memory, no compute) records what every nn.Conv2d and nn.Linear asks of tunecache's ops
    at this batch size, as `tunecache.nn.convert(model)` runs them. Then `tunecache pretune FILE`."""
    from tunecache.model_shapes import ModelError, entries, load_model, to_toml

    shape = parse_sizes(input_shape, "--input")
    # MODULE is looked up as `python -m` would: the current directory first (an entry point's
    # sys.path holds its own bin directory instead), so a model file beside you is found
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        model = load_model(from_model)
        found, left = entries(model, shape, batch, dtype, training=not inference, input_dtype=input_dtype)
    except ModelError as e:
        _fail(str(e))
    if not found:
        _fail(f"{from_model} has no nn.Conv2d or nn.Linear layer that tunecache runs")
    title = name or from_model.rpartition(":")[2]
    step = "inference" if inference else "training"
    text = to_toml(
        title, f"{from_model} at batch {batch}, input {shape}, {dtype}, {step} step (tunecache manifest)", found
    )
    from tunecache.fleet.pretune import shape_identity
    from tunecache.shapes import canonical_problem

    jobs = len({shape_identity(op, canonical_problem(op, e.fields)) for e in found for op in e.ops})
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
    err.print(
        f"{from_model}: {len(found)} distinct problem(s), {jobs} tuning job(s)"
        + (f" -> {out}" if out else "")
        + (f"; left to torch: {len(left)} layer(s) ({'; '.join(left[:3])})" if left else "")
    )


@app.command()
def sync(
    gpu: int = typer.Option(0, help="CUDA device index whose device class to fetch"),
    device: Optional[str] = typer.Option(
        None,
        help="a device class instead, as ARCH:SMS (e.g. sm_90:132): warm a store and a Triton cache for "
        "other machines, e.g. while building their image",
    ),
    binaries: bool = typer.Option(True, help="also install the winners' compiled kernels into Triton's cache"),
    all_kernels: bool = typer.Option(
        False,
        help="the winners of every kernel (your @tunecache.autotune kernels too), not only of the ops installed here",
    ),
) -> None:
    """Copy every fleet winner of this device class into this host's store, and their compiled
    kernels into Triton's cache, in one request: run it as a job starts, and no call of the job
    waits for the fleet or compiles a kernel the fleet has. Needs TUNECACHE_SERVER_URL (and
    TUNECACHE_TOKEN, a read token). A result tuned on this host is never replaced."""
    import time as _time

    from tunecache.cache.config_cache import CACHE
    from tunecache.fleet.client import FleetClient
    from tunecache.fleet.protocol import FleetError
    from tunecache.fleet.worker import tunable_kernels
    from tunecache.key import triton_version
    from tunecache.settings import device_override, server_token, server_url

    url = server_url()
    if not url:
        _fail("sync needs TUNECACHE_SERVER_URL (and TUNECACHE_TOKEN): the fleet to copy from")
    t0 = _time.perf_counter()
    given = device or device_override()
    dev = _device_class(device, gpu)
    versions = None if all_kernels else tunable_kernels(dev)
    _store()  # a store that cannot be opened at all is an error here, not a warning
    fleet = FleetClient(url, server_token(), timeout_s=300, max_bytes=1 << 30)
    try:
        got = CACHE.sync(fleet, dev, versions, triton_version(), binaries)
    except FleetError as e:
        _fail(str(e))
    for why in got.skipped:
        err.print(f"  skipped {why}")
    if not given and dev.arch != "cpu":
        # Triton builds its C launcher on a host's first launch (a second or more, once per
        # host and Triton): here, so that the job's first call need not
        from triton.runtime import driver

        driver.active.get_current_device()
    console.print(
        f"synced {got.total} winner(s) of {dev} from {url} in {_time.perf_counter() - t0:.1f} s: "
        f"{got.new} new or changed, {got.same} unchanged, {got.own} tuned here (kept)"
        + (f", {got.installed} compiled kernel(s) installed into Triton's cache" if binaries else "")
        + (f", {len(got.skipped)} malformed skipped" if got.skipped else "")
    )


@app.command()
def learn(
    arch: str = typer.Option("sm_90", help="the architecture whose trials train the trees (sm_90: Hopper)"),
    fleet: bool = typer.Option(True, "--fleet/--no-fleet", help="add the fleet's trials (TUNECACHE_SERVER_URL)"),
) -> None:
    """Train the candidate ranking's trees again on the trials the package ships, this store's
    and the fleet's: later tunes on this host rank their candidates by them (written under
    TUNECACHE_TREES_DIR). Run it now and then, e.g. after `tunecache pretune` or a week of
    workers' tunes. Needs LightGBM: pip install 'tunecache[learn]'."""
    from tunecache.cache.config_cache import CACHE
    from tunecache.tuning.learn import learn as train

    try:
        got = train(arch, _store(), CACHE.fleet() if fleet else None, say=lambda line: err.print(line, highlight=False))
    except (ImportError, ValueError) as e:
        _fail(str(e))
    if got and not any(g.trained for g in got):
        _fail(f"no kernel has trials enough on {arch} to train on: the package's trees keep ranking")


@app.command()
def doctor() -> None:
    """Versions, device, store location and counts."""
    from importlib.metadata import PackageNotFoundError, version

    from tunecache.settings import db_url, miss_policy, server_url

    def v(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    table = Table("what", "value", show_header=False)
    table.add_row("python", sys.version.split()[0])
    for name in ("tunecache", "triton", "torch", "sqlalchemy", "alembic"):
        table.add_row(name, v(name))
    try:
        import torch

        if torch.cuda.is_available():
            from tunecache.key import cuda_device

            for i in range(torch.cuda.device_count()):
                dc = cuda_device(i)
                table.add_row(f"cuda:{i}", f"{dc.name} ({dc})")
        else:
            table.add_row("device", "no CUDA GPU: the portable kernels run under TRITON_INTERPRET=1")
    except ImportError:
        table.add_row("device", "torch is not installed")
    table.add_row("store", db_url())
    table.add_row("miss policy", miss_policy())
    table.add_row("fleet", server_url() or "not configured (TUNECACHE_SERVER_URL)")
    fleet_ok = _doctor_fleet(table)
    from tunecache.store import Store, StoreError

    try:
        store = Store()
        for name, n in store.counts().items():
            table.add_row(name, str(n))
        from tunecache.store.migrate import current_revision

        table.add_row("schema", str(current_revision(store.engine)))
    except StoreError as e:
        table.add_row("store error", str(e))
        console.print(table)
        raise typer.Exit(1) from None
    console.print(table)
    if not fleet_ok:
        raise typer.Exit(1)


def _doctor_fleet(table: Table) -> bool:
    """The fleet's rows of `doctor`: reachable? the token, its scopes, what it may do; False if broken."""
    from tunecache.settings import server_token, server_url

    url = server_url()
    if not url:
        return True
    from tunecache.fleet.client import fleet_client

    token = server_token()
    answer = fleet_client(url).whoami()
    if answer is None:
        table.add_row("fleet check", Text.assemble((f"cannot reach {url}", "red"), " (see the warning above)"))
        return False
    status, body = answer
    if status == 200:
        scopes, may = ", ".join(body["scopes"]), set(body["may"])
        what = (
            "publish results and tune queued jobs"
            if "worker" in may
            else "publish results (re-timed by the fleet's workers)"
            if "publish" in may
            else "read configs only"
        )
        table.add_row("fleet token", f"{body['name']} (scopes: {scopes}): may {what}")
        return True
    if token is None:
        table.add_row(
            "fleet token",
            Text.assemble((f"none: the fleet answered {status}: {body}", "red"), " (set TUNECACHE_TOKEN)"),
        )
    else:
        table.add_row("fleet token", Text(f"refused ({status}): {body}", style="red"))
    return False


@db_app.command("upgrade")
def db_upgrade(
    url: Optional[str] = typer.Option(None, help="database URL (default TUNECACHE_DB_URL)"),
    revision: str = typer.Option("head"),
) -> None:
    """Create or upgrade the schema (run once per fleet database)."""
    from tunecache.store import Store, StoreError
    from tunecache.store.migrate import current_revision, upgrade

    try:
        store = Store(url, migrate=False)
    except StoreError as e:
        _fail(str(e))
    upgrade(store.engine, revision)
    console.print(f"{store.safe_url}: schema at {current_revision(store.engine)}")


# ---- the fleet: serve, worker, pretune, token ---------------------------------------------

token_app = typer.Typer(
    help="API tokens of the fleet service (stored hashed in TUNECACHE_DB_URL).", no_args_is_help=True
)
app.add_typer(token_app, name="token")


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="address to bind (0.0.0.0 for the fleet)"),
    port: int = typer.Option(8000, help="TCP port to listen on (1-65535)"),
    workers: int = typer.Option(1, help="uvicorn worker processes"),
    db_url: Optional[str] = typer.Option(None, help="the fleet database (default TUNECACHE_DB_URL)"),
    anonymous_read: bool = typer.Option(False, help="allow lookups without a token"),
    metrics_port: Optional[int] = typer.Option(
        None, min=1, max=65535, help="serve /metrics on this port instead of the API's (then off there)"
    ),
    metrics_host: str = typer.Option("127.0.0.1", help="address for --metrics-port"),
    log_level: str = typer.Option("info"),
    access_log: bool = typer.Option(True, help="log one line per request (client, method, path, status)"),
) -> None:
    """Run the fleet service (FastAPI on uvicorn) over the store; migrates it to head first."""
    import uvicorn

    from tunecache import settings
    from tunecache.server import edges
    from tunecache.store import Store, StoreError

    if not 1 <= port <= 65535:  # the socket would take it modulo 65536 and listen elsewhere
        _fail(f"--port {port} is not a TCP port: give one from 1 to 65535")
    if db_url:
        os.environ["TUNECACHE_DB_URL"] = db_url
    if anonymous_read:
        os.environ["TUNECACHE_ANONYMOUS_READ"] = "1"
    if metrics_port is not None:
        os.environ["TUNECACHE_METRICS_PORT"], os.environ["TUNECACHE_METRICS_HOST"] = str(metrics_port), metrics_host
    try:  # a bad limit fails here, naming its variable, not in every worker process
        settings.rate_limit(), settings.anon_rate_limit(), settings.body_timeout_s(), settings.job_ttl_s()
        settings.lookup_cache_s()
        edges.check_settings()
        if settings.metrics_address() is not None and workers > 1:
            _fail(
                "--metrics-port serves one process's metrics: use it with --workers 1 (run one process per "
                "container and scale containers)"
            )
    except ValueError as e:
        _fail(str(e))
    try:
        store = Store()  # fail here, clearly, rather than in every worker process
    except StoreError as e:
        _fail(str(e))
    err.print(f"tunecache service on http://{host}:{port} over {store.safe_url} (docs at /docs)")
    store.close()
    uvicorn.run(
        "tunecache.server.app:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level=log_level,
        access_log=access_log,
        **edges.uvicorn_options(),  # header size and time, connections per address and in all
    )


@app.command()
def worker(
    gpu: int = typer.Option(0, help="CUDA device index (ignored on the CPU interpreter)"),
    lease_s: float = typer.Option(60.0, help="lease length; heartbeats renew it every third"),
    poll_s: float = typer.Option(2.0, help="seconds between claims when the queue is empty"),
    burst: bool = typer.Option(False, help="exit when this device class has no queued or running job"),
    max_jobs: Optional[int] = typer.Option(None, help="exit after this many jobs"),
    source: str = typer.Option("worker", hidden=True),
) -> None:
    """Claim tuning jobs of this GPU's device class, tune, publish (the fleet's queue when
    TUNECACHE_SERVER_URL is set, else the local store's)."""
    import logging

    from tunecache.key import use_interpreter_without_gpu

    use_interpreter_without_gpu()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    for noisy in ("alembic", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from tunecache.fleet.client import Refused
    from tunecache.fleet.protocol import FleetError
    from tunecache.fleet.worker import run_worker

    try:
        outcomes = run_worker(gpu, lease_s=lease_s, poll_s=poll_s, burst=burst, source=source, max_jobs=max_jobs)
    except (ValueError, Refused, FleetError) as e:
        _fail(str(e))
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    err.print(f"worker done: {len(outcomes)} job(s) " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))


@app.command()
def pretune(
    manifest: str = typer.Argument(..., help="a TOML manifest file, or a shipped one: resnet50, llama_layer, tiny_cpu"),
    gpus: Optional[str] = typer.Option(None, help="GPU indices, e.g. 0,1 (default: every local GPU)"),
    lease_s: float = typer.Option(60.0, help="workers' lease length"),
    poll_s: float = typer.Option(1.0, help="seconds between progress checks"),
    dry_run: bool = typer.Option(False, help="list the shapes and their keys; enqueue nothing"),
    log_dir: Optional[Path] = typer.Option(None, help="write each worker's log here"),
) -> None:
    """Tune every shape of a manifest on the local GPUs, resumably: shapes with a stored config
    are skipped, an interrupted run picks up where it stopped."""
    from tunecache.key import use_interpreter_without_gpu

    use_interpreter_without_gpu()
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from tunecache.fleet.pretune import ManifestError, load_manifest, plan
    from tunecache.fleet.pretune import pretune as run_pretune
    from tunecache.fleet.worker import worker_device

    try:
        m = load_manifest(manifest)
        gpu_list = [int(g) for g in gpus.split(",")] if gpus else None
    except (ManifestError, ValueError) as e:
        _fail(str(e))
    if dry_run:
        device, _ = worker_device(gpu_list[0] if gpu_list else 0)
        table = Table("shape", "op", "kernel", "problem", "digest")
        for p in plan(m, device):
            prob = ",".join(f"{k}={v}" for k, v in p.shape.problem.items() if not k.startswith("gemm_"))
            table.add_row(p.shape.name, p.shape.op, p.kernel, prob, p.key.digest[:12])
        console.print(table)
        console.print(f"{len(m.shapes)} shape(s) on {device}")
        return
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    with (
        Progress(
            TextColumn("{task.description}", style="bold", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("shapes · {task.fields[running]}"),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
            console=err,
        ) as bar,
        Ticker() as ticker,
    ):
        task = bar.add_task(f"pretune {m.name}", total=None, running="")
        ticker.update(f"pretune {m.name}: planning")

        def on_plan(total, todo):
            bar.update(task, total=total, completed=total - todo)
            ticker.update(f"pretune {m.name}: {total - todo}/{total} shapes done")
            if not todo:
                bar.update(task, running="nothing to do")

        def on_progress(finished, n, statuses):
            counts = {s: sum(v == s for v in statuses.values()) for s in ("running", "queued", "failed")}
            running = ", ".join(f"{c} {s}" for s, c in counts.items() if c or s == "running")
            total = bar.tasks[task].total
            bar.update(task, completed=total - n + finished, running=running)
            ticker.update(f"pretune {m.name}: {total - n + finished}/{total} shapes done · {running}")

        try:
            report = run_pretune(
                m,
                gpus=gpu_list,
                lease_s=lease_s,
                poll_s=poll_s,
                log_dir=log_dir,
                on_plan=on_plan,
                on_progress=on_progress,
            )
        except RuntimeError as e:
            _fail(str(e))
    if report.interrupted:
        err.print(f"interrupted after {report.seconds:.0f} s; run it again to resume")
        raise typer.Exit(130)
    console.print(
        f"{m.name}: {report.total} shape(s): {report.already} already tuned, {report.tuned} tuned now, "
        f"{len(report.failed)} failed ({report.seconds:.1f} s)"
    )
    for f in report.failed:
        err.print(f"  failed: {f} (see `tunecache` worker logs or the dashboard)")
    if report.failed:
        raise typer.Exit(1)


def _token_store(db_url: Optional[str]):
    """The store whose tokens a `token` command works on, said aloud when it is this host's
    own SQLite file: a fleet service over Postgres would never see a token made there."""
    from tunecache import settings
    from tunecache.store import Store, StoreError

    if db_url:
        try:
            return Store(db_url)
        except StoreError as e:
            _fail(str(e))
    store = _store()
    if not settings.db_url_given():
        err.print(
            Text.assemble(
                ("note:", "yellow"),
                " TUNECACHE_DB_URL is not set: this works on this host's own store "
                f"({store.safe_url}), which only a `tunecache serve` on this host without TUNECACHE_DB_URL "
                "reads. For a fleet service, pass --db-url (or set TUNECACHE_DB_URL) to the service's database.",
            )
        )
    return store


@token_app.command("create")
def token_create(
    scope: list[str] = typer.Option(..., "--scope", help="read, publish, worker or admin (repeat or comma-separate)"),
    name: str = typer.Option("", help="who or what uses it (default: the scopes); unique among live tokens"),
    expires_in: Optional[str] = typer.Option(
        None, help="stop working after this long: 30d, 12h, 90m, 2w (default: never)"
    ),
    db_url: Optional[str] = typer.Option(None, help="the fleet database (default TUNECACHE_DB_URL)"),
) -> None:
    """Create a token; the secret is printed once and only its hash is stored."""
    from tunecache.store import StoreError

    scopes = [s.strip() for item in scope for s in item.split(",") if s.strip()]
    try:
        lifetime = None if expires_in is None else parse_duration(expires_in)
        store = _token_store(db_url)
        secret, rec = store.create_token(name or "+".join(scopes), scopes, expires_in=lifetime)
        store.audit(
            cli_actor(),
            "token.create",
            f"token:{rec.id}",
            {"name": rec.name, "scopes": list(rec.scopes), "expires_at": _iso(rec.expires_at)},
        )
    except (StoreError, ValueError) as e:
        _fail(str(e))
    until = f", expires {rec.expires_at:%Y-%m-%d %H:%M} UTC" if rec.expires_at else ""
    err.print(
        f"token {rec.name!r} (id {rec.id}) with scopes {', '.join(rec.scopes)}{until} "
        f"(shown once; export it as TUNECACHE_TOKEN):"
    )
    sys.stdout.write(secret + "\n")


@token_app.command("ls")
def token_ls(db_url: Optional[str] = typer.Option(None)) -> None:
    """List tokens (names and scopes; secrets are not stored)."""
    from tunecache.store import utcnow

    store = _token_store(db_url)
    now = utcnow()
    table = Table("id", "name", "scopes", "created", "expires", "revoked")
    for t in store.list_tokens():
        expires = "" if t.expires_at is None else str(t.expires_at)[:19] + (" (expired)" if t.expires_at <= now else "")
        table.add_row(
            str(t.id), t.name, ",".join(t.scopes), str(t.created_at)[:19], expires, str(t.revoked_at or "")[:19]
        )
    console.print(table)


@token_app.command("revoke")
def token_revoke(
    name: Optional[str] = typer.Argument(None, help="the live token's name (names of live tokens are unique)"),
    token_id: Optional[int] = typer.Option(None, "--id", help="the token's id (`tunecache token ls`)"),
    db_url: Optional[str] = typer.Option(None),
) -> None:
    """Revoke a token by name or by id (the service notices within 10 s)."""
    if (name is None) == (token_id is None):
        _fail("name the token to revoke, or give its --id (not both)")
    store = _token_store(db_url)
    live = {t.id: t for t in store.list_tokens() if t.revoked_at is None}
    target = next((t for t in live.values() if t.name == name), None) if token_id is None else live.get(token_id)
    what = f"named {name!r}" if token_id is None else f"with id {token_id}"
    if target is None or not store.revoke_token(token_id=target.id):
        _fail(f"no live token {what}")
    store.audit(cli_actor(), "token.revoke", f"token:{target.id}", {"name": target.name})
    console.print(f"revoked token {target.name!r} (id {target.id})")


@app.command("compile")
def compile_(
    op: str = typer.Option(..., "--op", help="matmul, conv2d_fprop, conv2d_wgrad or conv2d_dgrad"),
    backend: str = typer.Option(..., "--backend", help="a Gluon backend: blackwell or hopper"),
    arch: str = typer.Option(..., "--arch", help="explicit target: sm_90a or sm_100a"),
    problem: Optional[str] = typer.Option(
        None, "--problem", "-p", help="KEY=VALUE,... or JSON (default: a representative one)"
    ),
    all_configs: bool = typer.Option(False, "--all", help="every config of the space, pruned ones too"),
    workers: Optional[int] = typer.Option(None, help="compile processes (default: one per CPU core)"),
) -> None:
    """Compile configs for an explicit target, no GPU needed; one JSON line per config."""
    from tunecache.tuning.compile import report_lines
    from tunecache.tuning.compile_pool import compile_space

    with Ticker() as ticker:
        ticker.update(f"compiling {op}.{backend} for {arch}: starting")
        try:
            p = canonical_problem(op, parse_problem(problem)) if problem else None
            reports = compile_space(
                op,
                backend,
                arch,
                p,
                all_configs=all_configs,
                workers=workers,
                progress=lambda done, n: ticker.update(f"compiling {op}.{backend} for {arch}: {done}/{n} configs"),
            )
        except (ValueError, TypeError, KeyError) as e:
            _fail(str(e))
    for line in report_lines(reports, kernel=f"{op}.{backend}"):
        sys.stdout.write(line + "\n")


DEVICE_HELP = (
    "the device class ARCH:SMS, e.g. sm_90:132 (default: TUNECACHE_DEVICE, else this machine's GPU, "
    "else the CPU interpreter's, cpu:0)"
)


@app.command()
def key(
    op: str = typer.Argument(..., help="matmul, conv2d_fprop, conv2d_wgrad or conv2d_dgrad"),
    problem: str = typer.Option(..., "--problem", "-p", help="KEY=VALUE,... as for `tunecache tune`, or JSON"),
    device: Optional[str] = typer.Option(None, help=DEVICE_HELP),
    backend: Optional[str] = typer.Option(None, help="a backend (default: the device's preferred one)"),
) -> None:
    """Print the store's key for a shape: kernel, kernel version, Triton version, device class,
    the canonical problem and its digest, as JSON. The whole JSON is a body `POST /v1/lookup`
    (and `POST /v1/jobs`) takes; its digest is what `tunecache show` and the fleet's
    `GET /v1/configs/{digest}` take."""
    from tunecache.tuning.tuner import make_key

    dev = _device_class(device)
    try:
        p = canonical_problem(op, parse_problem(problem))
    except ValueError as e:
        _fail(str(e))
    k = make_key(_backend(op, dev, p, backend), p, dev)
    console.print_json(json.dumps({**k.fields(), "digest": k.digest}))


@app.command()
def query(
    op: str = typer.Argument(..., help="matmul, conv2d_fprop, conv2d_wgrad or conv2d_dgrad"),
    problem: str = typer.Option(..., "--problem", "-p", help="KEY=VALUE,... as for `tunecache tune`"),
    device: Optional[str] = typer.Option(None, help=DEVICE_HELP),
    backend: Optional[str] = typer.Option(None, help="only this backend's winner"),
    kernel_version: Optional[str] = typer.Option(None, help="only this kernel version"),
) -> None:
    """Ask the fleet (TUNECACHE_SERVER_URL) for the best config of a shape on a device class, as
    `GET /v1/best/OP` does; prints the winner as JSON, or what the fleet has nearby."""
    from tunecache import settings
    from tunecache.fleet.client import fleet_client

    url = settings.server_url()
    if not url:
        _fail("no fleet configured: set TUNECACHE_SERVER_URL (and TUNECACHE_TOKEN)")
    try:
        given = parse_problem(problem)
        canonical_problem(op, given)  # the same checks, here, before asking
    except ValueError as e:
        _fail(str(e))
    device = str(_device_class(device))
    pins = {k: v for k, v in (("backend", backend), ("kernel_version", kernel_version)) if v}
    answer = fleet_client(url).best(op, device, given, **pins)
    if answer is None:
        _fail(f"the fleet at {url} could not be reached (see the warning above)")
    status, body = answer
    if status != 200:
        _fail(f"the fleet answered {status}: {body}")
    console.print_json(json.dumps(body))


@app.command()
def selftest(
    op: Optional[str] = typer.Option(None, "--op", help="only this op (default: every op)"),
    backend: Optional[str] = typer.Option(
        None, "--backend", help="only this backend (default: each one that runs here)"
    ),
    gpu: int = typer.Option(0, help="CUDA device index"),
    force: bool = typer.Option(
        True, "--force/--stored", help="run the checks now (default), or show the stored verdicts"
    ),
) -> None:
    """Check each backend on this device: its default config over a small grid of problems per op,
    in an isolated process, against PyTorch. The ops run this once per device class and kernel
    version on their own (a backend that fails is skipped for the next one); this runs it on
    demand and stores the verdicts. Exits 1 if any backend failed."""
    from tunecache import backends
    from tunecache.key import local_device, torch_device_for
    from tunecache.ops import selfcheck

    device = local_device(gpu)
    ops_ = [op] if op else list(OPS)
    for name in ops_:
        if name not in OPS:
            _fail(f"unknown op {name!r}; expected one of {', '.join(OPS)}")
    table = Table(
        "op",
        "backend",
        "version",
        "verdict",
        "cases",
        "seconds",
        "detail",
        title=f"backend self-checks on {device} ({device.name})",
    )
    table.columns[-1].overflow = "fold"
    failed, elsewhere = 0, []
    for name in ops_:
        for b in backends.BACKENDS_BY_OP[name]:
            if backend and b != backend:
                continue
            try:
                mod = backends.backend_module(name, b)
            except KeyError:
                continue
            probe = selfcheck.grid(name, device)[0]
            if not mod.supports(probe, device):
                elsewhere.append(mod.KERNEL)
                continue
            v = selfcheck.verdict(mod, device, force=force, torch_device=torch_device_for(device, gpu))
            failed += not v.ok
            table.add_row(
                name,
                b,
                v.version[:8],
                Text("ok", style="green") if v.ok else Text("FAILED", style="red"),
                str(v.cases) if not v.stored else "-",
                f"{v.seconds:.1f}" if not v.stored else "stored",
                v.detail,
            )
    console.print(table)
    if elsewhere:
        console.print(f"not for this device: {', '.join(elsewhere)}", style="dim")
    if failed:
        raise typer.Exit(1)


# ---- retention and the audit log --------------------------------------------------------------


def parse_duration(text: str):
    """'30d', '12h', '90m', '45s', '2w' (or a number of seconds) -> timedelta."""
    from datetime import timedelta

    from tunecache.settings import parse_seconds

    return timedelta(seconds=parse_seconds(text))


def cli_actor() -> str:
    """Who acts from the command line, for the audit log: cli:user@host."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"cli:{user}@{socket.gethostname()}"


def _iso(t) -> str | None:
    return None if t is None else t.isoformat()


@db_app.command("prune")
def db_prune(
    older_than: str = typer.Option(..., help="delete what is older than this: 30d, 12h, 2w"),
    job_ttl: Optional[str] = typer.Option(
        None, help="expire jobs queued longer than this (default TUNECACHE_JOB_TTL_S, 7 days)"
    ),
    url: Optional[str] = typer.Option(None, help="database URL (default TUNECACHE_DB_URL)"),
) -> None:
    """Delete trials, submissions (each key's latest accepted one is kept) and finished jobs older
    than --older-than, and expire jobs queued past their TTL (marked failed, saying so). Run it
    from cron; the audit log is kept."""
    from tunecache.store import Store, StoreError

    try:
        age = parse_duration(older_than)
        ttl = None if job_ttl is None else parse_duration(job_ttl).total_seconds()
        store = Store(url) if url else _store()
        counts = store.prune(age.total_seconds(), job_ttl_s=ttl)
        store.audit(cli_actor(), "db.prune", store.safe_url, {"older_than": older_than, **counts})
    except (StoreError, ValueError) as e:
        _fail(str(e))
    console.print(
        f"pruned {counts['trials']} trial(s), {counts['submissions']} submission(s) and "
        f"{counts['jobs']} finished job(s) older than {older_than}; expired {counts['expired_jobs']} "
        f"queued job(s); removed {counts['binaries']} compiled kernel(s) of replaced or removed winners"
    )


audit_app = typer.Typer(
    help="The audit log of admin actions (deletes, imports, tokens, the queue).", no_args_is_help=True
)
app.add_typer(audit_app, name="audit")


@audit_app.command("ls")
def audit_ls(
    limit: int = typer.Option(50, help="at most this many rows, newest first"),
    action: Optional[str] = typer.Option(None, help="only this action, e.g. config.delete"),
    actor: Optional[str] = typer.Option(None, help="only this actor (a token's name, or cli:user@host)"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per row"),
    db_url: Optional[str] = typer.Option(None, help="the fleet database (default TUNECACHE_DB_URL)"),
) -> None:
    """List admin actions: who, what, on what, when."""
    from tunecache.store import Store

    store = Store(db_url) if db_url else _store()
    rows = store.audit_log(limit=limit, action=action, actor=actor)
    if as_json:
        for r in rows:
            sys.stdout.write(json.dumps({**r.__dict__, "at": _iso(r.at)}, default=str) + "\n")
        return
    table = Table("id", "when (UTC)", "actor", "action", "target", "details")
    for r in rows:
        who = r.actor if r.actor_token_id is None else f"{r.actor} (token {r.actor_token_id})"
        table.add_row(
            str(r.id),
            str(r.at)[:19],
            who,
            r.action,
            r.target,
            "" if r.details is None else json.dumps(r.details, separators=(",", ":"), default=str),
        )
    console.print(table)


# ---- the queue: tunecache jobs ls | retry | drop -------------------------------------------

jobs_app = typer.Typer(
    no_args_is_help=True,
    help=(
        "The tuning queue: list jobs, queue failed ones again, drop them.\n\n"
        "Which queue: with --db-url, the store at that URL (the local SQLite store, or the fleet's Postgres reached "
        "directly); else, with TUNECACHE_SERVER_URL set, the fleet service's, through its API and TUNECACHE_TOKEN "
        "(ls needs a read token, retry and drop an admin token); else the store at TUNECACHE_DB_URL. Retries and "
        "drops are kept in the audit log."
    ),
)
app.add_typer(jobs_app, name="jobs")

_DB_URL_HELP = (
    "work on the store at this URL directly (default: the fleet if TUNECACHE_SERVER_URL is set, else TUNECACHE_DB_URL)"
)


def _job_queue(db_url: Optional[str]):
    from tunecache.fleet.store_fleet import StoreFleet
    from tunecache.settings import server_token, server_url
    from tunecache.store import Store, StoreError

    if db_url or not server_url():
        try:
            store = Store(db_url) if db_url else Store()
        except StoreError as e:
            _fail(str(e))
        return StoreFleet(store, actor=cli_actor())
    from tunecache.fleet.client import FleetClient

    # an operator's listing may be long: more time and room than a kernel call's lookup
    return FleetClient(server_url(), server_token(), timeout_s=60, max_bytes=256 << 20)


def _digests(queue, given: list[str]) -> list[str]:
    """Full digests for digests or unique prefixes of them (as `ls` shows them)."""
    if all(len(d) == 64 for d in given):
        return given
    from tunecache.fleet.protocol import FleetError

    try:
        known = [j.digest for j in queue.jobs(limit=10000)]
    except FleetError as e:
        _fail(str(e))
    out = []
    for prefix in given:
        found = [d for d in known if d.startswith(prefix.lower())]
        if len(found) != 1:
            _fail(
                f"{prefix!r} matches {len(found)} jobs in {queue.where}; give more of the digest"
                if found
                else f"no job whose digest starts with {prefix!r} in {queue.where}"
            )
        out.append(found[0])
    return out


@jobs_app.command("ls")
def jobs_ls(
    status: Optional[str] = typer.Option(
        None, help="only jobs with this status: queued, running, done, failed or quarantined"
    ),
    device: Optional[str] = typer.Option(None, help="only this device class, e.g. sm_90:132 or cpu:0"),
    limit: int = typer.Option(1000, min=1, max=10000, help="at most this many jobs (oldest first)"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per job"),
    wide: bool = typer.Option(False, "--wide", help="every column in full (owner, times, the whole error)"),
    db_url: Optional[str] = typer.Option(None, help=_DB_URL_HELP),
) -> None:
    """List jobs: status, attempts, lease holder and until when, when a queued one may run, the
    last error (fits 80 columns; --wide or --json for everything). Quarantined jobs are rows that
    cannot be read (see their error)."""
    from tunecache.errors import last_line
    from tunecache.fleet.protocol import FleetError
    from tunecache.key import DeviceClass
    from tunecache.store.records import JOB_STATUSES

    if status is not None and status not in JOB_STATUSES:
        _fail(f"--status must be one of {', '.join(JOB_STATUSES)}, got {status!r}")
    try:
        dc = DeviceClass.parse(device) if device else None
    except ValueError as e:
        _fail(str(e))
    queue = _job_queue(db_url)
    try:
        jobs = queue.jobs(status=status, limit=limit, device=dc)
    except FleetError as e:
        _fail(str(e))
    if as_json:
        for j in jobs:
            sys.stdout.write(
                json.dumps(
                    {
                        **j.key.fields(),
                        "digest": j.digest,
                        "id": j.id,
                        "status": j.status,
                        "priority": j.priority,
                        "attempts": j.attempts,
                        "max_attempts": j.max_attempts,
                        "lease_owner": j.lease_owner,
                        "lease_expires_at": _iso(j.lease_expires_at),
                        "not_before": _iso(j.not_before),
                        "created_at": _iso(j.created_at),
                        "last_error": j.last_error,
                        "unreadable": j.unreadable,
                    }
                )
                + "\n"
            )
        return
    if not wide:
        console.print(_fit(f"{'digest':<12}  {'status':<11} {'tries':<5} {'device':<10} kernel", 80), style="bold")
    table = Table(
        "digest",
        "status",
        "kernel",
        "device",
        "problem",
        "attempts",
        "owner",
        "until / not before (UTC)",
        "last error",
    )
    for j in jobs:
        when = j.lease_expires_at if j.status == "running" else j.not_before if j.status == "queued" else None
        error = last_line(j.unreadable or (j.last_error or ""))
        device, shape = f"{j.key.arch}:{j.key.sm_count}", shape_text(dict(j.key.problem))
        tries = f"{j.attempts}/{j.max_attempts}"
        if wide:
            table.add_row(
                j.digest[:12],
                j.status,
                j.key.kernel,
                device,
                shape,
                tries,
                j.lease_owner or "",
                str(when or "")[:19],
                error,
            )
            continue
        # 80 columns, two lines a job: what it is, then its shape and what it waits for
        note = (
            f"until {when:%H:%M:%S} UTC, held by {j.lease_owner}"
            if j.status == "running" and when
            else f"not before {when:%H:%M:%S} UTC"
            if j.status == "queued" and when and (j.created_at is None or when > j.created_at)
            else error
        )
        console.print(_fit(f"{j.digest[:12]}  {j.status:<11} {tries:<5} {device:<10} {j.key.kernel}", 80))
        console.print(_fit(f"{'':14}{shape}" + (f" · {note}" if note else ""), 80), style="dim")
    if wide:
        Console(width=max(console.width, 240)).print(table)
    counts: dict[str, int] = {}
    for j in jobs:
        counts[j.status] = counts.get(j.status, 0) + 1
    console.print(
        f"{len(jobs)} job(s) in {queue.where}"
        + ("" if not counts else ": " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    )


@jobs_app.command("retry")
def jobs_retry(
    digests: Optional[list[str]] = typer.Argument(None, help="digests, or unique prefixes of them"),
    failed: bool = typer.Option(False, "--failed", help="every failed job (of --device, if given)"),
    device: Optional[str] = typer.Option(None, help="with --failed: only this device class"),
    db_url: Optional[str] = typer.Option(None, help=_DB_URL_HELP),
) -> None:
    """Queue jobs again now, attempts reset: failed, quarantined or backing-off ones (a running or
    done job is refused, saying why). Through the fleet this needs an admin token."""
    from tunecache.fleet.protocol import FleetError
    from tunecache.key import DeviceClass

    if not digests and not failed:
        _fail("name the jobs to retry (digests or prefixes from `tunecache jobs ls`), or pass --failed")
    queue = _job_queue(db_url)
    try:
        dc = DeviceClass.parse(device) if device else None
        todo = _digests(queue, list(digests or []))
        if failed:
            todo += [j.digest for j in queue.jobs(status="failed", limit=10000, device=dc) if j.digest not in todo]
    except (FleetError, ValueError) as e:
        _fail(str(e))
    bad = 0
    for d in todo:
        try:
            job = queue.retry(d)
            console.print(f"{d[:12]} {job.key.kernel}: queued again")
        except FleetError as e:
            bad += 1
            _error(e)
    console.print(f"retried {len(todo) - bad} job(s) in {queue.where}")
    if bad:
        raise typer.Exit(1)


@jobs_app.command("drop")
def jobs_drop(
    digests: list[str] = typer.Argument(..., help="digests, or unique prefixes of them"),
    db_url: Optional[str] = typer.Option(None, help=_DB_URL_HELP),
) -> None:
    """Delete jobs, whatever their state (a worker holding one loses its lease, and its result is
    not published). Through the fleet this needs an admin token."""
    from tunecache.fleet.protocol import FleetError

    queue = _job_queue(db_url)
    bad = 0
    for d in _digests(queue, digests):
        try:
            queue.drop_job(d)
            console.print(f"{d[:12]}: dropped")
        except FleetError as e:
            bad += 1
            _error(e)
    if bad:
        raise typer.Exit(1)


# ---- the fleet's winners: tunecache fleet purge ------------------------------------------------

fleet_app = typer.Typer(
    no_args_is_help=True,
    help=(
        "Operate on the fleet's winners in its database directly (--db-url, default TUNECACHE_DB_URL: the "
        "service's Postgres URL), as `tunecache token` does. Through the service, with an admin token: "
        "POST /v1/admin/purge."
    ),
)
app.add_typer(fleet_app, name="fleet")


@fleet_app.command("purge")
def fleet_purge(
    token: str = typer.Option(
        ..., "--token", help="the token's name (`tunecache token ls`); every token that had this name"
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="show what would be removed; change nothing"),
    db_url: Optional[str] = typer.Option(None, help="the fleet database (default TUNECACHE_DB_URL)"),
) -> None:
    """Remove everything one token submitted: every winner its results made and every submission
    it sent. Each displaced key is queued for a worker to tune again (a failed job is left for
    `tunecache jobs retry`), and the fleet's generation moves, so hosts drop their copies
    (within TUNECACHE_FLEET_TTL_S, or at their next generation poll). Kept in the audit log.
    Revoke the token too (`tunecache token revoke NAME`), or it can submit again.

    This works on the fleet's database directly (--db-url, else TUNECACHE_DB_URL), not through
    the service; through the service, an admin token calls POST /v1/admin/purge."""
    from tunecache.fleet.store_fleet import StoreFleet
    from tunecache.store import Store, StoreError

    try:
        store = Store(db_url) if db_url else _store()
        report = StoreFleet(store, actor=cli_actor()).purge(token, dry_run=dry_run)
    except StoreError as e:
        _fail(str(e))
    verb = "would remove" if dry_run else "removed"
    table = Table(
        "digest",
        "kernel",
        "device",
        "problem",
        "config",
        "ms",
        "job",
        title=f"winners made by token {token!r} ({verb})",
    )
    for r in report.removed:
        table.add_row(
            r.digest[:12],
            r.key.kernel,
            f"{r.key.arch}:{r.key.sm_count}",
            json.dumps(dict(r.key.problem), separators=(",", ":")),
            json.dumps(r.config, separators=(",", ":")),
            f"{r.median_ms:.4g}",
            report.jobs.get(r.digest, "-"),
        )
    if report.removed:
        console.print(table)
    failed = [d for d, st in report.jobs.items() if st not in ("queued", "running")]
    console.print(
        f"{verb} {len(report.removed)} winner(s) and {report.submissions} submission(s) of token {token!r}"
        + (
            ""
            if dry_run
            else f"; {len(report.removed) - len(failed)} key(s) queued for tuning; generation now {report.generation}"
        )
    )
    for d in failed:
        if report.jobs[d] == "unreadable":
            err.print(f"  {d[:12]}: a winner row that could not be read was {verb}; its key cannot be queued")
        else:
            err.print(f"  {d[:12]}: its job is {report.jobs[d]}: `tunecache jobs retry {d[:12]}` queues it again")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
