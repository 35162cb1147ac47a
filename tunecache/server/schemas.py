"""The service's request and response bodies (pydantic).

Bounds mirror the database columns, so a value the database would refuse (an over-long
string, a NUL byte, an integer past int32, a NaN) is a 422 here and never a 500 there.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr,
                      StringConstraints)

INT32_MAX = 2**31 - 1
JSON_MAX_DEPTH = 8
JSON_MAX_ITEMS = 256


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
    """A JSON value the store can keep: finite numbers, clean strings, bounded nesting."""
    if depth > JSON_MAX_DEPTH:
        raise ValueError(f"JSON nested deeper than {JSON_MAX_DEPTH} levels")
    if isinstance(value, str):
        _clean_str(value)
    elif isinstance(value, bool) or value is None:
        pass
    elif isinstance(value, int):
        if abs(value) >= 2**63:
            raise ValueError("integers must fit in 64 bits")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("numbers must be finite (no NaN or Infinity)")
    elif isinstance(value, dict):
        if len(value) > JSON_MAX_ITEMS:
            raise ValueError(f"objects may have at most {JSON_MAX_ITEMS} entries")
        for k, v in value.items():
            _clean_str(k)
            _clean_json(v, depth + 1)
    elif isinstance(value, list):
        if len(value) > JSON_MAX_ITEMS:
            raise ValueError(f"arrays may have at most {JSON_MAX_ITEMS} items")
        for v in value:
            _clean_json(v, depth + 1)
    else:
        raise ValueError(f"unsupported JSON value of type {type(value).__name__}")
    return value


def _text(max_length: int, min_length: int = 0, pattern: str | None = None):
    return Annotated[str, StringConstraints(min_length=min_length, max_length=max_length, pattern=pattern),
                     AfterValidator(_clean_str)]


Kernel = Annotated[str, StringConstraints(min_length=1, max_length=128), AfterValidator(_clean_str),
                   Field(description="'<op>.<backend>' (e.g. 'matmul.hopper') or 'triton:<module>.<name>'",
                         examples=["matmul.portable"])]
Version = _text(64, 1)
TritonVersion = _text(32, 1)
Arch = Annotated[str, StringConstraints(pattern=r"^(sm_[0-9]{2,4}a?|cpu)$", max_length=16),
                 Field(description="compute capability ('sm_90', 'sm_100') or 'cpu' (the interpreter)",
                       examples=["sm_90"])]
SmCount = Annotated[int, Field(strict=True, ge=0, le=100_000, description="SM count (0 for the CPU interpreter)")]
Digest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$"),
                   Field(description="sha256 of the key's canonical JSON")]
Owner = _text(128, 1)
Name = _text(128)
FiniteNonNeg = Annotated[float, Field(strict=True, ge=0, le=1e12, allow_inf_nan=False)]
Scalar = Union[StrictBool, StrictInt, Annotated[float, Field(strict=True, allow_inf_nan=False)], StrictStr, None]
Problem = Annotated[dict[Annotated[str, StringConstraints(min_length=1, max_length=64)], Scalar],
                    Field(max_length=64, description="the canonical problem: dtypes, layouts, sizes"),
                    AfterValidator(_clean_json)]
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
    """The key of a tuning result: kernel, versions, device class and problem."""

    kernel: Kernel
    kernel_version: Version
    triton_version: TritonVersion
    arch: Arch
    sm_count: SmCount
    problem: Problem


class TrialIn(Model):
    config: JsonObject
    status: Literal["ok", "failed", "wrong"]
    median_ms: Optional[FiniteNonNeg] = None
    error: Optional[_text(4000)] = None


class ConfigIn(KeyIn):
    """A tuning result to publish. `digest`, when given, must match the key's fields."""

    digest: Optional[Digest] = None
    config: JsonObject = Field(description="the kernel's meta-parameters; checked against its config space")
    median_ms: Annotated[float, Field(strict=True, gt=0, le=1e12, allow_inf_nan=False)]
    tflops: Optional[FiniteNonNeg] = None
    candidates: Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)] = 0
    device_name: Name = ""
    tuned_by: Name = ""
    tuned_at: Timestamp = None
    source: _text(16, 1, r"^[a-z_]+$") = "inline"
    trials: Annotated[list[TrialIn], Field(max_length=20_000)] = []
    tune_seconds: Optional[Annotated[float, Field(strict=True, ge=0, le=1e7, allow_inf_nan=False)]] = None


class KeyOut(BaseModel):
    kernel: str
    kernel_version: str
    triton_version: str
    arch: str
    sm_count: int
    problem: dict[str, Any]
    digest: str


class ConfigOut(KeyOut):
    config: dict[str, Any]
    median_ms: float
    tflops: Optional[float] = None
    candidates: int
    device_name: str
    tuned_by: str
    tuned_at: Optional[UtcTime] = None
    source: str


class PublishOut(BaseModel):
    accepted: bool = Field(description="whether this submission is now the stored winner")
    submission_id: int
    kept: ConfigOut = Field(description="the winner stored for this key after the publish")


class SubmissionOut(KeyOut):
    id: int
    config: dict[str, Any]
    median_ms: float
    tflops: Optional[float] = None
    candidates: int
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
    generation: int = Field(description="moves whenever a winner is removed or replaced; hosts recheck "
                                        "their copies when it does")


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


class JobOut(KeyOut):
    id: int
    status: str
    priority: int
    attempts: int
    max_attempts: int
    lease_owner: Optional[str] = None
    lease_expires_at: Optional[UtcTime] = None
    last_error: Optional[str] = None


class QueueOut(BaseModel):
    queued: int
    running: int
    done: int
    failed: int


class ClaimIn(Model):
    owner: Owner = Field(description="the lease holder, unique per worker process")
    arch: Arch
    sm_count: SmCount
    lease_s: Annotated[float, Field(strict=True, ge=1, le=86_400, allow_inf_nan=False)] = 60.0
    kernels: Optional[Annotated[list[Kernel], Field(max_length=1000)]] = None
    kernel_versions: Optional[Annotated[dict[Kernel, Version], Field(max_length=1000)]] = Field(
        None, description="{kernel: version} this worker runs; only jobs it reproduces are claimed")
    triton_version: Optional[TritonVersion] = None


class ClaimOut(BaseModel):
    job: Optional[JobOut] = Field(description="the leased job, or null when none is waiting")


class LeaseIn(Model):
    owner: Owner
    lease_s: Annotated[float, Field(strict=True, ge=1, le=86_400, allow_inf_nan=False)] = 60.0


class CompleteIn(Model):
    owner: Owner
    tune_seconds: Optional[Annotated[float, Field(strict=True, ge=0, le=1e7, allow_inf_nan=False)]] = None


class FailIn(Model):
    owner: Owner
    error: _text(8000)
    backoff_s: Annotated[float, Field(strict=True, ge=0, le=86_400, allow_inf_nan=False)] = 5.0


class ReleaseIn(Model):
    owner: Owner


class JobStatusOut(BaseModel):
    id: int
    status: str


class HealthOut(BaseModel):
    status: Literal["ok"]
    database: str
    schema_revision: Optional[str] = None


class ErrorOut(BaseModel):
    detail: str = Field(description="what was wrong, in words")
    errors: Optional[list[dict[str, Any]]] = Field(None, description="per-field validation errors")
