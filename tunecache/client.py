"""The library's side of the fleet: an HTTP client that never fails the user's call.

Every call has a short timeout and goes through a circuit breaker: after `failures`
consecutive failures (connection refused, timeout, 5xx, a body that is not what the API
promises) the breaker opens for `open_s` seconds, and calls return None at once, paying no
timeout. Then one call is let through; success closes the breaker, failure re-opens it.
The launcher treats None as "the fleet had nothing": local store, then the miss policy.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import httpx

from . import settings
from .key import DeviceClass, TuneKey
from .store import ConfigRecord, TrialRecord

log = logging.getLogger("tunecache.client")

API = "/v1"


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


class Unavailable(Exception):
    """The service could not be reached or answered something unusable."""


class CircuitBreaker:
    """Closed -> (N consecutive failures) -> open for T s -> half-open (one trial call)."""

    def __init__(self, failures: int = 3, open_s: float = 30.0) -> None:
        self.failures, self.open_s = failures, open_s
        self._count = 0
        self._open_until = 0.0
        self._trial = False
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        return time.monotonic() < self._open_until

    def allow(self) -> bool:
        with self._lock:
            if self._count < self.failures:
                return True
            if time.monotonic() < self._open_until or self._trial:
                return False
            self._trial = True  # half-open: this caller probes, the others keep skipping
            return True

    def success(self) -> None:
        with self._lock:
            self._count, self._open_until, self._trial = 0, 0.0, False

    def failure(self) -> None:
        with self._lock:
            self._count += 1
            self._trial = False
            if self._count >= self.failures:
                self._open_until = time.monotonic() + self.open_s


@dataclass
class ClaimedJob:
    """A job leased from the service."""

    id: int
    key: TuneKey
    attempts: int
    max_attempts: int

    @property
    def digest(self) -> str:
        return self.key.digest


class FleetClient:
    """lookup / publish / enqueue for the launcher, and the worker's queue calls."""

    def __init__(self, url: str, token: str | None = None, *, timeout_s: float | None = None,
                 connect_timeout_s: float | None = None, failures: int | None = None,
                 open_s: float | None = None) -> None:
        self.url = url.rstrip("/")
        self.token = token
        read = timeout_s if timeout_s is not None else _env_float("TUNECACHE_SERVER_TIMEOUT_S", 2.0)
        connect = connect_timeout_s if connect_timeout_s is not None else min(read, 1.0)
        self.breaker = CircuitBreaker(
            failures if failures is not None else int(_env_float("TUNECACHE_BREAKER_FAILURES", 3)),
            open_s if open_s is not None else _env_float("TUNECACHE_BREAKER_OPEN_S", 30.0))
        headers = {"User-Agent": "tunecache-client"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(base_url=self.url, headers=headers, trust_env=False,
                                  timeout=httpx.Timeout(read, connect=connect, pool=connect))
        self._warned: set[tuple[int, str]] = set()

    def close(self) -> None:
        self._http.close()

    # ---- transport ----------------------------------------------------------------------

    def _call(self, method: str, path: str, parse: Callable[[Any], Any], json: Any = None,
              params: dict | None = None) -> tuple[int, Any] | None:
        """(200, parse(body)) or (a 4xx status, None); None when the service is unavailable.

        Only an answer that parses counts as a success of the breaker: a service that replies
        quickly with garbage opens it just like one that is down."""
        if not self.breaker.allow():
            return None
        try:
            r = self._http.request(method, path, json=json, params=params)
            if r.status_code >= 500 or r.status_code < 200 or 200 < r.status_code < 400:
                raise Unavailable(f"answered {r.status_code} {r.text[:200]!r}")
            if r.status_code == 200:
                value = parse(r.json())  # garbage -> ValueError, KeyError, TypeError -> unavailable
            else:
                value = None
                self._warn_once(r.status_code, method, path, r)
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError, Unavailable) as e:
            self.breaker.failure()
            log.warning("tunecache: fleet %s %s%s failed (%s: %s)%s", method, self.url, path, type(e).__name__,
                        str(e)[:300], "; circuit open" if self.breaker.is_open else "")
            return None
        self.breaker.success()
        return r.status_code, value

    def _warn_once(self, status: int, method: str, path: str, r: httpx.Response) -> None:
        if status in (404, 409):
            return  # expected answers: a miss, a lost lease
        route = path.split("/")[2] if path.count("/") >= 2 else path
        if (status, route) in self._warned:
            return
        self._warned.add((status, route))
        try:
            detail = r.json().get("detail")
        except (ValueError, AttributeError):
            detail = r.text[:200]
        log.warning("tunecache: fleet %s %s answered %d: %s", method, path, status, detail)

    # ---- the launcher's calls -----------------------------------------------------------

    def lookup(self, key: TuneKey) -> ConfigRecord | None:
        """The fleet's winner for this key, or None (a miss, or the fleet is unavailable)."""

        def parse(body: Any) -> ConfigRecord:
            rec = ConfigRecord.from_json(body)
            if rec.digest != key.digest:
                raise ValueError(f"answer is for digest {rec.digest[:12]}, asked {key.digest[:12]}")
            return rec

        res = self._call("GET", f"{API}/configs/{key.digest}", parse)
        return None if res is None else res[1]

    def publish(self, rec: ConfigRecord, trials: Iterable[TrialRecord] = (),
                tune_seconds: float | None = None) -> dict | bool | None:
        """Publish a result; the service keeps the faster one. Returns its answer
        ({"accepted", "submission_id", "kept"}), False if it refused the result (4xx), None if
        it could not be reached."""
        body = rec.to_json()
        body["trials"] = [{"config": t.config, "status": t.status, "median_ms": t.median_ms,
                           "error": (t.error or None) and t.error[:4000]} for t in trials]
        if tune_seconds is not None:
            body["tune_seconds"] = float(tune_seconds)
        res = self._call("POST", f"{API}/configs", _expect("accepted", "submission_id", "kept"), json=body)
        if res is None:
            return None
        return res[1] if res[0] == 200 else False

    def enqueue(self, key: TuneKey, priority: int = 0, max_attempts: int = 3) -> dict | None:
        """Ask the fleet to tune this key (one active job per key). None if it could not be sent."""
        res = self._call("POST", f"{API}/jobs", _expect("id", "status"),
                         json={**key.fields(), "priority": priority, "max_attempts": max_attempts})
        return None if res is None else res[1]

    # ---- the worker's calls -------------------------------------------------------------

    def claim(self, owner: str, device: DeviceClass, lease_s: float = 60.0,
              kernel_versions: Mapping[str, str] | None = None,
              triton_version: str | None = None) -> ClaimedJob | None:
        body: dict[str, Any] = {"owner": owner, "arch": device.arch, "sm_count": device.sm_count,
                                "lease_s": lease_s}
        if kernel_versions is not None:
            body["kernel_versions"] = dict(kernel_versions)
        if triton_version is not None:
            body["triton_version"] = triton_version

        def parse(answer: Any) -> ClaimedJob | None:
            job = answer["job"]
            if job is None:
                return None
            key = TuneKey.from_fields(job)
            if key.digest != job["digest"]:
                raise ValueError("job digest does not match its key")
            return ClaimedJob(id=int(job["id"]), key=key, attempts=int(job["attempts"]),
                              max_attempts=int(job["max_attempts"]))

        res = self._call("POST", f"{API}/jobs/claim", parse, json=body)
        return None if res is None else res[1]

    def _job_call(self, job_id: int, what: str, body: dict) -> bool | None:
        """True done, False refused (the lease is lost: 409), None unavailable."""
        res = self._call("POST", f"{API}/jobs/{job_id}/{what}", _expect("status"), json=body)
        return None if res is None else res[0] == 200

    def heartbeat(self, job_id: int, owner: str, lease_s: float = 60.0) -> bool | None:
        return self._job_call(job_id, "heartbeat", {"owner": owner, "lease_s": lease_s})

    def complete(self, job_id: int, owner: str, tune_seconds: float | None = None) -> bool | None:
        body: dict[str, Any] = {"owner": owner}
        if tune_seconds is not None:
            body["tune_seconds"] = float(tune_seconds)
        return self._job_call(job_id, "complete", body)

    def fail(self, job_id: int, owner: str, error: str, backoff_s: float = 5.0) -> bool | None:
        return self._job_call(job_id, "fail", {"owner": owner, "error": error[-8000:], "backoff_s": backoff_s})

    def release(self, job_id: int, owner: str) -> bool | None:
        return self._job_call(job_id, "release", {"owner": owner})

    def queue_counts(self, device: DeviceClass | None = None) -> dict[str, int] | None:
        params = None if device is None else {"arch": device.arch, "sm_count": device.sm_count}
        res = self._call("GET", f"{API}/jobs/stats",
                         lambda b: {k: int(b[k]) for k in ("queued", "running", "done", "failed")}, params=params)
        return None if res is None or res[0] != 200 else res[1]

    def job_statuses(self, digests: Iterable[str]) -> dict[str, str] | None:
        """{digest: status} for these digests (one request per digest; for progress bars)."""
        out: dict[str, str] = {}
        for d in digests:
            res = self._call("GET", f"{API}/jobs/{d}", lambda b: str(b["status"]))
            if res is None:
                return None
            if res[0] == 200:
                out[d] = res[1]
        return out


def _expect(*fields: str) -> Callable[[Any], dict]:
    """A parser that accepts a JSON object with these fields."""

    def parse(body: Any) -> dict:
        if not isinstance(body, dict) or any(f not in body for f in fields):
            raise ValueError(f"expected an object with {', '.join(fields)}")
        return body

    return parse


_CLIENTS: dict[tuple[str, str | None], FleetClient] = {}
_CLIENTS_LOCK = threading.Lock()


def fleet_client(url: str | None = None, token: str | None = None) -> FleetClient:
    """The process's client for this service URL (TUNECACHE_SERVER_URL) and token
    (TUNECACHE_TOKEN); one per (url, token), so its breaker sees every call."""
    url = url or settings.server_url()
    if not url:
        raise ValueError("no fleet configured: set TUNECACHE_SERVER_URL")
    token = token if token is not None else settings.server_token()
    k = (url, token)
    client = _CLIENTS.get(k)
    if client is None:
        with _CLIENTS_LOCK:
            client = _CLIENTS.get(k)
            if client is None:
                client = _CLIENTS[k] = FleetClient(url, token)
    return client


def reset_clients() -> None:
    """Forget every cached client (tests; a process that changed its settings)."""
    with _CLIENTS_LOCK:
        for c in _CLIENTS.values():
            c.close()
        _CLIENTS.clear()
