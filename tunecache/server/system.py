"""/healthz, /metrics and the dashboard page."""

from __future__ import annotations

import html
import json

from fastapi import APIRouter, HTTPException
from fastapi.responses import HTMLResponse, Response
from sqlalchemy.exc import SQLAlchemyError

from .deps import MetricsDep, StoreDep
from .schemas import ErrorOut, HealthOut

router = APIRouter(tags=["system"])


@router.get("/healthz", response_model=HealthOut, summary="Liveness and database reachability",
            responses={503: {"model": ErrorOut, "description": "the database is unreachable"}})
def healthz(store: StoreDep) -> HealthOut:
    from ..migrate import current_revision

    try:
        rev = current_revision(store.engine)
    except SQLAlchemyError as e:
        raise HTTPException(503, f"database unreachable: {type(e).__name__}") from None
    return HealthOut(status="ok", database=store.dialect, schema_revision=rev)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
def metrics(store: StoreDep, m: MetricsDep) -> Response:
    return Response(m.render(store), media_type="text/plain; version=0.0.4; charset=utf-8")


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>tunecache fleet</title>
<meta http-equiv="refresh" content="10">
<style>
 body {{ font: 14px system-ui, sans-serif; margin: 2em; color: #222 }}
 table {{ border-collapse: collapse; margin-bottom: 2em }} td, th {{ border: 1px solid #ccc; padding: 3px 8px }}
 th {{ background: #f3f3f3; text-align: left }} code {{ font-size: 12px }}
 .n {{ font-size: 28px; font-weight: 600 }} .card {{ display: inline-block; margin-right: 2em }}
</style></head><body>
<h1>tunecache fleet</h1>
<div>{cards}</div>
<h2>Running jobs</h2>
<table><tr><th>kernel</th><th>device</th><th>problem</th><th>owner</th><th>attempt</th><th>lease until</th></tr>{running}</table>
<h2>Failed jobs</h2>
<table><tr><th>kernel</th><th>device</th><th>problem</th><th>attempts</th><th>last error</th></tr>{failed}</table>
<h2>Tuned configs (first {n_configs})</h2>
<table><tr><th>digest</th><th>kernel</th><th>device</th><th>problem</th><th>config</th><th>ms</th><th>TFLOP/s</th><th>source</th></tr>{configs}</table>
<p><a href="/docs">API docs</a> · <a href="/metrics">metrics</a> · <a href="/healthz">health</a></p>
</body></html>
"""


def _problem(p: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in p.items() if not str(k).startswith("gemm_"))


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
def dashboard(store: StoreDep) -> HTMLResponse:
    e = html.escape
    counts = store.counts()
    jobs = store.job_counts()
    cards = "".join(f'<div class="card"><div class="n">{n}</div>{e(label)}</div>' for label, n in (
        ("tuned configs", counts.get("tuned_configs", 0)), ("queued", jobs["queued"]),
        ("running", jobs["running"]), ("done", jobs["done"]), ("failed", jobs["failed"])))
    running = "".join(
        f"<tr><td>{e(j.key.kernel)}</td><td>{e(str(j.key.device_class))}</td><td>{e(_problem(j.key.problem))}</td>"
        f"<td>{e(j.lease_owner or '')}</td><td>{j.attempts}/{j.max_attempts}</td><td>{j.lease_expires_at}</td></tr>"
        for j in store.list_jobs(status="running", limit=100))
    failed = "".join(
        f"<tr><td>{e(j.key.kernel)}</td><td>{e(str(j.key.device_class))}</td><td>{e(_problem(j.key.problem))}</td>"
        f"<td>{j.attempts}</td><td><code>{e((j.last_error or '')[-300:])}</code></td></tr>"
        for j in store.list_jobs(status="failed", limit=100))
    configs = store.list_configs(limit=200)
    rows = "".join(
        f"<tr><td><code>{r.digest[:12]}</code></td><td>{e(r.key.kernel)}</td><td>{e(str(r.key.device_class))}</td>"
        f"<td>{e(_problem(r.key.problem))}</td><td><code>{e(json.dumps(r.config, separators=(',', ':')))}</code></td>"
        f"<td>{r.median_ms:.4f}</td><td>{'' if r.tflops is None else f'{r.tflops:.1f}'}</td><td>{e(r.source)}</td></tr>"
        for r in configs)
    return HTMLResponse(_PAGE.format(cards=cards, running=running, failed=failed, configs=rows,
                                     n_configs=len(configs)))
