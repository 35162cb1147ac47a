"""Settings from the environment, read when asked (tests and workers change them)."""

from __future__ import annotations

import math
import os
from pathlib import Path

MISS_POLICIES = ("tune", "default", "strict")


def db_url() -> str:
    """TUNECACHE_DB_URL, else a SQLite file under the user cache dir."""
    url = os.environ.get("TUNECACHE_DB_URL")
    if url:
        return url
    from platformdirs import user_cache_dir

    path = Path(user_cache_dir("tunecache")) / "tunecache.sqlite"
    return f"sqlite:///{path}"


def db_url_given() -> bool:
    """Whether TUNECACHE_DB_URL names a store (else db_url() is this host's own SQLite file)."""
    return bool(os.environ.get("TUNECACHE_DB_URL"))


def miss_policy() -> str:
    policy = os.environ.get("TUNECACHE_MISS_POLICY", "tune").strip().lower()
    if policy not in MISS_POLICIES:
        raise ValueError(f"TUNECACHE_MISS_POLICY must be one of {MISS_POLICIES}, got {policy!r}")
    return policy


def server_url() -> str | None:
    return os.environ.get("TUNECACHE_SERVER_URL") or None


def server_token() -> str | None:
    return os.environ.get("TUNECACHE_TOKEN") or None


def recheck_seconds() -> float:
    """TUNECACHE_RECHECK_S: how often a provisional (default-config) memo entry asks the store
    for a winner; `never`: only at `tunecache.refresh()` (ranks that must agree at every step)."""
    v = os.environ.get("TUNECACHE_RECHECK_S", "").strip().lower()
    if v == "never":
        return math.inf
    if v in ("0", "0.0"):
        return 0.0  # at every call
    return _seconds("TUNECACHE_RECHECK_S", 30.0)


def backend_override() -> str | None:
    """TUNECACHE_BACKEND=portable forces a backend (benchmarks, debugging)."""
    return os.environ.get("TUNECACHE_BACKEND") or None


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_seconds(text: str) -> float:
    """'30d', '12h', '90m', '45s', '2w' or a plain number of seconds -> seconds, > 0 and finite:
    the one reader of a duration, for the environment and the command line alike."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e[+-]?\d+)?)\s*([smhdw]?)\s*", str(text).lower())
    seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2) or "s"] if m else float("nan")
    if not 0 < seconds < float("inf"):  # NaN fails the comparison too
        raise ValueError(
            f"{text!r} is not a duration: give a positive number of seconds, or one with a unit: "
            "30d, 12h, 90m, 45s or 2w"
        )
    return seconds


def _seconds(name: str, default: float) -> float:
    v = os.environ.get(name, "")
    if not v.strip():
        return default
    try:
        return parse_seconds(v)
    except ValueError as e:
        raise ValueError(f"{name} must be a number of seconds > 0, got {v!r} ({e})") from None


def candidate_timeout_s() -> float:
    """TUNECACHE_CANDIDATE_TIMEOUT_S: how long one candidate may take to launch, be checked and
    be timed in the isolated trial runner before it is killed as hung (a failed trial)."""
    return _seconds("TUNECACHE_CANDIDATE_TIMEOUT_S", 60.0)


def progress_s() -> float:
    """TUNECACHE_PROGRESS_S: how often a long command (tune, compile, pretune) whose stderr is not
    a terminal (a log, CI) writes its progress as a plain line there; a terminal gets a bar."""
    return _seconds("TUNECACHE_PROGRESS_S", 5.0)


def tune_wait_s() -> float:
    """TUNECACHE_TUNE_WAIT_S: how long a process that misses a key another process of this host
    is tuning waits for that winner before it tunes the key itself."""
    return _seconds("TUNECACHE_TUNE_WAIT_S", 600.0)


def lock_dir() -> str:
    """TUNECACHE_LOCK_DIR: where the processes of this host meet: one tune per key, one timer per
    GPU (default: tunecache-locks in the system's temporary directory, shared by every user)."""
    import tempfile

    return os.environ.get("TUNECACHE_LOCK_DIR") or os.path.join(tempfile.gettempdir(), "tunecache-locks")


def timing_trace() -> str | None:
    """TUNECACHE_TIMING_TRACE: a file to which each trial runner appends, as a JSON line, every
    window in which it held a GPU's timer (pid, device, start, end): who timed on a GPU when."""
    return os.environ.get("TUNECACHE_TIMING_TRACE") or None


def fleet_binaries() -> bool:
    """TUNECACHE_FLEET_BINARIES: a host that copies a fleet winner also installs its compiled
    kernels into Triton's cache (built by the fleet's tuning hosts), so it need not compile
    them; 0 makes this host compile everything itself."""
    return _flag("TUNECACHE_FLEET_BINARIES", True)


def fleet_ttl_s() -> float:
    """TUNECACHE_FLEET_TTL_S: after how long a host rechecks its copy of a fleet winner (sooner
    when the fleet's generation moves: a winner was removed or replaced)."""
    return _seconds("TUNECACHE_FLEET_TTL_S", 3600.0)


def queue_stuck_s() -> float:
    """TUNECACHE_QUEUE_STUCK_S: /healthz calls a device class's queue stuck when a job a worker
    could claim has waited this long and no worker of the class holds a lease."""
    return _seconds("TUNECACHE_QUEUE_STUCK_S", 900.0)


def selfcheck_mode() -> str:
    """TUNECACHE_SELFCHECK: `gpu` (a backend's first contact with a GPU device class runs its
    self-check; the default), `always` (the CPU interpreter too), `never`."""
    v = os.environ.get("TUNECACHE_SELFCHECK", "gpu").strip().lower() or "gpu"
    if v not in ("gpu", "always", "never"):
        raise ValueError(f"TUNECACHE_SELFCHECK must be one of gpu, always, never; got {v!r}")
    return v


def compile_timeout_s() -> float:
    """TUNECACHE_COMPILE_TIMEOUT_S: how long one kernel may take to compile in a compile worker."""
    return _seconds("TUNECACHE_COMPILE_TIMEOUT_S", 600.0)


def max_candidates() -> int | None:
    """TUNECACHE_MAX_CANDIDATES caps how many configs one tuning run benchmarks: 0 searches the
    whole pruned space. Unset, a tune times the 16 (or 32) the learned ranking puts first
    (tunecache.tuning.ranking), or 48 of the backend's static order where nothing is known."""
    v = os.environ.get("TUNECACHE_MAX_CANDIDATES", "48")
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"TUNECACHE_MAX_CANDIDATES must be an integer, got {v!r}") from None
    if n < 0:
        raise ValueError(f"TUNECACHE_MAX_CANDIDATES must be >= 0, got {v!r}")
    return n or None


def max_candidates_given() -> bool:
    """Whether TUNECACHE_MAX_CANDIDATES is set (then it is the breadth of every tune)."""
    return bool(os.environ.get("TUNECACHE_MAX_CANDIDATES", "").strip())


def trees_dir() -> Path:
    """TUNECACHE_TREES_DIR, else `trees` under the user cache dir: where `tunecache learn` writes
    the trees this host's tunes rank candidates by (the package's own where it wrote none)."""
    given = os.environ.get("TUNECACHE_TREES_DIR", "").strip()
    if given:
        return Path(given)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("tunecache")) / "trees"


def ranking_learned() -> bool:
    """TUNECACHE_RANKING: `learned` (the default) orders a tune's candidates by past trials of
    the kernel (shipped, the store's, the fleet's); `static` keeps the backend's own order."""
    v = os.environ.get("TUNECACHE_RANKING", "learned").strip().lower()
    if v not in ("learned", "static"):
        raise ValueError(f"TUNECACHE_RANKING must be 'learned' or 'static', got {v!r}")
    return v == "learned"


# ---- the fleet client -------------------------------------------------------------------
# Read when a FleetClient is built. A bad value raises ValueError naming the variable; the
# client warns and uses the default below, so a typo never fails the user's kernel call.

SERVER_TIMEOUT_S = 2.0
SERVER_MAX_BYTES = 4 << 20  # the largest legitimate answer (a config record, a job) is a few KiB
BREAKER_FAILURES = 3
BREAKER_OPEN_S = 30.0


def _env_number(name: str, default: float, kind: type, minimum: float, strict: bool) -> float:
    """The variable as `kind` (int or float): finite and >= minimum (> minimum when strict)."""
    v = os.environ.get(name, "").strip()
    if not v:
        return kind(default)
    what = "an integer" if kind is int else "a number"
    bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
    try:
        x = kind(v)
    except ValueError:
        raise ValueError(f"{name} must be {what} {bound}, got {v!r}") from None
    if not minimum <= x < float("inf") or (strict and x == minimum):  # NaN fails the comparison too
        raise ValueError(f"{name} must be {what} {bound}, got {v!r}")
    return x


def server_timeout_s() -> float:
    """TUNECACHE_SERVER_TIMEOUT_S: the whole of one fleet request (connect, send, answer)."""
    return _env_number("TUNECACHE_SERVER_TIMEOUT_S", SERVER_TIMEOUT_S, float, 0, strict=True)


def server_max_bytes() -> int:
    """TUNECACHE_SERVER_MAX_BYTES: the largest fleet answer the client reads."""
    return _env_number("TUNECACHE_SERVER_MAX_BYTES", SERVER_MAX_BYTES, int, 0, strict=True)


def breaker_failures() -> int:
    """TUNECACHE_BREAKER_FAILURES: failures in a row that open the client's circuit breaker."""
    return _env_number("TUNECACHE_BREAKER_FAILURES", BREAKER_FAILURES, int, 1, strict=False)


def breaker_open_s() -> float:
    """TUNECACHE_BREAKER_OPEN_S: how long an open breaker skips the fleet."""
    return _env_number("TUNECACHE_BREAKER_OPEN_S", BREAKER_OPEN_S, float, 0, strict=False)


def server_ca() -> tuple[str, str] | None:
    """Whom the fleet client trusts for https://, as (variable, path): TUNECACHE_CA_BUNDLE (a
    PEM file, or a directory hashed as by `openssl rehash`), else SSL_CERT_FILE, else
    SSL_CERT_DIR; None for the default bundle (certifi). A path that does not exist raises."""
    for name in ("TUNECACHE_CA_BUNDLE", "SSL_CERT_FILE", "SSL_CERT_DIR"):
        path = os.environ.get(name, "").strip()
        if path:
            if not os.path.exists(path):
                raise ValueError(f"{name}={path!r}: no such file or directory")
            return name, path
    return None


# ---- the local store ----------------------------------------------------------------------

DB_BUSY_TIMEOUT_S = 60.0


def db_busy_timeout_s() -> float:
    """TUNECACHE_DB_BUSY_TIMEOUT_S: how long a SQLite store waits for another process's write
    lock before the call fails with "database is locked" (read when a store is opened)."""
    return _seconds("TUNECACHE_DB_BUSY_TIMEOUT_S", DB_BUSY_TIMEOUT_S)


# ---- the fleet service: limits on what one client may consume ------------------------------
# Read when the app is created; a bad value fails `tunecache serve` at start, naming the variable.

RATE_LIMIT = 50.0  # requests per second, per token and client address
RATE_BURST = 200
ANON_RATE_LIMIT = 20.0  # per client address, for what costs the database without a valid token
ANON_RATE_BURST = 100
BODY_TIMEOUT_S = 10.0
LOOKUP_CACHE_S = 10.0  # how long a service process answers a lookup from memory (the token cache's lag)
JOB_TTL_S = 7 * 86400.0


def rate_limit() -> tuple[float, int]:
    """TUNECACHE_RATE_LIMIT (requests per second; 0 turns the limit off) and
    TUNECACHE_RATE_BURST: what one token may send from one client address."""
    return (
        _env_number("TUNECACHE_RATE_LIMIT", RATE_LIMIT, float, 0, strict=False),
        _env_number("TUNECACHE_RATE_BURST", RATE_BURST, int, 1, strict=False),
    )


def anon_rate_limit() -> tuple[float, int]:
    """TUNECACHE_ANON_RATE_LIMIT and TUNECACHE_ANON_RATE_BURST: the same per client address for
    what costs the database without a valid token (anonymous reads, /healthz, /metrics, a
    token looked up and not found)."""
    return (
        _env_number("TUNECACHE_ANON_RATE_LIMIT", ANON_RATE_LIMIT, float, 0, strict=False),
        _env_number("TUNECACHE_ANON_RATE_BURST", ANON_RATE_BURST, int, 1, strict=False),
    )


def rate_limit_storage() -> str:
    """TUNECACHE_RATE_LIMIT_STORAGE: where the counters live, as a `limits` storage URI
    (memory://, the default, counts per service process; redis://host:6379 shares them)."""
    return os.environ.get("TUNECACHE_RATE_LIMIT_STORAGE", "").strip() or "memory://"


def lookup_cache_s() -> float:
    """TUNECACHE_LOOKUP_CACHE_S: a service process answers lookups from memory; a change made
    through another process or on the database is seen within this time (a write through the
    process at once; see tunecache.server.lookups); 0 asks the database every time."""
    return _env_number("TUNECACHE_LOOKUP_CACHE_S", LOOKUP_CACHE_S, float, 0, strict=False)


def body_timeout_s() -> float:
    """TUNECACHE_BODY_TIMEOUT_S: how long a client may take to send a request's whole body
    (/v1/import: at least 60 s) before the service answers 408 and closes the connection."""
    return _env_number("TUNECACHE_BODY_TIMEOUT_S", BODY_TIMEOUT_S, float, 0, strict=True)


def job_ttl_s() -> float:
    """TUNECACHE_JOB_TTL_S: how long a job may wait queued (since it last became queued) before
    it expires: marked failed, saying so (Store._expire_queued: `tunecache db prune`)."""
    return _env_number("TUNECACHE_JOB_TTL_S", JOB_TTL_S, float, 0, strict=True)


# the service's edges and a token's footprint (docs/fleet.md, "Limits and retention")
MAX_HEADER_BYTES = 64 << 10  # a request's line and headers; more is a 431 at once
HEADER_TIMEOUT_S = 10.0  # a request's headers must be in within this (else 408, closed)
CONNECTIONS_PER_ADDRESS = 256  # open connections one client address may hold per process
MAX_CONNECTIONS = 4096  # open connections per process (more are answered 503)
BYTES_PER_DAY = 128 << 20  # request bodies a token may send from one address in any 24 h
TRIALS_PER_KEY = 2000  # trials kept per key, the newest
RETENTION_S = 30 * 86400.0  # trials, submissions and finished jobs older than this are pruned
PUBLISH_SHARE = 0.15  # of a service process's time that publishes may take (lookups keep the rest)


def max_header_bytes() -> int:
    """TUNECACHE_MAX_HEADER_BYTES: the largest request line and headers the service reads; a
    request with more is answered 431 and closed before the rest is read."""
    return int(_env_number("TUNECACHE_MAX_HEADER_BYTES", MAX_HEADER_BYTES, int, 1024, strict=False))


def header_timeout_s() -> float:
    """TUNECACHE_HEADER_TIMEOUT_S: how long a connection may take to send a request's headers
    (from its opening, or from the end of its previous answer) before it is answered 408 and
    closed."""
    return _env_number("TUNECACHE_HEADER_TIMEOUT_S", HEADER_TIMEOUT_S, float, 0, strict=True)


def connections_per_address() -> int:
    """TUNECACHE_CONNECTIONS_PER_ADDRESS: open connections one client address may hold in one
    service process; one more is answered 429 and closed (behind a reverse proxy every client
    is the proxy's address: raise it there)."""
    return int(_env_number("TUNECACHE_CONNECTIONS_PER_ADDRESS", CONNECTIONS_PER_ADDRESS, int, 1, strict=False))


def max_connections() -> int:
    """TUNECACHE_MAX_CONNECTIONS: open connections (and requests) one service process holds at
    once; past it uvicorn answers 503 (what bounds the process's memory)."""
    return int(_env_number("TUNECACHE_MAX_CONNECTIONS", MAX_CONNECTIONS, int, 16, strict=False))


def bytes_per_day() -> int:
    """TUNECACHE_BYTES_PER_DAY: request-body bytes one token may send from one client address in
    any 24 hours (429 with Retry-After past it; 0: no limit)."""
    return int(_env_number("TUNECACHE_BYTES_PER_DAY", BYTES_PER_DAY, int, 0, strict=False))


def trials_per_key() -> int:
    """TUNECACHE_TRIALS_PER_KEY: trials the fleet's store keeps per key (the newest; older ones
    are deleted as new ones come)."""
    return int(_env_number("TUNECACHE_TRIALS_PER_KEY", TRIALS_PER_KEY, int, 1, strict=False))


def retention_s() -> float:
    """TUNECACHE_RETENTION_S: the service prunes trials, submissions and finished jobs older
    than this, once an hour (as `tunecache db prune --older-than`; 0: never)."""
    return _env_number("TUNECACHE_RETENTION_S", RETENTION_S, float, 0, strict=False)


def publish_share() -> float:
    """TUNECACHE_PUBLISH_SHARE: the share of a service process's time that publishes may take
    (one at a time, each followed by a pause that keeps them within it: tunecache.server.pacing);
    lookups keep the rest. 1: no pacing."""
    share = _env_number("TUNECACHE_PUBLISH_SHARE", PUBLISH_SHARE, float, 0, strict=True)
    if share > 1:
        raise ValueError(f"TUNECACHE_PUBLISH_SHARE must be a share of the time, above 0 and at most 1, got {share}")
    return share


def metrics_address() -> tuple[str, int] | None:
    """TUNECACHE_METRICS_HOST and TUNECACHE_METRICS_PORT (`tunecache serve --metrics-port`):
    serve /metrics there instead of on the API's port; None when no port is set."""
    port = os.environ.get("TUNECACHE_METRICS_PORT", "").strip()
    if not port:
        return None
    n = _env_number("TUNECACHE_METRICS_PORT", 0, int, 1, strict=False)
    if n > 65535:
        raise ValueError(f"TUNECACHE_METRICS_PORT must be a port number, got {port!r}")
    return os.environ.get("TUNECACHE_METRICS_HOST", "").strip() or "127.0.0.1", n


# ---- read elsewhere before: the service, the store's pool, devices, compiling, launching ----------

SERVER_THREADS = 16
MAX_BODY_BYTES = 1 << 20  # one published result with thousands of trials fits easily
DB_POOL_SIZE = 16
DB_MAX_OVERFLOW = 16


def _flag(name: str, default: bool) -> bool:
    v = os.environ.get(name, "").strip().lower()
    if not v:
        return default
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 1/true/yes/on or 0/false/no/off, got {v!r}")


def server_threads() -> int:
    """TUNECACHE_SERVER_THREADS: requests the service runs at once per process (within the DB pool)."""
    return int(_env_number("TUNECACHE_SERVER_THREADS", SERVER_THREADS, int, 1, strict=False))


def anonymous_read() -> bool:
    """TUNECACHE_ANONYMOUS_READ: the service answers reads without a token."""
    return _flag("TUNECACHE_ANONYMOUS_READ", False)


def max_body_bytes() -> int:
    """TUNECACHE_MAX_BODY_BYTES: the largest request body the service reads (imports get 64 MiB)."""
    return int(_env_number("TUNECACHE_MAX_BODY_BYTES", MAX_BODY_BYTES, int, 1024, strict=False))


def db_pool() -> tuple[int, int]:
    """TUNECACHE_DB_POOL_SIZE, TUNECACHE_DB_MAX_OVERFLOW: Postgres connections per process."""
    return (
        int(_env_number("TUNECACHE_DB_POOL_SIZE", DB_POOL_SIZE, int, 1, strict=False)),
        int(_env_number("TUNECACHE_DB_MAX_OVERFLOW", DB_MAX_OVERFLOW, int, 0, strict=False)),
    )


def device_override() -> str | None:
    """TUNECACHE_DEVICE: device facts given by hand, `sm_90:132[:name]` (key for another class)."""
    return os.environ.get("TUNECACHE_DEVICE") or None


def triton_interpret() -> bool:
    """TRITON_INTERPRET, Triton's own variable, read as Triton reads it but without importing
    Triton (it takes effect for @jit functions created after it is set)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes", "y")


def compile_workers() -> int | None:
    """TUNECACHE_COMPILE_WORKERS: compile processes (default: one per CPU core, shared among the
    job's processes of this host, `local_ranks`)."""
    if not os.environ.get("TUNECACHE_COMPILE_WORKERS", "").strip():
        return None
    return int(_env_number("TUNECACHE_COMPILE_WORKERS", 1, int, 1, strict=False))


def local_ranks() -> int:
    """How many processes of a job run on this host, as torchrun says (LOCAL_WORLD_SIZE); 1
    when not set or not a positive integer (not a tunecache setting: never an error)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def gluon_direct_launch() -> bool:
    """TUNECACHE_GLUON_DIRECT_LAUNCH: the Hopper backends launch compiled kernels directly (on by
    default; 0 goes through JITFunction.run every call)."""
    return _flag("TUNECACHE_GLUON_DIRECT_LAUNCH", True)


def runner_server() -> bool:
    """TUNECACHE_RUNNER_SERVER: trial runners are forked from a per-host server that has
    imported torch already (a process's first tune skips seconds of imports); 0 starts each
    runner as a fresh process."""
    return _flag("TUNECACHE_RUNNER_SERVER", True)


def runner_server_idle_s() -> float:
    """TUNECACHE_RUNNER_SERVER_IDLE_S: the runner server exits after this long with no runner
    alive and no request."""
    return _seconds("TUNECACHE_RUNNER_SERVER_IDLE_S", 900.0)


def runtime_dir() -> Path:
    """TUNECACHE_RUNTIME_DIR, else the user's runtime directory (XDG_RUNTIME_DIR), else a
    directory of this user's under the system's temporary one: the runner server's socket."""
    given = os.environ.get("TUNECACHE_RUNTIME_DIR", "").strip()
    if given:
        return Path(given)
    xdg = os.environ.get("XDG_RUNTIME_DIR", "").strip()
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "tunecache"
    import tempfile

    return Path(tempfile.gettempdir()) / f"tunecache-{os.getuid()}"


def vendor_competes() -> bool:
    """TUNECACHE_VENDOR (default on): the vendor's op (cuBLAS / cuDNN, as torch calls them) is a
    candidate of every tune on a GPU and wins where it is faster, so a tuned call is never slower
    than torch's own; off: the kernels alone (what the kernel benchmarks measure)."""
    return _flag("TUNECACHE_VENDOR", True)
