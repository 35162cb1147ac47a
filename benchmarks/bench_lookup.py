"""Load on the service's lookup endpoint over loopback: requests/s and latency percentiles.

Starts `tunecache serve` (uvicorn) over a fresh Postgres database, publishes `--configs`
results, then drives GET /v1/configs/{digest} with a load generator over plain asyncio streams
(or httpx, or wrk) at fixed concurrencies for `--seconds` each: mostly hits, a share of misses
(`--miss-rate`). The load is spread over `--tokens` read tokens, as a fleet's hosts would send
it, so the service runs at its default settings, rate limits included (they count per token
and address).

    python benchmarks/bench_lookup.py --load-generator wrk [--concurrency 1 8 32 64]
        [--seconds 15] [--server-workers 1] [--out PATH]

With `--publishers N` (e.g. 3; 0 by default) each concurrency runs twice: quiet, then with N
client processes publishing 2,000-trial results (about 900 KB each, the cap) back to back beside the
readers, as training hosts with publish tokens do (spread over `--publish-tokens` tokens, so
that the byte quota per token does not stop them). Readers are spread over `--addresses`
loopback addresses (127.0.0.1, .2, ...): 1,000 connections from one address would pass the
service's cap per address, and a fleet's lookups come from many hosts.

    python benchmarks/bench_lookup.py --concurrency 100 1000 --publishers 3

The JSON's `summary`: `lookups_per_s_quiet`, `lookups_per_s_under_publish`, `errors` (lookups
not answered 200/404, under publish), `p50_ms` and `p99_ms` (quiet and under publish), each
per concurrency, `kept` (under publish / quiet, the worst concurrency) and `publishes`; with
`--publishers 0`, `req_per_s` and `p99_ms` at the highest concurrency whose p99 stays under
10 ms, with that `concurrency`.

The load generator runs on the same host as the service and Postgres: on a small machine
they share the cores, so the figures are a floor for a dedicated service host. JSON goes to
benchmarks/results/bench_lookup.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, serve  # noqa: E402


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    i = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[i]


class _ClosedLoop:
    """What the two Python load generators share: users that each send the next lookup as soon
    as the last is answered (a miss at `miss_rate`, else a hit, under a random token) for
    `seconds` after `warmup_s` (from `run`); only requests started after the warm-up are counted."""

    def __init__(
        self,
        tokens: list[str],
        digests: list[str],
        misses: list[str],
        miss_rate: float,
        seconds: float,
        warmup_s: float,
    ) -> None:
        self.tokens, self.digests, self.misses, self.miss_rate = tokens, digests, misses, miss_rate
        self.rng = random.Random(0)
        self.latencies: list[float] = []
        self.status: dict[int, int] = {}
        self.kinds: dict[str, int] = {}
        self.errors = 0
        self.seconds, self.warmup_s = seconds, warmup_s
        self.t_measure = self.t_end = 0.0

    def requests(self):
        """(digest, token) of a user's next lookup, while the run lasts."""
        while time.perf_counter() < self.t_end:
            rng = self.rng
            d = rng.choice(self.misses) if rng.random() < self.miss_rate else rng.choice(self.digests)
            yield d, rng.choice(self.tokens)

    def client_error(self, e: BaseException, when: str = "") -> int:
        """The client failed the request (no status): counted by the error's type (and `when`:
        opening the connection or awaiting the answer)."""
        kind = f"{type(e).__name__}{f' ({when})' if when else ''}"
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        return -1

    def answered(self, t0: float, code: int) -> None:
        """A request started at `t0` is over, with status `code` (-1: the client's error)."""
        t1 = time.perf_counter()
        if t0 >= self.t_measure:
            if code in (200, 404):
                self.latencies.append(t1 - t0)
            else:
                self.errors += 1
            self.status[code] = self.status.get(code, 0) + 1

    async def run(self, users) -> dict:
        """Runs the users to the end; the figures: requests, errors, status counts, throughput and
        latency percentiles."""
        self.t_measure = time.perf_counter() + self.warmup_s
        self.t_end = self.t_measure + self.seconds
        await asyncio.gather(*users)
        elapsed = time.perf_counter() - self.t_measure
        latencies = sorted(self.latencies)
        ms = [x * 1e3 for x in latencies]
        return {
            "requests": len(latencies) + self.errors,
            "ok": len(latencies),
            "errors": self.errors,
            "status_counts": {str(k): v for k, v in sorted(self.status.items())},
            "client_errors": self.kinds,
            "seconds": round(elapsed, 3),
            "requests_per_s": round(len(latencies) / elapsed, 1),
            "latency_ms": {
                "p50": round(_percentile(ms, 50), 3),
                "p90": round(_percentile(ms, 90), 3),
                "p99": round(_percentile(ms, 99), 3),
                "max": round(ms[-1], 3) if ms else None,
                "mean": round(statistics.fmean(ms), 3) if ms else None,
            },
        }


async def _load(url: str, loop: _ClosedLoop, concurrency: int, addresses: int = 1) -> dict:
    """The closed loop through httpx clients, one per loopback address."""
    n = max(1, min(addresses, concurrency))
    per = -(-concurrency // n)
    limits = httpx.Limits(max_connections=per, max_keepalive_connections=per)
    auth = {t: {"Authorization": f"Bearer {t}"} for t in loop.tokens}
    clients = [
        httpx.AsyncClient(
            base_url=url,
            limits=limits,
            timeout=10,
            transport=httpx.AsyncHTTPTransport(limits=limits, local_address=f"127.0.0.{i + 1}"),
        )
        for i in range(n)
    ]

    async def one_user(client: httpx.AsyncClient) -> None:
        for d, token in loop.requests():
            t0 = time.perf_counter()
            try:
                code = (await client.get(f"/v1/configs/{d}", headers=auth[token])).status_code
            except httpx.HTTPError as e:  # client side: e.g. a keep-alive connection the server just closed
                code = loop.client_error(e)
            loop.answered(t0, code)

    try:
        return await loop.run(one_user(clients[i % n]) for i in range(concurrency))
    finally:
        for c in clients:
            await c.aclose()


async def _raw_load(url: str, loop: _ClosedLoop, concurrency: int, addresses: int = 1) -> dict:
    """The same closed loop as `_load`, over plain asyncio streams: one keep-alive connection
    per user (from one of `addresses` loopback addresses), a request written and its answer
    read by hand. httpx's pool costs far more CPU than the service at 1,000 in flight; this
    costs little more than the sockets."""
    host, port = url.removeprefix("http://").split(":")

    async def one_user(i: int) -> None:
        reader = writer = None
        for d, token in loop.requests():
            request = f"GET /v1/configs/{d} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n\r\n".encode()
            t0 = time.perf_counter()
            try:
                if writer is None:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(host, int(port), local_addr=(f"127.0.0.{i % addresses + 1}", 0)), 10
                    )
                writer.write(request)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                code = int(head[9:12])
                length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
                await asyncio.wait_for(reader.readexactly(length), 10)
                if b"connection: close" in head.lower():
                    writer.close()
                    writer = None
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, AttributeError) as e:
                code = loop.client_error(e, "answer" if writer is not None else "connect")
                if writer is not None:
                    writer.close()
                writer = None
            loop.answered(t0, code)
        if writer is not None:
            writer.close()

    return await loop.run(one_user(i) for i in range(concurrency))


def _wrk(
    url: str,
    tokens: list[str],
    digests: list[str],
    misses: list[str],
    miss_rate: float,
    concurrency: int,
    seconds: float,
    tmp: Path,
) -> dict:
    """The same mix of hits and misses, driven by wrk (C, epoll): the load generator then
    costs the shared cores far less than the Python one."""
    n_miss = int(len(digests) * miss_rate / max(1e-9, 1 - miss_rate))
    paths = [f"/v1/configs/{d}" for d in digests] + [f"/v1/configs/{d}" for d in misses[:n_miss]]
    script = tmp / "lookup.lua"
    script.write_text(
        "paths = {" + ",".join(f'"{p}"' for p in paths) + "}\n"
        "tokens = {" + ",".join(f'"Bearer {t}"' for t in tokens) + "}\n"
        "request = function() return wrk.format('GET', paths[math.random(#paths)], "
        "{Authorization = tokens[math.random(#tokens)]}) end\n" + _WRK_STATUS
    )
    threads = max(1, min(2, concurrency))
    out = subprocess.run(
        # a request unanswered in 10 s is an error, as for the other load generators (wrk's own bound: 2 s)
        ["wrk", f"-t{threads}", f"-c{concurrency}", f"-d{int(seconds)}s", "--timeout", "10s", "--latency"]
        + ["-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    units = {"us": 1e-3, "ms": 1.0, "s": 1e3}

    def ms(text: str) -> float:
        for unit in ("us", "ms", "s"):
            if text.endswith(unit):
                return float(text[: -len(unit)]) * units[unit]
        return float(text)

    lat = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in ("50%", "75%", "90%", "99%"):
            lat["p" + parts[0].rstrip("%")] = ms(parts[1])
    rps = float(next(ln.split()[1] for ln in out.splitlines() if ln.startswith("Requests/sec")))
    non2xx = next((int(ln.split()[-1]) for ln in out.splitlines() if "Non-2xx" in ln), 0)
    counts = dict(kv.split("=") for kv in next(ln for ln in out.splitlines() if ln.startswith("STATUS")).split()[1:])
    socket_errors = next((ln for ln in out.splitlines() if "Socket errors" in ln), "")
    errors = int(counts["other"]) + sum(int(x) for x in re.findall(r"\d+", socket_errors))
    return {
        "requests_per_s": rps,
        "latency_ms": lat,
        "non_2xx": non2xx,
        "status_counts": {"200": int(counts["ok"]), "404": int(counts["notfound"]), "other": int(counts["other"])},
        "errors": errors,
        "raw": out,
    }


# counts answers by status across wrk's threads: 404s are the misses asked for, anything else
# (a 429 of the rate limit, a 5xx) is an error
_WRK_STATUS = """
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) ok = 0; notfound = 0; other = 0 end
function response(status, headers, body)
  if status == 200 then ok = ok + 1 elseif status == 404 then notfound = notfound + 1 else other = other + 1 end
end
function done(summary, latency, requests)
  local o, n, x = 0, 0, 0
  for _, t in ipairs(threads) do o = o + t:get("ok"); n = n + t:get("notfound"); x = x + t:get("other") end
  io.write(string.format("STATUS ok=%d notfound=%d other=%d\\n", o, n, x))
end
"""


def _publish_body(rng: random.Random, trials: int) -> dict:
    """A result of a key of its own with `trials` trials, about 450 bytes each (2,000: ~900 KB,
    half of them failures with their errors)."""
    config = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    problem = {"M": rng.randrange(1, 8192), "N": 4096, "K": 4096, "dtype": "bfloat16"}  # 5 ms: above the floor
    problem.update(a_layout="row", b_layout="row")
    return {
        "kernel": "matmul.portable",
        "kernel_version": "bench",
        "triton_version": "3.9.0",
        "arch": "sm_90",
        "sm_count": 132,
        "problem": problem,
        "config": config,
        "median_ms": 5.0,
        "trials": [
            {"config": config, "status": "failed", "error": "out of resources: shared memory " + "x" * 620}
            if i % 2 == 0
            else {"config": config, "status": "ok", "median_ms": 5.0 + i * 1e-3}
            for i in range(trials)
        ],
    }


def _publisher(url: str, tokens: list[str], trials: int, until: float, seed: int, out) -> None:
    """One client publishing results back to back until `until` (time.time()); sends
    (publishes answered 200, others, seconds per publish) to `out`."""
    rng = random.Random(seed)
    done = failed = 0
    took: list[float] = []
    with httpx.Client(base_url=url, timeout=60) as client:
        while time.time() < until:
            body = json.dumps(_publish_body(rng, trials)).encode()
            t0 = time.perf_counter()
            try:
                r = client.post(
                    "/v1/configs",
                    content=body,
                    headers={"Authorization": f"Bearer {rng.choice(tokens)}", "Content-Type": "application/json"},
                )
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            took.append(time.perf_counter() - t0)
            done += ok
            failed += not ok
    out.put((done, failed, took))


class Publishers:
    """`n` processes publishing beside the readers for `seconds` (from now)."""

    def __init__(self, url: str, tokens: list[str], n: int, trials: int, seconds: float) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.queue = ctx.Queue()
        until = time.time() + seconds
        self.procs = [
            ctx.Process(target=_publisher, args=(url, tokens, trials, until, i, self.queue), daemon=True)
            for i in range(n)
        ]
        for p in self.procs:
            p.start()

    def results(self) -> dict:
        got = [self.queue.get(timeout=120) for _ in self.procs]
        for p in self.procs:
            p.join(10)
        took = sorted(t for _, _, ts in got for t in ts)
        return {
            "publishes": sum(d for d, _, _ in got),
            "publish_errors": sum(f for _, f, _ in got),
            "publish_s_p50": round(_percentile(took, 50), 3) if took else None,
            "publish_s_max": round(took[-1], 3) if took else None,
        }


def _version_or_none(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--pg",
        default=os.environ.get("TUNECACHE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
        help="a Postgres URL; a fresh database is created next to it and dropped after",
    )
    ap.add_argument("--configs", type=int, default=1000, help="published results to look up")
    ap.add_argument("--miss-rate", type=float, default=0.1, help="share of lookups for unknown digests")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64], help="in-flight requests")
    ap.add_argument(
        "--tokens", type=int, default=200, help="read tokens the load is spread over (the rate limit is per token)"
    )
    ap.add_argument("--seconds", type=float, default=15.0, help="measured seconds per concurrency")
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--server-workers", type=int, default=1, help="uvicorn worker processes")
    ap.add_argument(
        "--load-generator",
        choices=["raw", "httpx", "wrk"],
        default="raw",
        help="wrk (if installed: apt-get install wrk) loads the shared cores far less, but connects from one "
        "address: past 256 connections (TUNECACHE_CONNECTIONS_PER_ADDRESS) and its rate limit it counts refusals",
    )
    ap.add_argument("--publishers", type=int, default=0, help="processes publishing beside the readers (0: none)")
    ap.add_argument("--publish-trials", type=int, default=2000, help="trials per published result")
    ap.add_argument("--publish-tokens", type=int, default=30, help="publish tokens the publishers rotate over")
    ap.add_argument("--addresses", type=int, default=8, help="loopback addresses the readers connect from")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_lookup.json")
    args = ap.parse_args()

    import psycopg
    from sqlalchemy.engine import make_url

    from tunecache.key import TuneKey
    from tunecache.store import ConfigRecord, Store

    base = make_url(args.pg)
    dbname = f"tc_bench_{uuid.uuid4().hex[:8]}"
    admin = psycopg.connect(
        host=base.host,
        port=base.port or 5432,
        user=base.username,
        dbname=base.database,
        password=base.password,
        autocommit=True,
    )
    admin.execute(f'CREATE DATABASE "{dbname}"')
    url = base.set(database=dbname).render_as_string(hide_password=False)
    server = None
    try:
        store = Store(url)
        tokens = [store.create_token(f"bench-{i}", ["read"])[0] for i in range(args.tokens)]
        publish_tokens = [store.create_token(f"bench-publish-{i}", ["publish"])[0] for i in range(args.publish_tokens)]
        config = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
        digests = []
        for i in range(args.configs):
            key = TuneKey(
                "matmul.portable",
                "bench",
                "3.9.0",
                "sm_90",
                132,
                {"M": 128 + i, "N": 4096, "K": 4096, "dtype": "bfloat16", "a_layout": "row", "b_layout": "row"},
            )
            store.put_config(ConfigRecord(key=key, config=config, median_ms=1.0 + i * 1e-3, source="import"))
            digests.append(key.digest)
        store.close()
        misses = [uuid.uuid4().hex + uuid.uuid4().hex for _ in range(1000)]

        server, service = serve(url, "--workers", str(args.server_workers))

        def measure(c: int) -> dict:
            if args.load_generator == "wrk":
                import tempfile

                return _wrk(service, tokens, digests, misses, args.miss_rate, c, args.seconds, Path(tempfile.mkdtemp()))
            load = _raw_load if args.load_generator == "raw" else _load
            loop = _ClosedLoop(tokens, digests, misses, args.miss_rate, args.seconds, args.warmup)
            run = load(service, loop, c, args.addresses)
            try:
                import uvloop

                return uvloop.run(run)
            except ImportError:
                return asyncio.run(run)

        runs = []
        for c in args.concurrency:
            for publishers in (0, args.publishers) if args.publishers else (0,):
                pub = None
                if publishers:
                    pub = Publishers(
                        service, publish_tokens, publishers, args.publish_trials, args.warmup + args.seconds
                    )
                    time.sleep(1.0)  # the publishers' processes start (spawn) before the readers
                res = measure(c)
                if pub is not None:
                    res.update(pub.results())
                res["concurrency"], res["publishers"] = c, publishers
                runs.append(res)
                lat = res["latency_ms"]
                print(
                    f"concurrency {c:4d}, {publishers} publishing: {res['requests_per_s']:8.1f} req/s   "
                    f"p50 {lat['p50']:.2f} ms   p90 {lat['p90']:.2f} ms   p99 {lat['p99']:.2f} ms   "
                    f"errors {res['errors']}"
                    + (f"   publishes {res['publishes']} (p50 {res['publish_s_p50']} s)" if pub else "")
                )
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(15)
            except subprocess.TimeoutExpired:
                server.kill()
        admin.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        admin.close()

    from importlib.metadata import version

    if args.publishers:
        summary = _publish_summary(runs, args)
    else:
        under = [r for r in runs if r["latency_ms"].get("p99", float("inf")) < 10 and not r["errors"]]
        best_run = max(under, key=lambda r: r["requests_per_s"], default=None)
        summary = {
            "req_per_s": None if best_run is None else best_run["requests_per_s"],
            "p99_ms": None if best_run is None else best_run["latency_ms"]["p99"],
            "concurrency": None if best_run is None else best_run["concurrency"],
            "server_workers": args.server_workers,
        }
    print(f"summary: {summary}")
    out = {
        "summary": summary,
        "benchmark": "lookup endpoint GET /v1/configs/{digest}, loopback",
        "load_generator": {
            "wrk": "wrk, closed loop, keep-alive",
            "httpx": "httpx.AsyncClient, closed loop, keep-alive, one process",
            "raw": "asyncio streams (uvloop), closed loop, one keep-alive connection per user, one process",
        }[args.load_generator],
        "configs": args.configs,
        "publishers": args.publishers,
        "publish_trials": args.publish_trials,
        "addresses": args.addresses,
        "miss_rate": args.miss_rate,
        "tokens": args.tokens,
        "server_workers": args.server_workers,
        "runs": runs,
        "host": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "fastapi": version("fastapi"),
            "uvicorn": version("uvicorn"),
            "httpx": version("httpx"),
            "uvloop": _version_or_none("uvloop"),
            "httptools": _version_or_none("httptools"),
        },
        "note": "service, Postgres and load generator share the host's cores",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


def _publish_summary(runs: list[dict], args) -> dict:
    """Quiet against under-publish lookups, per concurrency (keys are the concurrencies)."""
    quiet = {r["concurrency"]: r for r in runs if not r["publishers"]}
    busy = {r["concurrency"]: r for r in runs if r["publishers"]}
    cs = [c for c in quiet if c in busy]
    kept = {
        c: round(busy[c]["requests_per_s"] / quiet[c]["requests_per_s"], 3) for c in cs if quiet[c]["requests_per_s"]
    }
    return {
        "lookups_per_s_quiet": {str(c): quiet[c]["requests_per_s"] for c in cs},
        "lookups_per_s_under_publish": {str(c): busy[c]["requests_per_s"] for c in cs},
        "errors": {str(c): busy[c]["errors"] + quiet[c]["errors"] for c in cs},
        "p50_ms": {
            "quiet": {str(c): quiet[c]["latency_ms"]["p50"] for c in cs},
            "under_publish": {str(c): busy[c]["latency_ms"]["p50"] for c in cs},
        },
        "p99_ms": {
            "quiet": {str(c): quiet[c]["latency_ms"]["p99"] for c in cs},
            "under_publish": {str(c): busy[c]["latency_ms"]["p99"] for c in cs},
        },
        "kept": min(kept.values(), default=None),
        "publishes": {str(c): busy[c].get("publishes") for c in cs},
        "publishers": args.publishers,
        "server_workers": args.server_workers,
    }


if __name__ == "__main__":
    main()
