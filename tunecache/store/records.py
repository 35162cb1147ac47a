"""Plain records: what the store hands out and takes in (never ORM objects), and the limits
and names that the store, the service and the client share.

No SQLAlchemy here: the fleet client, the queue adapters and the service's schemas import
this module, and a host that only talks to the fleet must not load a database layer.
`tunecache.store` re-exports every name, so `from tunecache.store import ConfigRecord` works.
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from tunecache.key import TuneKey

# The queue's caps: a lease is held at most this long without a heartbeat, and a failed job
# waits at most this long before its next attempt (the service refuses larger values with a
# 422; the store clamps to them). A client must not park a job for a day.
MAX_LEASE_S = 600.0
MAX_STATUS_DIGESTS = 1000  # digests per POST /v1/jobs/statuses (a pretune of a large model asks in a few)
MAX_ENQUEUE_BATCH = 100  # keys per POST /v1/jobs/batch (each a write: well inside a request's deadline)
MAX_BACKOFF_S = 3600.0
# quarantined: the row cannot be read (a claim met it); never claimed, kept for operators
JOB_STATUSES = ("queued", "running", "done", "failed", "quarantined")
# what a token may do; a scope implies the ones listed with it
TOKEN_SCOPES = {
    "read": ("read",),
    "publish": ("read", "publish"),
    "worker": ("read", "publish", "worker"),
    "admin": ("read", "publish", "worker", "admin"),
}


def utcnow() -> datetime:
    """Now, as naive UTC (the store keeps naive UTC)."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


def whoami() -> str:
    """This process, as `host:pid` (a result's `tuned_by`, a lease's owner)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def hash_token(secret: str) -> str:
    """The sha256 kept of an API token's or a lease's secret (the secret itself never is)."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass
class ConfigRecord:
    key: TuneKey
    config: dict
    median_ms: float
    tflops: float | None = None
    candidates: int = 0
    device_name: str = ""
    tuned_by: str = ""
    tuned_at: datetime | None = None
    source: str = "inline"
    # what tuning bought, measured in the same run as the winner: the backend's untuned default
    # config and the vendor's op (torch: cuBLAS / cuDNN on a GPU); None where not measured
    default_ms: float | None = None
    vendor_ms: float | None = None
    # local bookkeeping of fleet copies (never sent or received)
    fleet_checked_at: datetime | None = None
    fleet_generation: int | None = None
    # how long this host's tune took (wall seconds) and, of them, its trial runner's start;
    # local too: what the next tune here expects (tunecache.tuning.estimate). The fleet gets a
    # tune's seconds as a publish's `tune_seconds`, beside the record.
    tune_seconds: float | None = None
    start_seconds: float | None = None

    @property
    def digest(self) -> str:
        return self.key.digest

    def result_fields(self) -> dict:
        """The result as the fleet sends it and the store's result columns hold it: the key's
        fields, its digest, the config, its times and who tuned it where (tuned_at as it is)."""
        d = self.key.fields()
        d.update(
            digest=self.digest,
            config=self.config,
            median_ms=self.median_ms,
            tflops=self.tflops,
            candidates=self.candidates,
            device_name=self.device_name,
            tuned_by=self.tuned_by,
            tuned_at=self.tuned_at,
            source=self.source,
            default_ms=self.default_ms,
            vendor_ms=self.vendor_ms,
        )
        return d

    def to_json(self) -> dict:
        d = self.result_fields()
        d["tuned_at"] = self.tuned_at.isoformat() if self.tuned_at else None
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ConfigRecord":
        """Inverse of to_json; raises ValueError/KeyError/TypeError on a malformed entry."""
        key = TuneKey.from_fields(d)
        if "digest" in d and d["digest"] != key.digest:
            raise ValueError(f"digest {d['digest']!r} does not match the key's fields")
        if not isinstance(d["config"], dict):
            raise ValueError("config must be an object")
        median = float(d["median_ms"])
        if not median > 0:
            raise ValueError(f"median_ms must be positive, got {median}")
        tuned_at = d.get("tuned_at")
        return cls(
            key=key,
            config=dict(d["config"]),
            median_ms=median,
            tflops=None if d.get("tflops") is None else float(d["tflops"]),
            candidates=int(d.get("candidates") or 0),
            device_name=str(d.get("device_name") or ""),
            tuned_by=str(d.get("tuned_by") or ""),
            tuned_at=datetime.fromisoformat(tuned_at) if tuned_at else None,
            source=str(d.get("source") or "import"),
            default_ms=_positive_or_none(d.get("default_ms"), "default_ms"),
            vendor_ms=_positive_or_none(d.get("vendor_ms"), "vendor_ms"),
        )


def _positive_or_none(v: Any, name: str) -> float | None:
    if v is None:
        return None
    f = float(v)
    if not f > 0 or f == float("inf"):
        raise ValueError(f"{name} must be a positive number of milliseconds, got {v!r}")
    return f


@dataclass
class TrialRecord:
    config: dict
    status: str  # ok | failed | wrong
    median_ms: float | None = None
    error: str | None = None


@dataclass
class JobRecord:
    """A tuning job. A row whose fields cannot be read has `unreadable` set (why), an empty
    problem in `key`, and its stored `digest`; such a job is quarantined, never claimed."""

    id: int
    key: TuneKey
    status: str
    priority: int
    attempts: int
    max_attempts: int
    lease_owner: str | None
    lease_expires_at: datetime | None
    last_error: str | None
    digest: str = ""
    not_before: datetime | None = None
    created_at: datetime | None = None
    unreadable: str | None = None
    # the lease's secret: only in claim_job's answer (the store keeps its hash)
    lease_secret: str | None = None
    # a re-timing: the key has a winner, and a submission claimed to beat it; tune even so
    retime: bool = False

    def __post_init__(self) -> None:
        self.digest = self.digest or self.key.digest


# how long an announcement holds without being renewed (a host renews it a few times a minute
# while it tunes): a host that died mid-tune keeps the others waiting at most this long
ANNOUNCE_S = 60.0
# the newest this many trusted trials of a kernel on an architecture are what the fleet serves
# to rank candidates by (Fleet.trials): a few hundred tuned problems, about 2 MB of JSON
TRIALS_SERVED = 20_000
# what an announcement says of a key (Store.announce)
ANNOUNCE_STATES = ("yours", "tuning", "submitted")


@dataclass(frozen=True)
class Announcement:
    """Who tunes a key of the fleet, as `Store.announce` answered: "yours" (the caller tunes it),
    "tuning" (`holder`, a worker's lease or another host's announcement, for `seconds_left`
    more at most), or "submitted" (the host that announced it submitted `hint`, a claim measured
    on that host only: a host that takes it times it against its default before it runs it)."""

    state: str
    holder: str = ""
    seconds_left: float = 0.0
    hint: dict | None = None
    hint_ms: float | None = None

    @property
    def mine(self) -> bool:
        return self.state == "yours"


@dataclass
class QueueWait:
    """One device class's queue as /healthz reports it."""

    arch: str
    sm_count: int
    waiting: int = 0  # jobs a worker could claim now
    oldest_wait_s: float = 0.0  # how long the oldest of them has waited (the database's clock)
    running: int = 0  # live leases


@dataclass
class SubmissionRecord:
    id: int
    key: TuneKey
    config: dict
    median_ms: float
    tflops: float | None
    candidates: int
    device_name: str
    tuned_by: str
    source: str
    submitted_by: str
    accepted: bool
    tune_seconds: float | None
    created_at: datetime
    default_ms: float | None = None
    vendor_ms: float | None = None

    @property
    def digest(self) -> str:
        return self.key.digest


@dataclass
class PurgeReport:
    """What `Store.purge_token` removed (or would, with dry_run)."""

    token_name: str
    removed: list[ConfigRecord]  # the winners the token's submissions had made
    jobs: dict[str, str]  # digest -> its tuning job's status now ("unreadable": a row that was removed as is)
    submissions: int  # the token's submissions removed
    generation: int  # the fleet's generation after
    dry_run: bool = False


@dataclass
class TokenRecord:
    id: int
    name: str
    scopes: tuple[str, ...]
    created_at: datetime
    revoked_at: datetime | None = None
    expires_at: datetime | None = None
    # seconds left before expiry by the database's clock, when verify_tokens read it
    live_for_s: float | None = None

    def allows(self, scope: str) -> bool:
        return any(scope in TOKEN_SCOPES.get(sc, ()) for sc in self.scopes)


@dataclass
class AuditRecord:
    id: int
    at: datetime
    actor: str
    actor_token_id: int | None
    action: str
    target: str
    details: Any
