"""The dashboard page (`GET /`; who may see it is system.py's business): what tuning bought per
device class and kernel (the tuned config against the backend's untuned default and against
the vendor's op, cuBLAS / cuDNN, as measured in the same tuning run), the tuning time of each
shape, the queue with ages, and the lookups' hit and miss rates.

Rendered on the server, one HTML page with its plots inline as SVG (matplotlib, no pyplot,
no script, no external asset: a fleet's network often reaches nothing outside). matplotlib is
imported on the first render only, so `import tunecache` and the API stay light. The plots of
the same data are rendered once per PLOT_CACHE_S (the page refreshes itself, and a room full
of open dashboards must not keep the service drawing). Everything from the store is escaped.
"""

from __future__ import annotations

import hashlib
import html
import io
import json
import math
import re
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tunecache.shapes import shape_text
from tunecache.store import ConfigRecord, JobRecord, Store, utcnow
from tunecache_kernels.spaces import is_vendor

PLOT_CACHE_S = 10.0
MAX_CONFIGS = 2000  # configs read for the plots and the summary
MAX_SHAPES_PER_PLOT = 40  # shapes drawn per (device class, kernel); the rest are counted
MAX_TUNE_LOOKUPS = 400  # per render: the tuning time of this many plotted shapes at most
MAX_JOBS = 100  # rows per queue table
MAX_CONFIG_ROWS = 200  # rows of the configs table
ERROR_TAIL = 300  # characters of a job's last error shown in a table (the whole tail on hover)
ERROR_LINES = 3  # and lines of it
SHAPE_CHARS = 48  # a shape longer than this (a user kernel's own problem) is cut, whole on hover

e = html.escape


# ---- small formatting helpers ------------------------------------------------------------------


def _short(text: str, n: int = SHAPE_CHARS) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def age(seconds: float | None) -> str:
    """'45s', '12m', '3h05m', '2d04h' (a negative age: the time lies ahead)."""
    if seconds is None:
        return ""
    s = int(abs(seconds))
    if s < 120:
        out = f"{s}s"
    elif s < 3600:
        out = f"{s // 60}m"
    elif s < 86400:
        out = f"{s // 3600}h{s % 3600 // 60:02d}m"
    else:
        out = f"{s // 86400}d{s % 86400 // 3600:02d}h"
    return out if seconds >= 0 else f"in {out}"


def _secs(delta_from: datetime | None, now: datetime) -> float | None:
    return None if delta_from is None else (now - delta_from).total_seconds()


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.4f}"


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def _duration(s: float | None) -> str:
    if s is None:
        return "–"
    if s < 100:
        return f"{s:.1f} s"
    if s < 6000:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def _geomean(vals: list[float]) -> float | None:
    vals = [v for v in vals if v and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def vendor_name(kernel: str, arch: str) -> str:
    """Who the vendor's op is on this device class: cuBLAS for GEMMs and cuDNN for convolutions on
    an NVIDIA GPU (what torch calls there), torch's own op elsewhere."""
    if not arch.startswith("sm_"):
        return "torch"
    return "cuBLAS" if kernel.partition(".")[0] == "matmul" else "cuDNN"


# ---- what the plots show ------------------------------------------------------------------------


@dataclass
class Shape:
    digest: str
    shape: str
    median_ms: float
    default_ms: float | None
    vendor_ms: float | None
    tune_s: float | None = None
    order: tuple = ()

    @property
    def vs_default(self) -> float | None:
        return None if self.default_ms is None else self.default_ms / self.median_ms

    @property
    def vs_vendor(self) -> float | None:
        return None if self.vendor_ms is None else self.vendor_ms / self.median_ms


@dataclass
class Group:
    """The tuned shapes of one kernel on one device class."""

    kernel: str
    arch: str
    sm_count: int
    device_name: str
    shapes: list[Shape]

    @property
    def device(self) -> str:
        return f"{self.arch}:{self.sm_count}"

    @property
    def vendor(self) -> str:
        return vendor_name(self.kernel, self.arch)

    @property
    def plotted(self) -> list[Shape]:
        return self.shapes[:MAX_SHAPES_PER_PLOT]


def _order(kernel: str, problem: dict, shape: str) -> tuple:
    from tunecache.store.floor import work

    w = work(kernel, problem)
    return (str(problem.get("dtype", "")), w[0] if w else math.inf, shape)


def groups_of(configs: Iterable[ConfigRecord]) -> list[Group]:
    by: dict[tuple[str, int, str], list[ConfigRecord]] = defaultdict(list)
    for r in configs:
        by[(r.key.arch, r.key.sm_count, r.key.kernel)].append(r)
    out = []
    for (arch, sms, kernel), recs in sorted(by.items()):
        shapes = []
        for r in recs:
            text = shape_text(r.key.problem)
            shapes.append(
                Shape(r.digest, text, r.median_ms, r.default_ms, r.vendor_ms, order=_order(kernel, r.key.problem, text))
            )
        shapes.sort(key=lambda s: s.order)
        names = [r.device_name for r in recs if r.device_name]
        out.append(Group(kernel, arch, sms, max(set(names), key=names.count) if names else "", shapes))
    return out


def _tune_seconds(store: Store, digests: list[str]) -> dict[str, float]:
    """The tuning time of each digest's winner: its accepted submission's, else the latest one's
    that says (submissions keep the time their tuner reported)."""
    out: dict[str, float] = {}
    for d in digests[:MAX_TUNE_LOOKUPS]:
        subs = [s for s in store.submissions(d, limit=200) if s.tune_seconds is not None]
        won = [s for s in subs if s.accepted]
        if subs:
            out[d] = (won or subs)[-1].tune_seconds  # type: ignore[assignment]
    return out


# ---- the plots (matplotlib, SVG) ------------------------------------------------------------------

_TUNED_VS_DEFAULT = "#3b6fb6"
_TUNED_VS_VENDOR = "#e08a2c"
_TUNE_TIME = "#5a9e6f"
_RC = {
    "svg.fonttype": "none",
    "text.parse_math": False,
    "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans", "Liberation Sans", "Arial"],
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.titlesize": 10,
    "axes.titleweight": "bold",
    "axes.titlelocation": "left",
}
_MARK = re.compile(r'<g id="(tcm-\d+-\d+)">')


def _absent(ax: Any, y: float, text: str) -> None:
    """A grey note at the left of row `y` where a chart has no bar to draw (not measured)."""
    from matplotlib.transforms import blended_transform_factory

    ax.text(
        0.01,
        y,
        text,
        transform=blended_transform_factory(ax.transAxes, ax.transData),
        va="center",
        fontsize=7,
        color="#999",
        style="italic",
    )


def _figure_svg(group: Group, fig_no: int) -> str:
    """One figure per (device class, kernel): the speed-up of the tuned config over the default
    and over the vendor's op per shape (left), and the shape's tuning time (right). Each bar is
    an SVG group with class `mark <series>`, `data-digest` and a <title> (the tooltip)."""
    import matplotlib
    from matplotlib.figure import Figure

    shapes = group.plotted
    n = len(shapes)
    marks: dict[str, tuple[str, str, str]] = {}

    def mark(artist: Any, series: str, s: Shape, title: str) -> None:
        gid = f"tcm-{fig_no}-{len(marks)}"
        artist.set_gid(gid)
        marks[gid] = (series, s.digest, title)

    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(11.5, 0.9 + 0.36 * max(n, 2)), layout="constrained")
        ax, at = fig.subplots(1, 2, sharey=True, width_ratios=[3, 2])
        ys = list(range(n))
        h = 0.38
        # left: tuned vs the default config and vs the vendor (ratio of times; > 1: tuning won)
        tops = [1.0]
        for i, s in enumerate(shapes):
            for dy, ratio, other_ms, series, color, who in (
                (-h / 2, s.vs_default, s.default_ms, "speedup-default", _TUNED_VS_DEFAULT, "the default config"),
                (h / 2, s.vs_vendor, s.vendor_ms, "speedup-vendor", _TUNED_VS_VENDOR, group.vendor),
            ):
                if ratio is None:
                    _absent(ax, i + dy, f"{who}: not measured")
                    continue
                tops.append(ratio)
                (bar,) = ax.barh([i + dy], [ratio], height=h, color=color)
                mark(
                    bar,
                    series,
                    s,
                    f"{s.shape}: tuned {s.median_ms:.4f} ms vs {who} {other_ms:.4f} ms "
                    f"= {ratio:.2f}× ({'faster' if ratio >= 1 else 'slower'})",
                )
                ax.text(ratio, i + dy, f" {ratio:.2f}×", va="center", fontsize=7, color="#333")
        ax.axvline(1.0, color="#555", lw=0.8, ls="--")
        ax.set_xlim(0, max(tops) * 1.18)
        ax.set_title("speed-up of the tuned config (×; dashed: parity)")
        ax.set_yticks(ys, [s.shape for s in shapes], fontfamily="DejaVu Sans Mono", fontsize=8)
        ax.set_ylim(n - 0.5, -0.5)
        ax.grid(axis="x", color="#eee")
        ax.set_axisbelow(True)
        from matplotlib.patches import Patch

        fig.legend(
            handles=[
                Patch(color=_TUNED_VS_DEFAULT, label="tuned vs the default config"),
                Patch(color=_TUNED_VS_VENDOR, label=f"tuned vs {group.vendor}"),
                Patch(color=_TUNE_TIME, label="tuning time"),
            ],
            loc="outside upper right",
            ncols=3,
            fontsize=8,
            frameon=False,
        )
        # right: how long tuning the shape took
        times = [s.tune_s for s in shapes if s.tune_s is not None]
        log = bool(times) and max(times) / max(min(times), 1e-3) > 30
        for i, s in enumerate(shapes):
            if s.tune_s is None:
                _absent(at, i, "not recorded")
                continue
            (bar,) = at.barh([i], [max(s.tune_s, 0.05)], height=0.6, color=_TUNE_TIME)
            mark(bar, "tune-time", s, f"{s.shape}: tuned in {_duration(s.tune_s)}")
            at.text(max(s.tune_s, 0.05), i, f" {_duration(s.tune_s)}", va="center", fontsize=7, color="#333")
        if log:
            at.set_xscale("log")
            at.set_xlim(min(times) / 2, max(times) * 6)
        elif times:
            at.set_xlim(0, max(times) * 1.3)
        at.set_title("tuning time (s)")
        at.grid(axis="x", color="#eee")
        at.set_axisbelow(True)
        at.tick_params(axis="y", left=False)
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg") :]

    def annotate(m: re.Match) -> str:
        series, digest, title = marks[m.group(1)]
        return f'<g id="{m.group(1)}" class="mark {series}" data-digest="{e(digest)}"><title>{e(title)}</title>'

    return _MARK.sub(annotate, svg)


_cache: dict[tuple, tuple[float, str]] = {}
_render_lock = threading.Lock()


def plots_html(store: Store, groups: list[Group]) -> str:
    """The plots section's figures, rendered at most once per PLOT_CACHE_S for the same tuned
    configs (concurrent reloads wait for one render, then share it)."""
    fingerprint = hashlib.sha256(
        json.dumps(
            [
                [g.kernel, g.device, [[s.digest, s.median_ms, s.default_ms, s.vendor_ms] for s in g.plotted]]
                for g in groups
            ]
        ).encode()
    ).hexdigest()
    key = (store.safe_url, fingerprint)

    def fresh() -> str | None:
        hit = _cache.get(key)
        return hit[1] if hit is not None and time.monotonic() - hit[0] < PLOT_CACHE_S else None

    out = fresh()
    if out is not None:
        return out
    with _render_lock:
        out = fresh()
        if out is not None:
            return out
        out = _render(store, groups)
        now = time.monotonic()
        for k in [k for k, (t, _) in _cache.items() if now - t >= PLOT_CACHE_S]:
            del _cache[k]
        _cache[key] = (now, out)
        return out


def _render(store: Store, groups: list[Group]) -> str:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return (
            '<p class="note">The plots need matplotlib, part of the service\'s install '
            '(<code>pip install "tunecache[server]"</code>).</p>'
        )
    times = _tune_seconds(store, [s.digest for g in groups for s in g.plotted])
    parts = []
    for no, g in enumerate(groups):
        for s in g.plotted:
            s.tune_s = times.get(s.digest)
        missing_default = sum(s.default_ms is None for s in g.plotted)
        missing_vendor = sum(s.vendor_ms is None for s in g.plotted)
        notes = []
        if missing_default or missing_vendor:
            notes.append(
                f"not measured in the tuning run: the default config for {missing_default}, "
                f"{g.vendor} for {missing_vendor} of {len(g.plotted)} shape(s)"
            )
        if len(g.shapes) > len(g.plotted):
            notes.append(f"the first {len(g.plotted)} of {len(g.shapes)} shapes (smallest first)")
        name = f" · {g.device_name}" if g.device_name else ""
        parts.append(
            f'<figure class="plot" data-kernel="{e(g.kernel)}" data-device="{e(g.device)}">'
            f"<figcaption><b>{e(g.kernel)}</b> on <b>{e(g.device)}</b>{e(name)} · {len(g.shapes)} shape(s)"
            + "".join(f'<span class="note"> · {e(n)}</span>' for n in notes)
            + f"</figcaption>{_figure_svg(g, no)}</figure>"
        )
    return "\n".join(parts)


# ---- the page ---------------------------------------------------------------------------------------

_CSS = """
:root { --fg: #1d2430; --mut: #6b7480; --line: #dde1e6; --bg2: #f5f7f9; --acc: #3b6fb6 }
* { box-sizing: border-box }
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif; margin: 0; color: var(--fg) }
header { display: flex; align-items: baseline; gap: 1.5em; padding: .9em 2em; border-bottom: 1px solid var(--line);
         background: var(--bg2) }
header h1 { font-size: 20px; margin: 0 } header .mut { color: var(--mut); font-size: 12px }
header form { margin-left: auto } header a { margin-right: 1em }
main { padding: 0 2em 2em; max-width: 1500px }
h2 { font-size: 17px; margin: 1.6em 0 .5em; padding-bottom: .2em; border-bottom: 1px solid var(--line) }
h3 { font-size: 14px; margin: 1.2em 0 .3em }
.cards { display: flex; flex-wrap: wrap; gap: .8em; margin-top: 1.2em }
.card { border: 1px solid var(--line); border-radius: 6px; padding: .5em 1em; min-width: 8.5em }
.card .n { font-size: 24px; font-weight: 600; font-variant-numeric: tabular-nums }
.card .l { color: var(--mut); font-size: 12px }
.card.bad .n { color: #b3261e } .card.good .n { color: #2d7a46 }
.scroll { overflow-x: auto; margin-bottom: 1em }
table { border-collapse: collapse; font-size: 13px }
th, td { padding: 3px 8px; text-align: left; white-space: nowrap; vertical-align: top }
th { font-weight: 600; color: var(--mut); border-bottom: 2px solid var(--line); font-size: 12px }
tr:nth-child(even) td { background: var(--bg2) }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums }
td code, td.mono { font: 12px/1.35 ui-monospace, "DejaVu Sans Mono", monospace }
td.err { white-space: pre-wrap; max-width: 60ch; color: #8a1c14 }
td.cfg code { display: inline-block; max-width: 24ch; overflow: hidden; text-overflow: ellipsis;
              vertical-align: bottom }
.empty { color: var(--mut); font-style: italic }
.note { color: var(--mut); font-size: 12px }
figure.plot { margin: 1em 0 1.6em } figure.plot svg { max-width: 100%; height: auto }
figcaption { margin-bottom: .2em }
.mark:hover path { opacity: .75 }
"""

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>tunecache fleet</title>
<meta http-equiv="refresh" content="10">
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{css}</style></head><body>
<header><h1>tunecache fleet</h1><span class="mut">{db} · database time {now} UTC · refreshes every 10 s</span>
<form method="post" action="/logout"><a href="/docs">API docs</a><a href="/healthz">health</a>
<button type="submit">log out</button></form></header>
<main>
<div class="cards">{cards}</div>
<h2 id="bought">What tuning bought</h2>
<p class="note">Per kernel and device class: how much faster the tuned config runs than the backend's
untuned default config and than the vendor's op (cuBLAS for GEMMs, cuDNN for convolutions, as torch calls
them), both timed in the same tuning run (time of the other ÷ time of the tuned config: above 1, tuning
won), and how long tuning each shape took. Hover a bar for its times.</p>
{summary}
{plots}
<h2 id="queue">Queue</h2>
{queue_note}
<h3>Queued jobs</h3>
{queued}
<h3>Running jobs</h3>
{running}
<h3>Failed jobs</h3>
{failed}
<h2 id="lookups">Lookups</h2>
{lookups}
<h2 id="configs">Tuned configs</h2>
{configs}
</main></body></html>
"""


def _table(
    head: list[str],
    rows: list[list[str]],
    *,
    empty: str,
    numeric: Iterable[int] = (),
    classes: dict[int, str] | None = None,
    cls: str = "",
) -> str:
    """An HTML table; cells are HTML already (escaped by the caller)."""
    if not rows:
        return f'<p class="empty">{e(empty)}</p>'
    numeric = set(numeric)
    classes = dict(classes or {})
    for i in numeric:
        classes[i] = (classes.get(i, "") + " num").strip()

    def c(i: int) -> str:
        return f' class="{classes[i]}"' if i in classes else ""

    num = ' class="num"'
    th = "".join(f"<th{num if i in numeric else ''}>{h}</th>" for i, h in enumerate(head))
    body = "".join("<tr>" + "".join(f"<td{c(i)}>{v}</td>" for i, v in enumerate(r)) + "</tr>" for r in rows)
    return f'<div class="scroll"><table class="{cls}"><tr>{th}</tr>{body}</table></div>'


def _shape_cell(problem: dict, unreadable: str | None = None) -> str:
    if unreadable:
        return f'<span class="empty" title="{e(unreadable)}">unreadable</span>'
    full = shape_text(problem)
    short = _short(full)
    title = f' title="{e(full)}"' if short != full else ""
    return f"<code{title}>{e(short)}</code>"


def _device(arch: str, sm_count: int) -> str:
    return e(f"{arch}:{sm_count}")


def _digest(d: str) -> str:
    return f'<code title="{e(d)}">{e(d[:12])}</code>'


def _when(t: datetime | None) -> str:
    return "" if t is None else e(str(t)[:19])


def _error(text: str | None) -> str:
    """The last lines of an error (a traceback ends with what went wrong), the whole tail on hover."""
    lines = [ln.rstrip() for ln in (text or "").strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    tail = "\n".join(lines[-ERROR_LINES:])
    cut = len(lines) > ERROR_LINES or len(tail) > ERROR_TAIL
    tail = tail[-ERROR_TAIL:]
    return f'<span title="{e(text[-4000:])}">{"…" if cut else ""}{e(tail)}</span>'


def _job_cells(j: JobRecord, now: datetime, fifth: str) -> list[str]:
    """The cells every job table starts with: the key (digest, kernel, device, shape), the
    table's own fifth cell, then attempts and age."""
    return [
        _digest(j.digest),
        e(j.key.kernel),
        _device(j.key.arch, j.key.sm_count),
        _shape_cell(j.key.problem, j.unreadable),
        fifth,
        f"{j.attempts}/{j.max_attempts}",
        e(age(_secs(j.created_at, now))),
    ]


def _queue_tables(store: Store, now: datetime, counts: dict[str, int]) -> dict[str, str]:
    def more(status: str, shown: int) -> str:
        n = counts.get(status, 0)
        return f'<p class="note">the oldest {shown} of {n}</p>' if n > shown else ""

    queued = store.list_jobs(status="queued", limit=MAX_JOBS)
    rows = []
    for j in queued:
        wait = _secs(j.not_before, now)
        rows.append(
            [
                *_job_cells(j, now, str(j.priority)),
                _when(j.not_before),
                "ready" if wait is None or wait >= 0 else e(age(wait)) + " (backoff)",
                _error(j.last_error),
            ]
        )
    out = {
        "queued": _table(
            [
                "digest",
                "kernel",
                "device",
                "shape",
                "priority",
                "attempts",
                "age",
                "not before (UTC)",
                "claimable",
                "last error",
            ],
            rows,
            empty="No job is queued.",
            numeric=(4, 5, 6),
            classes={9: "err"},
        )
        + more("queued", len(queued))
    }
    running = store.list_jobs(status="running", limit=MAX_JOBS)
    rows = []
    for j in running:
        left = _secs(j.lease_expires_at, now)
        lease = "" if left is None else (f"lapsed {age(left)} ago" if left >= 0 else age(left))
        rows.append(
            [
                *_job_cells(j, now, e(j.lease_owner or "")),
                _when(j.lease_expires_at),
                e(lease),
            ]
        )
    out["running"] = _table(
        ["digest", "kernel", "device", "shape", "worker", "attempt", "age", "lease until (UTC)", "lease"],
        rows,
        empty="No job is running.",
        numeric=(5, 6),
    ) + more("running", len(running))
    failed: list[JobRecord] = store.list_jobs(status="failed", limit=MAX_JOBS)
    failed += store.list_jobs(status="quarantined", limit=MAX_JOBS)
    rows = [[*_job_cells(j, now, e(j.status)), _error(j.last_error)] for j in failed]
    out["failed"] = _table(
        ["digest", "kernel", "device", "shape", "status", "attempts", "age", "last error (tail)"],
        rows,
        empty="No job has failed.",
        numeric=(5, 6),
        classes={7: "err"},
    ) + more("failed", sum(j.status == "failed" for j in failed))
    return out


def _metric(metrics: Any, name: str, labels: dict | None = None) -> float:
    if metrics is None:
        return 0.0
    return metrics.registry.get_sample_value(name, labels or {}) or 0.0


def lookup_stats(metrics: Any) -> dict[str, float | None]:
    hits = _metric(metrics, "tunecache_lookup_hits_total")
    misses = _metric(metrics, "tunecache_lookup_misses_total")
    n = hits + misses
    return {
        "hits": hits,
        "misses": misses,
        "lookups": n,
        "hit_rate": hits / n if n else None,
        "miss_rate": misses / n if n else None,
    }


def _lookups(metrics: Any) -> str:
    st = lookup_stats(metrics)

    def pct(v):
        return "–" if v is None else f"{100 * v:.1f}%"

    rows = [
        ["lookups", f"{st['lookups']:.0f}", ""],
        ["hits", f"{st['hits']:.0f}", pct(st["hit_rate"])],
        ["misses", f"{st['misses']:.0f}", pct(st["miss_rate"])],
    ]
    if metrics is not None:
        for fam in metrics.registry.collect():
            if fam.name in ("tunecache_publishes", "tunecache_job_events"):
                for s in fam.samples:
                    if s.name.endswith("_total"):
                        what = "published" if fam.name == "tunecache_publishes" else "job events"
                        rows.append([e(f"{what}: {next(iter(s.labels.values()), '')}"), f"{s.value:.0f}", ""])
        count = _metric(metrics, "tunecache_tune_seconds_count")
        if count:
            rows.append(
                [
                    "mean tuning time of a job",
                    _duration(_metric(metrics, "tunecache_tune_seconds_sum") / count),
                    f"{count:.0f} jobs",
                ]
            )
    return (
        _table(["", "count", "rate"], rows, empty="", numeric=(1, 2))
        + '<p class="note">Since this service process started (<code>/metrics</code> has them for '
        "Prometheus; with several processes, each counts its own).</p>"
    )


def _summary(groups: list[Group]) -> str:
    rows = []
    for g in groups:
        d = [s.vs_default for s in g.shapes if s.vs_default is not None]
        v = [s.vs_vendor for s in g.shapes if s.vs_vendor is not None]
        rows.append(
            [
                e(g.kernel),
                _device(g.arch, g.sm_count),
                e(g.device_name),
                str(len(g.shapes)),
                _x(_geomean(d)),
                _x(min(d) if d else None),
                _x(max(d) if d else None),
                f"{len(d)}/{len(g.shapes)}",
                e(g.vendor),
                _x(_geomean(v)),
                f"{sum(x >= 1 for x in v)}/{len(v)}" if v else "–",
            ]
        )
    return _table(
        [
            "kernel",
            "device",
            "name",
            "shapes",
            "vs default (geomean)",
            "worst",
            "best",
            "measured",
            "vendor",
            "vs vendor (geomean)",
            "shapes at or past the vendor",
        ],
        rows,
        empty="Nothing is tuned yet.",
        numeric=(3, 4, 5, 6, 7, 9, 10),
    )


def _config_cell(config: dict, text: str) -> str:
    if is_vendor(config):  # torch's own op (cuBLAS / cuDNN) won the tune
        return f'<code title="{e(text)}">vendor (cuBLAS / cuDNN)</code>'
    return f'<code title="{e(text)}">{e(text)}</code>'


def _configs(configs: list[ConfigRecord], total: int) -> str:
    rows = []
    for r in configs[:MAX_CONFIG_ROWS]:
        cfg = json.dumps(r.config, separators=(",", ":"))
        vs_d = None if r.default_ms is None else r.default_ms / r.median_ms
        vs_v = None if r.vendor_ms is None else r.vendor_ms / r.median_ms
        rows.append(
            [
                _digest(r.digest),
                e(r.key.kernel),
                _device(r.key.arch, r.key.sm_count),
                _shape_cell(r.key.problem),
                _ms(r.median_ms),
                _ms(r.default_ms),
                _ms(r.vendor_ms),
                _x(vs_d),
                _x(vs_v),
                "–" if r.tflops is None else f"{r.tflops:.1f}",
                str(r.candidates),
                e(r.source),
                _when(r.tuned_at)[:16],
                _config_cell(r.config, cfg),
            ]
        )
    note = f'<p class="note">the first {len(rows)} of {total}</p>' if total > len(rows) else ""
    return (
        _table(
            [
                "digest",
                "kernel",
                "device",
                "shape",
                "ms",
                "default ms",
                "vendor ms",
                "vs default",
                "vs vendor",
                "TFLOP/s",
                "configs",
                "source",
                "tuned (UTC)",
                "config",
            ],
            rows,
            empty="Nothing is tuned yet.",
            numeric=(4, 5, 6, 7, 8, 9, 10),
            classes={13: "cfg"},
        )
        + note
    )


def render_page(store: Store, metrics: Any = None) -> str:
    """The dashboard's HTML."""
    try:
        now = store.db_now()
    except Exception:  # noqa: BLE001 - a clock is not worth a failed page
        now = utcnow()
    counts = store.counts()
    jobs = store.job_counts()
    configs = store.list_configs(limit=MAX_CONFIGS)
    groups = groups_of(configs)
    st = lookup_stats(metrics)
    rate = "–" if st["hit_rate"] is None else f"{100 * st['hit_rate']:.0f}%"
    cards = "".join(
        f'<div class="card{" " + k if k else ""}"><div class="n">{e(str(n))}</div><div class="l">{e(label)}</div></div>'
        for label, n, k in (
            ("tuned configs", counts.get("tuned_configs", 0), ""),
            ("queued", jobs["queued"], ""),
            ("running", jobs["running"], ""),
            ("done", jobs["done"], ""),
            ("failed", jobs["failed"], "bad" if jobs["failed"] else ""),
            ("quarantined", jobs["quarantined"], "bad" if jobs["quarantined"] else ""),
            ("lookup hit rate", rate, ""),
            ("lookups", f"{st['lookups']:.0f}", ""),
        )
    )
    total = counts.get("tuned_configs", len(configs))
    queue_note = ""
    if jobs["queued"] or jobs["running"]:
        queue_note = (
            '<p class="note">Ages count from when the job was queued; a running job whose lease '
            "lapses goes back to the queue (or fails on its last attempt).</p>"
        )
    return _PAGE.format(
        css=_CSS,
        db=e(store.dialect),
        now=e(str(now)[:19]),
        cards=cards,
        summary=_summary(groups),
        plots=plots_html(store, groups) if groups else "",
        queue_note=queue_note,
        **_queue_tables(store, now, jobs),
        lookups=_lookups(metrics),
        configs=_configs(configs, total),
    )
