"""The service's request and response bodies (pydantic).

Bounds mirror the database columns, so a value the database would refuse (an over-long
string, a NUL byte, an integer past int32, a NaN) is a 422 here and never a 500 there.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Annotated, Any, Iterable, Literal, Optional, Self, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, StringConstraints

from tunecache.store.records import (
    ANNOUNCE_S,
    ANNOUNCE_STATES,
    MAX_BACKOFF_S,
    MAX_ENQUEUE_BATCH,
    MAX_LEASE_S,
    MAX_STATUS_DIGESTS,
    Announcement,
)

INT32_MAX = 2**31 - 1
JSON_MAX_DEPTH = 8
JSON_MAX_ITEMS = 256
# a config's or a trial's strings and keys (a meta-parameter's name or value): a word, not a file
JSON_MAX_STRING = 256
# a problem's strings (a dtype, a layout): a problem is a few numbers and words, not 900 KB
PROBLEM_MAX_STRING = 64
# one publish writes its trials in one transaction: a cap keeps that short for everyone else
MAX_TRIALS_PER_PUBLISH = 2000


def _clean_str(s: str) -> str:
    """Postgres text cannot hold NUL, and a lone surrogate cannot be encoded to UTF-8."""
    if "\x00" in s:
        raise ValueError("strings must not contain NUL characters")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("strings must be valid Unicode (no lone surrogates)") from None
    return s


def _clean_json(value: Any, depth: int = 0) -> Any:
    """A JSON value the store can keep: finite numbers, clean strings, bounded nesting. The
    scalars of an object or array are checked in one loop (`_clean_values`), not by a call
    each: a 2,000-trial publish holds some 14,000 of them, and a call per value was two thirds
    of its validation."""
    if depth > JSON_MAX_DEPTH:
        raise ValueError(f"JSON nested deeper than {JSON_MAX_DEPTH} levels")
    if isinstance(value, dict):
        if len(value) > JSON_MAX_ITEMS:
            raise ValueError(f"objects may have at most {JSON_MAX_ITEMS} entries")
        for k in value:
            if len(k) > JSON_MAX_STRING:
                raise ValueError(f"keys may have at most {JSON_MAX_STRING} characters")
            if not k.isascii() or "\x00" in k:
                _clean_str(k)
        _clean_values(value.values(), depth)
    elif isinstance(value, list):
        if len(value) > JSON_MAX_ITEMS:
            raise ValueError(f"arrays may have at most {JSON_MAX_ITEMS} items")
        _clean_values(value, depth)
    else:
        _clean_values((value,), depth - 1)
    return value


def _clean_values(values: Iterable[Any], depth: int) -> None:
    """The values of a container at `depth`: scalars here, containers one level deeper."""
    for v in values:
        t = type(v)
        if t is int:
            if not -(2**63) < v < 2**63:
                raise ValueError("integers must fit in 64 bits")
        elif t is float:
            if not math.isfinite(v):
                raise ValueError("numbers must be finite (no NaN or Infinity)")
        elif t is str:
            if len(v) > JSON_MAX_STRING:
                raise ValueError(f"strings may have at most {JSON_MAX_STRING} characters")
            if not v.isascii() or "\x00" in v:
                _clean_str(v)
        elif t is bool or v is None:
            pass
        elif isinstance(v, (dict, list)):
            _clean_json(v, depth + 1)
        elif isinstance(v, bool):
            pass
        elif isinstance(v, (int, float, str)):  # a subclass (an enum): checked as its base type
            _clean_values((next(b for b in (int, float, str) if isinstance(v, b))(v),), depth)
        else:
            raise ValueError(f"unsupported JSON value of type {t.__name__}")


def _text(max_length: int, min_length: int = 0, pattern: str | None = None):
    return Annotated[
        str,
        StringConstraints(min_length=min_length, max_length=max_length, pattern=pattern),
        AfterValidator(_clean_str),
    ]


Kernel = Annotated[
    str,
    StringConstraints(min_length=1, max_length=128),
    AfterValidator(_clean_str),
    Field(
        description="'<op>.<backend>' (e.g. 'matmul.hopper') or 'triton:<module>.<name>'", examples=["matmul.portable"]
    ),
]
Version = _text(64, 1)
TritonVersion = _text(32, 1)
Arch = Annotated[
    str,
    StringConstraints(pattern=r"^(sm_[0-9]{2,4}a?|cpu)$", max_length=16),
    Field(description="compute capability ('sm_90', 'sm_100') or 'cpu' (the interpreter)", examples=["sm_90"]),
]
SmCount = Annotated[int, Field(strict=True, ge=0, le=100_000, description="SM count (0 for the CPU interpreter)")]
Digest = Annotated[
    str, StringConstraints(pattern=r"^[0-9a-f]{64}$"), Field(description="sha256 of the key's canonical JSON")
]
Owner = _text(128, 1)
Name = _text(128)
FiniteNonNeg = Annotated[float, Field(strict=True, ge=0, le=1e12, allow_inf_nan=False)]
# a measured time in milliseconds: positive and finite
Millis = Annotated[float, Field(strict=True, gt=0, le=1e12, allow_inf_nan=False)]
Scalar = Union[
    StrictBool,
    StrictInt,
    Annotated[float, Field(strict=True, allow_inf_nan=False)],
    Annotated[StrictStr, StringConstraints(max_length=PROBLEM_MAX_STRING)],
    None,
]
Problem = Annotated[
    dict[Annotated[str, StringConstraints(min_length=1, max_length=64)], Scalar],
    Field(max_length=64, description="the canonical problem: dtypes, layouts, sizes"),
    AfterValidator(_clean_json),
]
JsonObject = Annotated[dict[str, Any], AfterValidator(_clean_json)]


def _utc_naive(value: Optional[datetime]) -> Optional[datetime]:
    if value is None:
        return None
    if not 2000 <= value.year <= 2200:
        raise ValueError("timestamps must lie between the years 2000 and 2200")
    if value.tzinfo is not None:
        value = value.astimezone(timezone.utc).replace(tzinfo=None)
    return value


Timestamp = Annotated[Optional[datetime], AfterValidator(_utc_naive)]
# the store keeps naive UTC; answers say so (RFC 3339 wants an offset)
UtcTime = Annotated[datetime, AfterValidator(lambda d: d if d.tzinfo else d.replace(tzinfo=timezone.utc))]


class Model(BaseModel):
    """A request body: unknown fields and coerced types (a string for a number) are refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class KeyIn(Model):
    """The key of a tuning result: kernel, versions, device class and problem (what `tunecache
    key` prints). `digest`, when given, must match the key's fields."""

    kernel: Kernel
    kernel_version: Version
    triton_version: TritonVersion
    arch: Arch
    sm_count: SmCount
    problem: Problem
    digest: Optional[Digest] = None


class TrialIn(Model):
    config: JsonObject
    status: Literal["ok", "failed", "wrong"]
    median_ms: Optional[FiniteNonNeg] = None
    error: Optional[_text(4000)] = None


# what tuning bought: times measured in the same run as the tuned config's median_ms
DEFAULT_MS = "the backend's untuned default config's time in ms, measured in the same tuning run (null: not measured)"
VENDOR_MS = "the vendor op's time in ms (cuBLAS / cuDNN), measured in the same tuning run (null: not measured)"


class ConfigIn(KeyIn):
    """A tuning result to publish. `digest`, when given, must match the key's fields."""

    config: JsonObject = Field(description="the kernel's meta-parameters; checked against its config space")
    median_ms: Millis
    tflops: Optional[FiniteNonNeg] = None
    candidates: Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)] = 0
    default_ms: Optional[Millis] = Field(None, description=DEFAULT_MS)
    vendor_ms: Optional[Millis] = Field(None, description=VENDOR_MS)
    # provenance: the service sets it from the token (see the trust model in docs/fleet.md)
    device_name: Name = Field("", description="the GPU it ran on: kept from a worker token only")
    tuned_by: Name = Field("", description="the host that tuned it: kept from a worker token only")
    tuned_at: Timestamp = Field(None, description="kept from a worker token only")
    source: _text(16, 1, r"^[a-z_]+$") = Field(
        "inline",
        description=(
            "how it was tuned: kept from a worker token if one of worker, pretune, cli, inline; else the "
            "service sets it (worker, admin, submission)"
        ),
    )
    trials: Annotated[
        list[TrialIn],
        Field(
            max_length=MAX_TRIALS_PER_PUBLISH,
            description=(
                f"the run's trials, at most {MAX_TRIALS_PER_PUBLISH} (more is a 422): the largest config space "
                f"shipped has under 1,000 configs"
            ),
        ),
    ] = []
    tune_seconds: Optional[Annotated[float, Field(strict=True, ge=0, le=1e7, allow_inf_nan=False)]] = None


class KeyOut(BaseModel):
    kernel: str
    kernel_version: str
    triton_version: str
    arch: str
    sm_count: int
    problem: dict[str, Any]
    digest: str

    @classmethod
    def of(cls, rec: Any) -> Self:
        """This answer from a store record (a job, a submission): its key's fields, and the
        record's attribute of the same name for each other field the model declares."""
        given = rec.key.fields()
        return cls(**given, **{name: getattr(rec, name) for name in cls.model_fields.keys() - given.keys()})


class ConfigOut(KeyOut):
    config: dict[str, Any]
    median_ms: float
    tflops: Optional[float] = None
    candidates: int
    default_ms: Optional[float] = Field(None, description=DEFAULT_MS)
    vendor_ms: Optional[float] = Field(None, description=VENDOR_MS)
    device_name: str
    tuned_by: str
    tuned_at: Optional[UtcTime] = None
    source: str


class PublishOut(BaseModel):
    accepted: bool = Field(
        description="whether this submission is now the stored winner (only a worker's or an admin's result can be)"
    )
    status: Literal["won", "kept_existing", "queued", "recorded"] = Field(
        description="won: the new winner; kept_existing: a worker's result that did not beat the stored one; "
        "queued: a publish token's result, recorded, and the key queued for a worker of its device "
        "class to tune (re-time) before anything changes; recorded: a publish token's result that "
        "does not beat the winner, or whose winner was re-timed already: recorded only"
    )
    submission_id: int
    kept: Optional[ConfigOut] = Field(
        description="the winner stored for this key after the publish (null: none "
        "yet, e.g. while a submission waits for its re-timing)"
    )
    job: Optional[str] = Field(None, description="queued: the status of the key's tuning job")


class PurgeIn(Model):
    token_name: Name = Field(
        min_length=1, description="the token whose submissions and winners are removed (every token that had this name)"
    )
    dry_run: StrictBool = Field(False, description="say what would be removed; change nothing")


class PurgeOut(BaseModel):
    token_name: str
    dry_run: bool
    removed: list[ConfigOut] = Field(description="the winners the token's submissions had made, now removed")
    jobs: dict[str, str] = Field(
        description="{digest: the status of its tuning job}: queued again, or failed (then `tunecache jobs retry`)"
    )
    submissions_removed: int
    generation: int = Field(description="the fleet's generation after; hosts drop their copies when it moved")


class SubmissionOut(KeyOut):
    id: int
    config: dict[str, Any]
    median_ms: float
    tflops: Optional[float] = None
    candidates: int
    default_ms: Optional[float] = Field(None, description=DEFAULT_MS)
    vendor_ms: Optional[float] = Field(None, description=VENDOR_MS)
    device_name: str
    tuned_by: str
    source: str
    submitted_by: str
    accepted: bool
    tune_seconds: Optional[float] = None
    created_at: UtcTime


class DeleteOut(BaseModel):
    deleted: bool


class GenerationOut(BaseModel):
    generation: int = Field(
        description="moves whenever a winner is removed or replaced; hosts recheck their copies when it does"
    )


class ReportIn(Model):
    """A host could not launch the fleet's config for this key (it raised, or its own pruning
    for the device refused it)."""

    config: JsonObject
    error: _text(4000, 1)


class ReportOut(BaseModel):
    recorded: bool = Field(description="the report was kept as a failed trial of the key")
    job: Optional[str] = Field(None, description="the status of the re-tuning job it queued, if any")


class ExportOut(BaseModel):
    format: str
    configs: list[ConfigOut]


class ImportIn(Model):
    format: Literal["tunecache-configs/1"]
    configs: Annotated[list[Any], Field(max_length=100_000)]


class ImportOut(BaseModel):
    stored: int
    kept: int
    rejected: list[str]


class EnqueueIn(KeyIn):
    priority: Annotated[int, Field(strict=True, ge=-1000, le=1000)] = 0
    max_attempts: Annotated[int, Field(strict=True, ge=1, le=100)] = 3


class EnqueueManyIn(Model):
    jobs: list[EnqueueIn] = Field(max_length=MAX_ENQUEUE_BATCH, description="the keys to tune, in queue order")


class EnqueueManyOut(BaseModel):
    tuned: list[str] = Field(description="digests the fleet has a tuned config for: not enqueued")
    queued: list[str] = Field(description="digests enqueued (or whose job was already queued or running)")


class JobOut(KeyOut):
    id: int
    status: str
    priority: int
    attempts: int
    max_attempts: int
    lease_owner: Optional[str] = Field(None, description="the lease holder's name (display only)")
    lease_expires_at: Optional[UtcTime] = None
    not_before: Optional[UtcTime] = Field(
        None, description="a queued job is not claimed before this time (its backoff after a failure)"
    )
    created_at: Optional[UtcTime] = None
    last_error: Optional[str] = None
    unreadable: Optional[str] = Field(
        None,
        description="why the row's fields cannot be read (its problem is "
        "shown empty); such a job is quarantined, never claimed",
    )
    retime: bool = Field(
        False,
        description="a re-timing: the key has a winner and a submission claimed to beat it; a worker tunes it even so",
    )


class StatusesIn(Model):
    digests: list[Digest] = Field(max_length=MAX_STATUS_DIGESTS, description="the keys' digests")


class StatusesOut(BaseModel):
    statuses: dict[str, str] = Field(description="{digest: its job's status}; a digest with no job is absent")


class QueueOut(BaseModel):
    queued: int
    running: int
    done: int
    failed: int
    quarantined: int = 0


LeaseSeconds = Annotated[
    float,
    Field(
        strict=True,
        ge=1,
        le=MAX_LEASE_S,
        allow_inf_nan=False,
        description=f"seconds, at most {MAX_LEASE_S:g} (more is a 422); heartbeats renew it",
    ),
]


class AnnounceIn(KeyIn):
    holder: Owner = Field(description="the host, in words for people (the token's name is put before it)")
    seconds: Annotated[float, Field(strict=True, ge=0, le=MAX_LEASE_S, allow_inf_nan=False)] = Field(
        ANNOUNCE_S,
        description=f"how long the announcement holds unless renewed, at most {MAX_LEASE_S:g}; 0 withdraws it",
    )


class AnnounceOut(BaseModel):
    state: Literal[ANNOUNCE_STATES] = Field(  # type: ignore[valid-type]
        description="yours: tune it; tuning: `holder` tunes it (wait at most `seconds_left`); submitted: the "
        "host that announced it submitted `hint` (a claim: time it against your default before you run it)"
    )
    holder: str = ""
    seconds_left: float = 0.0
    hint: Optional[dict[str, Any]] = None
    hint_ms: Optional[float] = None

    @classmethod
    def of(cls, a: Announcement) -> Self:
        return cls(state=a.state, holder=a.holder, seconds_left=a.seconds_left, hint=a.hint, hint_ms=a.hint_ms)


class ClaimIn(Model):
    owner: Owner = Field(
        description="the lease holder's name, for people (the dashboard, `tunecache jobs "
        "ls`); the lease itself is held by the secret the claim returns"
    )
    arch: Arch
    sm_count: SmCount
    lease_s: LeaseSeconds = 60.0
    kernels: Optional[Annotated[list[Kernel], Field(max_length=1000)]] = None
    kernel_versions: Optional[Annotated[dict[Kernel, Version], Field(max_length=1000)]] = Field(
        None, description="{kernel: version} this worker runs; only jobs it reproduces are claimed"
    )
    triton_version: Optional[TritonVersion] = None


class ClaimOut(BaseModel):
    job: Optional[JobOut] = Field(description="the leased job, or null when none is waiting")
    lease_secret: Optional[str] = Field(
        None,
        description="the lease's secret, returned once (the service keeps "
        "only its hash): heartbeat, complete, fail and release "
        "must send it",
    )


class LeaseHeldIn(Model):
    """A call on a leased job: the lease's secret (from the claim) says who holds it."""

    lease_secret: Optional[_text(128)] = Field(
        None, description="the secret the claim returned (required: without it the call is a 403)"
    )
    owner: Optional[Owner] = Field(
        None, description="ignored: the secret holds the lease; the owner named in the claim is kept, for display only"
    )


class LeaseIn(LeaseHeldIn):
    lease_s: LeaseSeconds = 60.0


class CompleteIn(LeaseHeldIn):
    tune_seconds: Optional[Annotated[float, Field(strict=True, ge=0, le=1e7, allow_inf_nan=False)]] = None


class FailIn(LeaseHeldIn):
    error: _text(8000)
    backoff_s: Annotated[
        float,
        Field(
            strict=True,
            ge=0,
            le=MAX_BACKOFF_S,
            allow_inf_nan=False,
            description=f"seconds before the next attempt, doubling per attempt; at most "
            f"{MAX_BACKOFF_S:g} (more is a 422)",
        ),
    ] = 5.0


class ReleaseIn(LeaseHeldIn):
    pass


class JobStatusOut(BaseModel):
    id: int
    status: str


class QueueHealthOut(BaseModel):
    """One device class's queue."""

    arch: str
    sm_count: int
    waiting: int = Field(description="jobs a worker could claim now")
    oldest_wait_s: float = Field(description="how long the oldest of them has waited (the database's clock)")
    running: int = Field(description="live leases")
    stuck: bool = Field(description="work has waited past the threshold and no worker of this class holds a lease")


class HealthOut(BaseModel):
    status: Literal["ok"]
    database: str
    schema_revision: Optional[str] = None
    queue_stuck: bool = Field(
        False,
        description="some device class's queue is stuck (see `queue`); the status "
        "stays 200: the service itself is fine",
    )
    stuck_after_s: Optional[float] = Field(None, description="the threshold (TUNECACHE_QUEUE_STUCK_S)")
    quarantined_jobs: int = Field(
        0, description="jobs whose rows cannot be read (`tunecache jobs ls --status quarantined`)"
    )
    queue: list[QueueHealthOut] = Field([], description="per device class with waiting or running jobs")


class ErrorOut(BaseModel):
    detail: str = Field(description="what was wrong, in words")
    errors: Optional[list[dict[str, Any]]] = Field(None, description="per-field validation errors")


# ---- a winner's compiled kernels, and a host's sync -----------------------------------------

TritonHash = Annotated[
    str, StringConstraints(pattern=r"^[0-9a-f]{64}$"), Field(description="Triton's cache key: the entry's directory")
]
# base64 of at most MAX_BINARY_BYTES (tunecache.tuning.binaries), checked there once decoded
Base64File = Annotated[str, StringConstraints(max_length=6 << 20, pattern=r"^[A-Za-z0-9+/=]*$")]


class BinaryJson(Model):
    """One of Triton's cache entries for a kernel: its metadata (`NAME.json`) and its cubin
    (`NAME.cubin`), base64."""

    triton_hash: TritonHash
    files: Annotated[dict[Annotated[str, StringConstraints(max_length=160)], Base64File], Field(max_length=2)]


class BinariesIn(Model):
    """The compiled kernels a launch of the winner's `config` uses, as the tuning host's Triton
    cached them."""

    config: JsonObject
    binaries: Annotated[list[BinaryJson], Field(max_length=4)]


class BinariesOut(BaseModel):
    digest: str
    config: dict[str, Any]
    binaries: list[BinaryJson]


class TrialsOut(BaseModel):
    """Trusted trials of one kernel on one architecture, newest first, packed: each problem and
    config once, rows of [problem index, config index, milliseconds]. What a host ranks its
    tunes' candidates by (tunecache.tuning.ranking); a submission's claimed times are left out."""

    kernel: str
    arch: str
    problems: list[dict[str, Any]]
    configs: list[dict[str, Any]]
    rows: list[Annotated[list[Union[int, float]], Field(min_length=3, max_length=3)]] = Field(
        description="[problem index, config index, milliseconds]"
    )


class SyncIn(Model):
    """A host's device class, its Triton, and the versions of the kernels it runs."""

    arch: Arch
    sm_count: SmCount
    triton_version: TritonVersion
    kernel_versions: Optional[Annotated[dict[Kernel, Version], Field(max_length=256)]] = Field(
        None, description="kernel -> version; the winners of these only (all kernels when absent)"
    )
    binaries: StrictBool = Field(True, description="with the winners' compiled kernels")


class BinariesStoredOut(BaseModel):
    stored: int = Field(description="compiled kernels kept for the winner (its earlier ones replaced)")


class SyncOut(BaseModel):
    generation: int
    configs: list[ConfigOut]
    binaries: dict[str, list[BinaryJson]] = Field(description="digest -> the winner's compiled kernels")
    more_binaries: list[str] = Field(
        default_factory=list,
        description="digests whose compiled kernels did not fit this answer: GET /v1/configs/{digest}/binaries each",
    )
