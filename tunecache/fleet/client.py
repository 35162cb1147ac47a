"""The library's side of the fleet: an HTTP client that never fails, stalls or bloats the
user's call.

Every request has one deadline for the whole exchange (connect, TLS handshake, sending, the
answer's headers and body): TUNECACHE_SERVER_TIMEOUT_S, 2 s. httpx's timeouts are per socket
operation, so a service dribbling a byte a second would never trip them; here every socket
operation's timeout is cut to what is left of the deadline (`_DeadlineBackend`, an httpcore
network backend under httpx). An answer larger than TUNECACHE_SERVER_MAX_BYTES (4 MiB) is
refused on its Content-Length, or as soon as its body passes the cap.

Every call goes through a circuit breaker: after `failures` consecutive failures (connection
refused, the deadline passed, 5xx, an answer too large or not what the API promises) the
breaker opens for `open_s` seconds, and calls return None at once, paying no timeout. Then one
call is let through; success closes the breaker, failure re-opens it. The launcher treats None
as "the fleet had nothing": local store, then the miss policy.

The requests a library call makes (`FleetClient.for_a_call`: its lookup, a copy's recheck and
kernels, the enqueue and report it leaves beside it) share one deadline, and one of them that
misses it opens the breaker at once, until a background probe (every `open_s` seconds) finds
the service answering: no call waits for a hanging fleet a second time, not even the one the
breaker would let through. (Only a call's request opens it so: a worker's heartbeat that runs
late once must not cost it its lease.)

https:// trusts TUNECACHE_CA_BUNDLE, else SSL_CERT_FILE / SSL_CERT_DIR, else certifi; proxies
from the environment are ignored. A token sent over plain http:// to a host that is not
loopback is warned about once per client. Settings come from `settings`; a bad value warns and
gives its default.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json as jsonlib
import logging
import os
import ssl
import threading
import time
from contextvars import ContextVar
from typing import Any, Callable, Iterable, Iterator, Mapping, TypeVar

import httpcore
import httpx

from tunecache import settings
from tunecache.errors import short
from tunecache.fleet.protocol import ANY_RUNS, REFUSED, UNREACHABLE, ClaimedJob, FleetError, Published, Runs, SyncAnswer
from tunecache.key import DeviceClass, TuneKey
from tunecache.store.records import (
    ANNOUNCE_S,
    ANNOUNCE_STATES,
    MAX_ENQUEUE_BATCH,
    MAX_LEASE_S,
    MAX_STATUS_DIGESTS,
    Announcement,
    ConfigRecord,
    JobRecord,
    PurgeReport,
    TrialRecord,
)
from tunecache.tuning.binaries import Binary

log = logging.getLogger("tunecache.fleet.client")

API = "/v1"
MAX_TRIALS_PER_PUBLISH = 2000  # the service's cap (tunecache.server.schemas)
GENERATION_HEADER = "x-tunecache-generation"  # tunecache.server.configs sets it on every lookup

T = TypeVar("T")


def _setting(read: Callable[[], T], default: T) -> T:
    """A setting of the client. A bad value warns and gives the default: a typo in the
    environment must not fail the user's kernel call."""
    try:
        return read()
    except ValueError as e:
        log.warning("tunecache: %s; using %s", e, default)
        return default


class Unavailable(Exception):
    """The service could not be reached or answered something unusable."""


class Refused(Exception):
    """The service refused this client's token for a call it cannot do without (a worker's
    claim): waiting will not change the answer, so the caller stops and says why."""


class CircuitBreaker:
    """Closed -> (N consecutive failures) -> open for T s -> half-open (one trial call)."""

    def __init__(self, failures: int = 3, open_s: float = 30.0) -> None:
        self.failures, self.open_s = failures, open_s
        self._count = 0
        self._open_until = 0.0
        self._trial = False
        self._missed = False  # a call's request missed its deadline: calls skip until an answer
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        return self._missed or time.monotonic() < self._open_until

    @property
    def skips_calls(self) -> bool:
        """A call's request missed its deadline and the service has not answered since."""
        return self._missed

    def allow(self) -> bool:
        with self._lock:
            if self._missed:
                return False
            if self._count < self.failures:
                return True
            if time.monotonic() < self._open_until or self._trial:
                return False
            self._trial = True  # half-open: this caller probes, the others keep skipping
            return True

    def success(self) -> None:
        with self._lock:
            self._count, self._open_until, self._trial, self._missed = 0, 0.0, False, False

    def failure(self, missed_a_call: bool = False) -> bool:
        """One more failure (`missed_a_call`: a call's request ran out of its deadline); True when
        calls start skipping the service now (the caller starts the probe that lets them back)."""
        with self._lock:
            self._count += 1
            self._trial = False
            if self._count >= self.failures:
                self._open_until = time.monotonic() + self.open_s
            tripped = missed_a_call and not self._missed
            self._missed = self._missed or missed_a_call
            return tripped


# ---- transport: one deadline per request, over httpcore -----------------------------------

# When the request running in this thread must be done (time.monotonic()); None outside one.
_DEADLINE: ContextVar[float | None] = ContextVar("tunecache_fleet_deadline", default=None)
# [when the requests of the library call this thread serves must be done: set by the first]
# inside `FleetClient.for_a_call`; None outside one
_CALL: ContextVar[list | None] = ContextVar("tunecache_fleet_call", default=None)


def _left(timeout: float | None, expired: type[Exception]) -> float | None:
    """One socket operation's timeout: httpx's per-phase one, cut to what is left of the
    request's deadline; `expired` once nothing is left."""
    deadline = _DEADLINE.get()
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise expired("the request's deadline passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """httpcore's socket stream, each read, write and TLS handshake held to the deadline: a
    service dribbling headers or body a byte at a time is cut off when the deadline passes."""

    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        return _DeadlineStream(
            self._stream.start_tls(ssl_context, server_hostname, _left(timeout, httpcore.ConnectTimeout))
        )

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's sync backend, its connections held to the deadline. (Name resolution is the
    one step no timeout reaches: getaddrinfo blocks as long as the system resolver does.)"""

    def __init__(self) -> None:
        self._backend = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        return _DeadlineStream(
            self._backend.connect_tcp(
                host, port, _left(timeout, httpcore.ConnectTimeout), local_address, socket_options
            )
        )


@contextlib.contextmanager
def _httpx_errors(request: httpx.Request) -> Iterator[None]:
    """httpcore's exceptions as httpx's, as httpx's own transport raises them."""
    try:
        yield
    except httpcore.TimeoutException as e:
        raise httpx.TimeoutException(str(e) or type(e).__name__, request=request) from e
    except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol, httpcore.ProxyError) as e:
        raise httpx.TransportError(f"{type(e).__name__}: {e}", request=request) from e


class _Body(httpx.SyncByteStream):
    def __init__(self, stream: Any, request: httpx.Request) -> None:
        self._stream, self._request = stream, request

    def __iter__(self) -> Iterator[bytes]:
        with _httpx_errors(self._request):
            yield from self._stream

    def close(self) -> None:
        self._stream.close()


class _Transport(httpx.BaseTransport):
    """httpx's HTTPTransport less its options: an httpcore connection pool (keep-alive as
    httpx's defaults) over `_DeadlineBackend`. HTTPTransport itself takes no network backend."""

    def __init__(self, ssl_context: ssl.SSLContext | None) -> None:
        self._pool = httpcore.ConnectionPool(
            ssl_context=ssl_context,
            network_backend=_DeadlineBackend(),
            max_connections=100,
            max_keepalive_connections=20,
            keepalive_expiry=5.0,
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        req = httpcore.Request(
            request.method,
            httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        with _httpx_errors(request):
            resp = self._pool.handle_request(req)
        return httpx.Response(
            resp.status, headers=resp.headers, stream=_Body(resp.stream, request), extensions=resp.extensions
        )

    def close(self) -> None:
        self._pool.close()


def _tls_context() -> ssl.SSLContext:
    """Whom https:// trusts (`settings.server_ca`): a private CA's bundle, else certifi, as
    httpx does. A bad bundle warns, naming its variable, and certifi is trusted instead: the
    fleet then fails to connect, and the user's call goes on without it."""
    import certifi  # httpx's own dependency

    try:
        source = settings.server_ca()
    except ValueError as e:
        log.warning("tunecache: %s; the fleet client trusts the default CA bundle (certifi) instead", e)
        source = None
    if source is not None:
        name, path = source
        try:
            if os.path.isdir(path):
                return ssl.create_default_context(capath=path)
            return ssl.create_default_context(cafile=path)
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            log.warning(
                "tunecache: %s=%r is not a usable CA bundle (%s); the fleet client trusts the default "
                "CA bundle (certifi) instead",
                name,
                path,
                e,
            )
    return ssl.create_default_context(cafile=certifi.where())


def is_loopback(host: str) -> bool:
    """localhost, 127.0.0.0/8 or ::1: traffic that never leaves this machine."""
    if host.rstrip(".").lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def sends_token_in_clear(url: str, token: str | None) -> bool:
    """Whether a client for `url` would send its token, unencrypted, off this machine."""
    u = httpx.URL(url)
    return bool(token) and u.scheme == "http" and not is_loopback(u.host)


class FleetClient:
    """lookup / publish / enqueue for the launcher, and the worker's queue calls."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout_s: float | None = None,
        connect_timeout_s: float | None = None,
        failures: int | None = None,
        open_s: float | None = None,
        max_bytes: int | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = (
            timeout_s if timeout_s is not None else _setting(settings.server_timeout_s, settings.SERVER_TIMEOUT_S)
        )
        self.max_bytes = (
            max_bytes if max_bytes is not None else _setting(settings.server_max_bytes, settings.SERVER_MAX_BYTES)
        )
        connect = connect_timeout_s if connect_timeout_s is not None else min(self.timeout_s, 1.0)
        self.breaker = CircuitBreaker(
            failures if failures is not None else _setting(settings.breaker_failures, settings.BREAKER_FAILURES),
            open_s if open_s is not None else _setting(settings.breaker_open_s, settings.BREAKER_OPEN_S),
        )
        # identity: the service does not compress, and a compressed answer could inflate far
        # past the size cap in one chunk
        headers = {"User-Agent": "tunecache-client", "Accept-Encoding": "identity"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
            if sends_token_in_clear(self.url, token):
                log.warning(
                    "tunecache: the fleet token is sent unencrypted to %s (plain http://, not loopback): "
                    "anyone on the path can read and reuse it; use https://",
                    httpx.URL(self.url).host,
                )
        tls = _tls_context() if httpx.URL(self.url).scheme == "https" else None
        # trust_env=False: HTTP(S)_PROXY / ALL_PROXY are set on hosts for downloads from the
        # internet; the fleet is on the cluster's own network, and a proxy in between would add
        # a hop that can stall the user's call and would see the token. (CA bundles from the
        # environment are honoured: _tls_context reads them.)
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            trust_env=False,
            transport=_Transport(tls),
            timeout=httpx.Timeout(self.timeout_s, connect=connect),
        )
        self._warned: set[tuple[int, str]] = set()
        # the fleet's generation as its last answer said (see tunecache.cache.config_cache)
        self.generation: int | None = None
        self._closed = threading.Event()
        self._prober: threading.Thread | None = None
        self._prober_lock = threading.Lock()

    def close(self) -> None:
        self._closed.set()
        self._http.close()

    @contextlib.contextmanager
    def for_a_call(self) -> Iterator[None]:
        """The requests of one library call (in this thread): one deadline for them all,
        TUNECACHE_SERVER_TIMEOUT_S from the first; none sent while a call's request that missed
        its deadline has not been answered since (a background probe asks). Nested: the outer."""
        if _CALL.get() is not None:
            yield
            return
        scope = _CALL.set([None])
        try:
            yield
        finally:
            _CALL.reset(scope)

    def _probe_until_back(self) -> None:
        """Every `open_s` seconds, ask the service (GET /v1/generation, its own deadline) until
        it answers; then the calls use it again."""
        while not self._closed.wait(self.breaker.open_s):
            if not self.breaker.skips_calls:
                return  # another request found it back
            try:
                status, _ = self._exchange("GET", f"{API}/generation", None, None)
            except (httpx.HTTPError, Unavailable, RuntimeError) as e:
                log.debug("tunecache: fleet %s still does not answer (%s)", self.url, short(e))
                continue
            if status < 500 and status != 429:
                self.breaker.success()
                log.warning("tunecache: fleet %s answers again; calls use it again", self.url)
                return

    def _probe_later(self) -> None:
        with self._prober_lock:
            if self._prober is None or not self._prober.is_alive():
                self._prober = threading.Thread(
                    target=self._probe_until_back, name="tunecache-fleet-probe", daemon=True
                )
                self._prober.start()

    # ---- transport ----------------------------------------------------------------------

    def _call(
        self, method: str, path: str, parse: Callable[[Any], Any], json: Any = None, params: dict | None = None
    ) -> tuple[int, Any] | None:
        """(200, parse(body)) or (a 4xx status, None); None when the service is unavailable.

        Only an answer that parses counts as a success of the breaker: a service that replies
        quickly with garbage opens it just like one that is down, slow or too talkative."""
        if not self.breaker.allow():
            return None
        try:
            status, body = self._exchange(method, path, json, params)
            # 429 (over the rate limit) too: the breaker then backs this host off
            if status >= 500 or status < 200 or 200 < status < 400 or status == 429:
                raise Unavailable(f"answered {status} {body[:200].decode('utf-8', 'replace')!r}")
            if status == 200:
                # garbage -> ValueError, KeyError, TypeError, RecursionError -> unavailable
                value = parse(jsonlib.loads(body))
            else:
                value = None
                self._warn_once(status, method, path, body)
        except httpx.TimeoutException:
            self._failed(
                method,
                path,
                f"no whole answer within the deadline of {self.timeout_s:g} s (TUNECACHE_SERVER_TIMEOUT_S)",
                missed=True,
            )
            return None
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError, RecursionError, Unavailable) as e:
            self._failed(method, path, short(e))
            return None
        self.breaker.success()
        return status, value

    def _exchange(self, method: str, path: str, json: Any, params: dict | None) -> tuple[int, bytes]:
        """One request and its whole answer, (status, body), within the deadline (else
        httpx.TimeoutException) and the size cap (else Unavailable)."""
        deadline = time.monotonic() + self.timeout_s
        call = _CALL.get()
        if call is not None:  # the call's requests share one deadline, from the first
            if call[0] is None:
                call[0] = deadline
            deadline = min(deadline, call[0])
        scope = _DEADLINE.set(deadline)
        try:
            with self._http.stream(method, path, json=json, params=params) as r:
                generation = r.headers.get(GENERATION_HEADER, "")
                if generation.isdigit():
                    self.generation = int(generation)
                length = r.headers.get("content-length", "")
                if length.isdigit() and int(length) > self.max_bytes:
                    raise Unavailable(
                        f"the answer is {int(length)} bytes long (Content-Length), over the cap of "
                        f"{self.max_bytes} (TUNECACHE_SERVER_MAX_BYTES); not read"
                    )
                chunks, size = [], 0
                for chunk in r.iter_raw():
                    size += len(chunk)
                    if size > self.max_bytes:  # closing the response drops the connection
                        raise Unavailable(
                            f"the answer passed the cap of {self.max_bytes} bytes "
                            f"(TUNECACHE_SERVER_MAX_BYTES); stopped reading at {size}"
                        )
                    chunks.append(chunk)
                return r.status_code, b"".join(chunks)
        finally:
            _DEADLINE.reset(scope)

    def _failed(self, method: str, path: str, why: str, missed: bool = False) -> None:
        tripped = self.breaker.failure(missed_a_call=missed and _CALL.get() is not None)
        if tripped:
            self._probe_later()
        log.warning(
            "tunecache: fleet %s %s%s failed (%s)%s",
            method,
            self.url,
            path,
            why,
            f"; calls skip it until it answers again (asked every {self.breaker.open_s:g} s)"
            if tripped
            else "; circuit open"
            if self.breaker.is_open
            else "",
        )

    def _warn_once(self, status: int, method: str, path: str, body: bytes) -> None:
        if status in (404, 409):
            return  # expected answers: a miss, a lost lease
        route = path.split("/")[2] if path.count("/") >= 2 else path
        if (status, route) in self._warned:
            return
        self._warned.add((status, route))
        try:
            detail = jsonlib.loads(body).get("detail")
        except (ValueError, AttributeError, RecursionError):
            detail = body[:200].decode("utf-8", "replace")
        log.warning("tunecache: fleet %s %s answered %d: %s", method, path, status, detail)

    @property
    def where(self) -> str:
        return self.url

    # ---- the launcher's calls -----------------------------------------------------------

    def lookup(self, key: TuneKey) -> ConfigRecord | None:
        """The fleet's winner for this key, or None (a miss, or the fleet is unavailable)."""
        return self.fetch(key)[1]

    def fetch(self, key: TuneKey) -> tuple[str, ConfigRecord | None]:
        """("hit", the fleet's winner), ("miss", None) when the fleet has none, or
        ("unavailable", None) when it could not say."""

        def parse(body: Any) -> ConfigRecord:
            rec = ConfigRecord.from_json(body)
            if rec.digest != key.digest:
                raise ValueError(f"answer is for digest {rec.digest[:12]}, asked {key.digest[:12]}")
            return rec

        res = self._call("GET", f"{API}/configs/{key.digest}", parse)
        if res is None:
            return "unavailable", None
        if res[0] == 404:
            return "miss", None
        return ("hit", res[1]) if res[0] == 200 else ("unavailable", None)

    def best(self, op: str, device: str, shape: Mapping[str, Any], **pins: str) -> tuple[int, Any] | None:
        """`GET /v1/best/{op}`: (200, the winner as JSON) or (a 4xx status, the service's words);
        None when the fleet could not be reached. `pins`: backend, kernel_version, triton_version."""
        params = {"device": device, **{k: str(v) for k, v in shape.items()}, **pins}
        return self._get_json(f"{API}/best/{op}", params)

    def _get_json(
        self, path: str, params: dict | None, method: str = "GET", json: Any = None
    ) -> tuple[int, Any] | None:
        """A call (a GET unless told) whose 4xx answers matter to the caller: (status, the JSON
        body, or a 4xx's `detail`); None when the service could not be reached (a breaker failure)."""
        if not self.breaker.allow():
            return None
        try:
            status, body = self._exchange(method, path, json, params)
            if status >= 500:
                raise Unavailable(f"answered {status}")
            data = jsonlib.loads(body)
        except httpx.TimeoutException:
            self._failed(
                method, path, f"no whole answer within {self.timeout_s:g} s (TUNECACHE_SERVER_TIMEOUT_S)", missed=True
            )
            return None
        except (httpx.HTTPError, ValueError, RecursionError, Unavailable) as e:
            self._failed(method, path, short(e))
            return None
        self.breaker.success()
        return status, data if status == 200 else (data.get("detail") if isinstance(data, dict) else data)

    def export(self, kernel: str | None = None, arch: str | None = None) -> tuple[int, Any] | None:
        """`GET /v1/export`: (200, {"format", "configs"}) or (4xx, the service's words); None when
        unreachable. A whole fleet can be large: make this client with a `max_bytes` to match."""
        params = {k: v for k, v in (("kernel", kernel), ("arch", arch)) if v}
        return self._get_json(f"{API}/export", params or None)

    def whoami(self) -> tuple[int, Any] | None:
        """`GET /v1/whoami`: (200, {"name", "scopes", "may"}) or (401/403, the service's words);
        None when the fleet could not be reached."""
        return self._get_json(f"{API}/whoami", None)

    def current_generation(self) -> int | None:
        """The fleet's generation now (it moves whenever a winner is removed or replaced)."""
        res = self._call("GET", f"{API}/generation", lambda b: int(_expect("generation")(b)["generation"]))
        if res is not None and res[0] == 200:
            self.generation = res[1]
            return res[1]
        return None

    def trials(self, kernel: str, arch: str) -> list[tuple] | None:
        """The fleet's trusted trials of `kernel` on `arch` (GET /v1/trials); None when the fleet
        could not say (unreachable, refused, or a service older than the endpoint)."""
        res = self._call("GET", f"{API}/trials", _trials, params={"kernel": kernel, "arch": arch})
        return None if res is None or res[0] != 200 else res[1]

    def report(self, key: TuneKey, config: dict, error: str) -> bool | None:
        """Tell the fleet that its config for this key cannot run here (kept as a failed trial;
        a worker re-times the key). True if recorded, None if the fleet could not be reached."""
        res = self._call(
            "POST",
            f"{API}/configs/{key.digest}/reports",
            _expect("recorded"),
            json={"config": config, "error": (error or "unknown")[:4000]},
        )
        return None if res is None else res[0] == 200

    def publish(
        self, rec: ConfigRecord, trials: Iterable[TrialRecord] = (), tune_seconds: float | None = None
    ) -> Published:
        """Publish a result; the service keeps the faster one of a worker token's, and records
        any other token's as a submission a worker re-times. Status `refused` for a 4xx answer,
        `unreachable` when the fleet could not be reached."""
        body = rec.to_json()
        trials = list(trials)
        if len(trials) > MAX_TRIALS_PER_PUBLISH:  # the service refuses more: keep the fastest, then failures
            trials.sort(key=lambda t: (t.status != "ok", t.median_ms if t.median_ms is not None else float("inf")))
            trials = trials[:MAX_TRIALS_PER_PUBLISH]
        body["trials"] = [
            {
                "config": t.config,
                "status": t.status,
                "median_ms": t.median_ms,
                "error": (t.error or None) and t.error[:4000],
            }
            for t in trials
        ]
        if tune_seconds is not None:
            body["tune_seconds"] = float(tune_seconds)
        res = self._call("POST", f"{API}/configs", _published, json=body)
        if res is None:
            return Published(UNREACHABLE)
        return res[1] if res[0] == 200 else Published(REFUSED)

    # ---- a winner's compiled kernels (tunecache.tuning.binaries) ----------------------------------

    def publish_binaries(self, rec: ConfigRecord, binaries: list[Binary]) -> bool | None:
        """Send the compiled kernels of the winner `rec` (a worker token's right); True if
        kept, False if refused (4xx), None if the fleet could not be reached or none were given."""
        if not binaries:
            return None
        body = {"config": rec.config, "binaries": [b.to_json() for b in binaries]}
        res = self._call("PUT", f"{API}/configs/{rec.digest}/binaries", _expect("stored"), json=body)
        return None if res is None else res[0] == 200

    def binaries(self, digest: str) -> tuple[dict, list[Binary]] | None:
        """(the winner's config, its compiled kernels) as the fleet has them; None on a miss or
        when the fleet could not answer."""

        def parse(body: Any) -> tuple[dict, list[Binary]]:
            if not isinstance(body, dict) or body.get("digest") != digest or not isinstance(body.get("config"), dict):
                raise ValueError("expected {digest, config, binaries} for the digest asked")
            return body["config"], [Binary.from_json(b) for b in body.get("binaries") or []]

        res = self._call("GET", f"{API}/configs/{digest}/binaries", parse)
        return res[1] if res is not None and res[0] == 200 else None

    def sync(
        self, device: DeviceClass, triton_version: str, kernel_versions: Mapping[str, str] | None, binaries: bool = True
    ) -> SyncAnswer:
        """`POST /v1/sync`: every winner of the device class, and their compiled kernels up to
        64 MiB. Make this client with a `max_bytes` and `timeout_s` to match. FleetError when the
        fleet could not be reached or refused."""
        body = {
            "arch": device.arch,
            "sm_count": device.sm_count,
            "triton_version": triton_version,
            "kernel_versions": None if kernel_versions is None else dict(kernel_versions),
            "binaries": binaries,
        }
        answer = self._answer(self._get_json(f"{API}/sync", None, "POST", body), "sync")
        skipped: list[str] = []
        configs = []
        for entry in answer.get("configs", []):
            try:
                configs.append(ConfigRecord.from_json(entry))
            except (ValueError, KeyError, TypeError) as e:
                skipped.append(f"a malformed entry: {e}")
        found: dict[str, list[Binary]] = {}
        for digest, kernels in (answer.get("binaries") or {}).items():
            try:
                found[digest] = [Binary.from_json(b) for b in kernels]
            except ValueError as e:
                skipped.append(f"the compiled kernels of {digest[:12]}: {e}")
        return SyncAnswer(answer.get("generation"), configs, found, list(answer.get("more_binaries") or []), skipped)

    def enqueue(self, key: TuneKey, priority: int = 0, max_attempts: int = 3) -> bool | None:
        """Ask the fleet to tune this key (one active job per key). None if it could not be sent."""
        res = self._call(
            "POST",
            f"{API}/jobs",
            _expect("id", "status"),
            json={**key.fields(), "priority": priority, "max_attempts": max_attempts},
        )
        return None if res is None else res[0] == 200

    def enqueue_missing(self, keys: list[TuneKey], priority: int = 0, max_attempts: int = 3) -> set[str] | None:
        """Enqueue, in order, the keys the fleet has no tuned config for; the digests of those it
        has. A request per hundred keys (POST /v1/jobs/batch): a lookup and an enqueue per key ran
        a pretune of a hundred shapes into its token's rate limit. A service older than that
        endpoint (404 or 405) is asked key by key. None if the fleet could not be reached or
        refused (the caller cannot tell what is queued)."""
        tuned: set[str] = set()
        for i in range(0, len(keys), MAX_ENQUEUE_BATCH):
            chunk = keys[i : i + MAX_ENQUEUE_BATCH]
            body = {"jobs": [{**k.fields(), "priority": priority, "max_attempts": max_attempts} for k in chunk]}
            res = self._call("POST", f"{API}/jobs/batch", _tuned_digests, json=body)
            if res is not None and res[0] in (404, 405):
                return self._enqueue_missing_one_by_one(keys, priority, max_attempts)
            if res is None or res[0] != 200:
                return None
            tuned |= res[1]
        return tuned

    def _enqueue_missing_one_by_one(self, keys: list[TuneKey], priority: int, max_attempts: int) -> set[str] | None:
        tuned: set[str] = set()
        for k in keys:
            found, _ = self.fetch(k)
            if found == "hit":
                tuned.add(k.digest)
            elif found == "unavailable" or not self.enqueue(k, priority, max_attempts):
                return None
        return tuned

    # ---- the worker's calls -------------------------------------------------------------

    def claim(self, owner: str, device: DeviceClass, lease_s: float, runs: Runs = ANY_RUNS) -> ClaimedJob | None:
        body: dict[str, Any] = {"owner": owner, "arch": device.arch, "sm_count": device.sm_count, "lease_s": lease_s}
        if runs.kernel_versions is not None:
            body["kernel_versions"] = dict(runs.kernel_versions)
        if runs.triton_version is not None:
            body["triton_version"] = runs.triton_version

        def parse(answer: Any) -> ClaimedJob | None:
            job = answer["job"]
            if job is None:
                return None
            key = TuneKey.from_fields(job)
            if key.digest != job["digest"]:
                raise ValueError("job digest does not match its key")
            secret = answer["lease_secret"]
            if not isinstance(secret, str) or not secret:
                raise ValueError("a claimed job without its lease secret")
            return ClaimedJob(
                id=int(job["id"]),
                key=key,
                attempts=int(job["attempts"]),
                max_attempts=int(job["max_attempts"]),
                lease_secret=secret,
                retime=job.get("retime") is True,
            )

        res = self._call("POST", f"{API}/jobs/claim", parse, json=body)
        if res is not None and res[0] in (401, 403):
            raise Refused(
                f"the fleet at {self.url} refused to hand out jobs ({res[0]}: "
                + ("no valid token: set TUNECACHE_TOKEN" if res[0] == 401 else "this token lacks the worker scope")
                + "); a worker needs a token made with `tunecache token create --scope worker`"
            )
        return None if res is None else res[1]

    def _job_call(self, job_id: int, what: str, body: dict) -> bool | None:
        """True done, False refused (the lease is not held: 409, or 403 without a secret), None
        unavailable."""
        res = self._call("POST", f"{API}/jobs/{job_id}/{what}", _expect("status"), json=body)
        return None if res is None else res[0] == 200

    def heartbeat(self, job: ClaimedJob, lease_s: float) -> bool | None:
        return self._job_call(job.id, "heartbeat", {"lease_secret": job.lease_secret, "lease_s": lease_s})

    def complete(self, job: ClaimedJob, tune_seconds: float | None = None) -> bool | None:
        body: dict[str, Any] = {"lease_secret": job.lease_secret}
        if tune_seconds is not None:
            body["tune_seconds"] = float(tune_seconds)
        return self._job_call(job.id, "complete", body)

    def fail(self, job: ClaimedJob, error: str, backoff_s: float = 5.0) -> bool | None:
        return self._job_call(
            job.id, "fail", {"lease_secret": job.lease_secret, "error": error[-8000:], "backoff_s": backoff_s}
        )

    def release(self, job: ClaimedJob) -> bool | None:
        return self._job_call(job.id, "release", {"lease_secret": job.lease_secret})

    # ---- operators' calls (`tunecache jobs`, `tunecache fleet`): FleetError says why not ----------

    def _answer(self, res: tuple[int, Any] | None, what: str) -> Any:
        if res is None:
            raise FleetError(f"the fleet at {self.url} could not be reached to {what} (see the warning above)")
        status, body = res
        if status != 200:
            raise FleetError(f"the fleet at {self.url} answered {status}: {body}")
        return body

    def jobs(self, status: str | None = None, limit: int = 1000, device: DeviceClass | None = None) -> list[JobRecord]:
        params: dict[str, Any] = {"limit": limit}
        if status:
            params["status"] = status
        if device is not None:
            params.update(arch=device.arch, sm_count=device.sm_count)
        body = self._answer(self._get_json(f"{API}/jobs", params), "list its jobs")
        try:
            return [job_record_from_json(j) for j in body]
        except (TypeError, KeyError, ValueError) as e:
            raise FleetError(f"the fleet at {self.url} sent a job list this client cannot read: {e}") from None

    def retry(self, digest: str) -> JobRecord:
        answer = self._get_json(f"{API}/jobs/{digest}/retry", None, method="POST")
        return job_record_from_json(self._answer(answer, f"retry job {digest[:12]}"))

    def drop_job(self, digest: str) -> None:
        self._answer(self._get_json(f"{API}/jobs/{digest}", None, method="DELETE"), f"drop job {digest[:12]}")

    def drop(self, digest: str) -> None:
        self._answer(self._get_json(f"{API}/configs/{digest}", None, method="DELETE"), f"delete config {digest[:12]}")

    def purge(self, token_name: str, dry_run: bool = False) -> PurgeReport:
        body = {"token_name": token_name, "dry_run": dry_run}
        answer = self._answer(self._get_json(f"{API}/admin/purge", None, "POST", body), f"purge token {token_name!r}")
        try:
            return PurgeReport(
                token_name=str(answer["token_name"]),
                removed=[ConfigRecord.from_json(r) for r in answer["removed"]],
                jobs={str(k): str(v) for k, v in answer["jobs"].items()},
                submissions=int(answer["submissions_removed"]),
                generation=int(answer["generation"]),
                dry_run=bool(answer["dry_run"]),
            )
        except (TypeError, KeyError, ValueError, AttributeError) as e:
            raise FleetError(f"the fleet at {self.url} sent a purge report this client cannot read: {e}") from None

    def queue_counts(self, device: DeviceClass | None = None) -> dict[str, int] | None:
        params = None if device is None else {"arch": device.arch, "sm_count": device.sm_count}
        res = self._call(
            "GET",
            f"{API}/jobs/stats",
            lambda b: {k: int(b[k]) for k in ("queued", "running", "done", "failed")},
            params=params,
        )
        return None if res is None or res[0] != 200 else res[1]

    def active(self, device: DeviceClass) -> int | None:
        c = self.queue_counts(device)
        return None if c is None else c.get("queued", 0) + c.get("running", 0)

    def statuses(self, digests: Iterable[str]) -> dict[str, str] | None:
        """{digest: status} for these digests (for progress bars): a request per thousand digests
        (POST /v1/jobs/statuses), not one per digest, which a manifest of a few dozen shapes polled
        each second would spend the token's rate limit on; a service older than that endpoint
        (404 or 405) is asked one digest at a time."""
        digests = list(digests)
        out: dict[str, str] = {}
        for i in range(0, len(digests), MAX_STATUS_DIGESTS):
            res = self._call(
                "POST", f"{API}/jobs/statuses", _statuses, json={"digests": digests[i : i + MAX_STATUS_DIGESTS]}
            )
            if res is None:
                return None
            if res[0] in (404, 405):
                return self._job_statuses_one_by_one(digests)
            if res[0] == 200:
                out.update(res[1])
        return out

    def announce(self, key: TuneKey, holder: str, seconds: float = ANNOUNCE_S) -> Announcement | None:
        """Who tunes `key` across the fleet (POST /v1/jobs/announce, `Store.announce`); None when the
        fleet could not say (unreachable, refused, or a service older than the endpoint): the
        caller tunes it itself."""
        res = self._call(
            "POST",
            f"{API}/jobs/announce",
            _announcement,
            json={**key.fields(), "holder": holder[:128], "seconds": seconds},
        )
        return None if res is None or res[0] != 200 else res[1]

    def _job_statuses_one_by_one(self, digests: list[str]) -> dict[str, str] | None:
        out: dict[str, str] = {}
        for d in digests:
            res = self._call("GET", f"{API}/jobs/{d}", lambda b: str(b["status"]))
            if res is None:
                return None
            if res[0] == 200:
                out[d] = res[1]
        return out


def _trials(body: Any) -> list[tuple]:
    """GET /v1/trials's packed answer as (kernel, problem, config, milliseconds) rows, read as
    the shipped trials are (tunecache.tuning.ranking.unpack_rows)."""
    from tunecache.tuning.ranking import unpack_rows

    kernel = str(body["kernel"])
    return [(kernel, *row) for row in unpack_rows(body)]


def _published(body: Any) -> Published:
    if not isinstance(body, dict) or "accepted" not in body or "submission_id" not in body:
        raise ValueError("expected an object with accepted, submission_id")
    kept = body.get("kept")
    status = body.get("status") or ("won" if body["accepted"] is True else "recorded")
    sid = body["submission_id"]
    return Published(
        str(status), None if sid is None else int(sid), None if kept is None else ConfigRecord.from_json(kept)
    )


def job_record_from_json(d: Mapping[str, Any]) -> JobRecord:
    """A job as the service's JobOut answers it."""
    from datetime import datetime

    def when(v: Any) -> datetime | None:
        return None if not v else datetime.fromisoformat(str(v).replace("Z", "+00:00")).replace(tzinfo=None)

    return JobRecord(
        id=int(d["id"]),
        key=TuneKey.from_fields(d),
        status=str(d["status"]),
        priority=int(d["priority"]),
        attempts=int(d["attempts"]),
        max_attempts=int(d["max_attempts"]),
        lease_owner=d.get("lease_owner"),
        lease_expires_at=when(d.get("lease_expires_at")),
        last_error=d.get("last_error"),
        digest=str(d["digest"]),
        not_before=when(d.get("not_before")),
        created_at=when(d.get("created_at")),
        unreadable=d.get("unreadable"),
    )


def _tuned_digests(body: Any) -> set[str]:
    got = body["tuned"]
    if not isinstance(got, list) or not isinstance(body["queued"], list):
        raise ValueError("expected tuned and queued: lists of digests")
    return {str(d) for d in got}


def _statuses(body: Any) -> dict[str, str]:
    got = body["statuses"]
    if not isinstance(got, dict):
        raise ValueError("expected statuses: an object of digest -> status")
    return {str(d): str(st) for d, st in got.items()}


def _expect(*fields: str) -> Callable[[Any], dict]:
    """A parser that accepts a JSON object with these fields."""

    def parse(body: Any) -> dict:
        if not isinstance(body, dict) or any(f not in body for f in fields):
            raise ValueError(f"expected an object with {', '.join(fields)}")
        return body

    return parse


def _announcement(body: Any) -> Announcement:
    b = _expect("state")(body)
    if b["state"] not in ANNOUNCE_STATES:
        raise ValueError(f"unknown announcement state {b['state']!r}")
    hint = b.get("hint")
    if hint is not None and not isinstance(hint, dict):
        raise ValueError("an announcement's hint is a config (an object)")
    hint_ms = b.get("hint_ms")
    return Announcement(
        b["state"],
        holder=str(b.get("holder") or "")[:128],
        seconds_left=min(max(float(b.get("seconds_left") or 0.0), 0.0), MAX_LEASE_S),
        hint=hint,
        hint_ms=None if hint_ms is None else float(hint_ms),
    )


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
