"""The store's tables as SQLAlchemy rows, and how a row becomes a plain record (and a record
the values of a row).

The Alembic revisions in `tunecache_migrations` (migrations/versions) create and upgrade these
tables: a column added here needs a revision there. A winner (tuned_configs) and a submission
(submissions) hold the same tuning result: its columns are declared once, in `ResultColumns`.
Rows never leave the store; callers get the records of `tunecache.store.records`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import JSON, Boolean, DateTime, Float, Index, Integer, String, Text, UniqueConstraint, false, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from tunecache.key import TuneKey
from tunecache.store.records import ConfigRecord, JobRecord, SubmissionRecord, TokenRecord, utcnow, whoami

R = TypeVar("R")


class Base(DeclarativeBase):
    pass


class BackendColumns:
    """Which backend (its kernel, the kernel's version, Triton's) on which device class (arch,
    SM count) a row is about: a result's, a job's and a self-check's rows have these columns
    (each table declares its own indexes)."""

    kernel: Mapped[str] = mapped_column(String(128))
    kernel_version: Mapped[str] = mapped_column(String(64))
    triton_version: Mapped[str] = mapped_column(String(32))
    arch: Mapped[str] = mapped_column(String(16))
    sm_count: Mapped[int] = mapped_column(Integer)


class ResultColumns(BackendColumns):
    """A tuning result: its key, its config and times, and who tuned it where. The winner's
    row and every submission's row have these columns; each table declares its own indexes."""

    # the key (digest: sha256 of the other fields, see TuneKey): its backend and device class
    # (BackendColumns) and its problem
    digest: Mapped[str] = mapped_column(String(64))
    problem: Mapped[Any] = mapped_column(JSON)
    # the result
    config: Mapped[Any] = mapped_column(JSON)
    median_ms: Mapped[float] = mapped_column(Float)
    tflops: Mapped[float | None] = mapped_column(Float, nullable=True)
    candidates: Mapped[int] = mapped_column(Integer, default=0)
    # what tuning bought, measured in the same run: the untuned default config's time and the
    # vendor op's (cuBLAS / cuDNN); null where not measured
    default_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    vendor_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    # provenance
    device_name: Mapped[str] = mapped_column(String(128), default="")
    tuned_by: Mapped[str] = mapped_column(String(128), default="")
    tuned_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    source: Mapped[str] = mapped_column(String(16), default="inline")


class TunedConfigRow(ResultColumns, Base):
    """A key's winner: this host's result, its copy of the fleet's, or (in the fleet's store)
    the fleet's winner."""

    __tablename__ = "tuned_configs"
    __table_args__ = (
        Index("ix_tuned_configs_digest", "digest", unique=True),
        Index("ix_tuned_configs_kernel", "kernel"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # a copy of a fleet winner (source "fleet"): when this host last checked it with the fleet,
    # and the fleet's generation then (a host rechecks its copies after TUNECACHE_FLEET_TTL_S
    # or when the generation moves, which it does whenever the fleet removes or replaces one)
    fleet_checked_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    fleet_generation: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # the fleet's own bookkeeping (see Store.publish, Store.submit): the submission that made
    # this winner, and when a submission claiming to beat it queued its re-timing (once per winner)
    submission_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    retime_queued_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    # reports of hosts that could not launch this winner (Store.report): a worker's re-time
    # that finds only other configs then replaces it, slower or not (Store.publish)
    reports: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # how long the tune that made this winner took here (wall seconds), and of them the trial
    # runner's start, which a warm runner does not pay: the next tune's estimate learns from
    # them (tunecache.tuning.estimate); null where not measured here (fleet copies, imports)
    tune_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    start_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)


class SubmissionRow(ResultColumns, Base):
    """One published result, kept whether or not it became the winner (for audit and noise)."""

    __tablename__ = "submissions"
    __table_args__ = (Index("ix_submissions_digest", "digest"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    submitted_by: Mapped[str] = mapped_column(String(128), default="", index=True)
    accepted: Mapped[bool] = mapped_column(Boolean, default=False)
    tune_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class FleetMetaRow(Base):
    """Named counters of the fleet's store; `generation` moves on every removed or replaced winner."""

    __tablename__ = "fleet_meta"
    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    value: Mapped[int] = mapped_column(Integer)


class SelfCheckRow(BackendColumns, Base):
    """A backend's first-contact verdict on a device class (see tunecache.ops.selfcheck)."""

    __tablename__ = "selfchecks"
    # one verdict per backend and device class (as revision 0003 made it)
    __table_args__ = (
        UniqueConstraint(
            "kernel", "kernel_version", "triton_version", "arch", "sm_count", name="uq_selfchecks_backend_device"
        ),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    ok: Mapped[bool] = mapped_column(Boolean)
    detail: Mapped[str | None] = mapped_column(Text, nullable=True)
    seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    device_name: Mapped[str] = mapped_column(String(128), default="")
    checked_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class TuningJobRow(BackendColumns, Base):
    __tablename__ = "tuning_jobs"
    __table_args__ = (Index("ix_tuning_jobs_arch", "arch"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    digest: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    problem: Mapped[Any] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), default="queued", index=True)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer, default=3)
    # the lease: its holder's name (for people: the dashboard, `jobs ls`), the sha256 of the
    # secret its claim returned (what heartbeat, complete, fail and release must present), and
    # when it runs out. Times of the queue come from the database's clock, never a replica's.
    lease_owner: Mapped[str | None] = mapped_column(String(128), nullable=True)
    lease_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    not_before: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    # re-time a key that has a winner (a submission claimed to beat it): tune even so
    retime: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class TrialRow(Base):
    __tablename__ = "trials"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    digest: Mapped[str] = mapped_column(String(64), index=True)
    run_id: Mapped[str] = mapped_column(String(32), index=True)
    kernel: Mapped[str] = mapped_column(String(128))
    config: Mapped[Any] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16))  # ok | failed | wrong
    median_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    # measured by a host the store trusts (its own tune, a worker's or an admin's publish), not
    # only claimed by a submission: the fleet ranks candidates by trusted trials only
    trusted: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class ApiTokenRow(Base):
    """A service token: only the sha256 of the secret is stored (secrets are 256-bit random,
    so a plain hash is enough; there is nothing to brute-force)."""

    __tablename__ = "api_tokens"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    scopes: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    # one live token per name: `tunecache token revoke NAME` must mean one token
    __table_args__ = (
        Index(
            "uq_api_tokens_live_name",
            "name",
            unique=True,
            sqlite_where=text("revoked_at IS NULL"),
            postgresql_where=text("revoked_at IS NULL"),
        ),
    )


class KernelBinaryRow(Base):
    """A compiled kernel of a winner (tunecache.tuning.binaries): one of Triton's cache entries, its
    files base64 in `files`, for the config it was built for. Only the fleet's tuning hosts
    upload them; they are served only while that config is the key's winner."""

    __tablename__ = "kernel_binaries"
    __table_args__ = (UniqueConstraint("digest", "triton_hash", name="uq_kernel_binaries_digest_hash"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    digest: Mapped[str] = mapped_column(String(64), index=True)
    config: Mapped[Any] = mapped_column(JSON)
    triton_hash: Mapped[str] = mapped_column(String(64))
    files: Mapped[Any] = mapped_column(JSON)  # {file name: base64}
    size: Mapped[int] = mapped_column(Integer)
    uploaded_by: Mapped[str] = mapped_column(String(128), default="", index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class AnnouncementRow(Base):
    """A key a host of the fleet said it is tuning (`Store.announce`): the other hosts that miss
    it wait for that host's result instead of tuning it again, until `expires_at` (the host
    renews it while it tunes)."""

    __tablename__ = "tune_announcements"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    digest: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    holder: Mapped[str] = mapped_column(String(128))  # for people: the token's name and the host's words
    token_name: Mapped[str] = mapped_column(String(128))  # whose submission answers it
    created_at: Mapped[datetime] = mapped_column(DateTime)
    expires_at: Mapped[datetime] = mapped_column(DateTime)


class AuditRow(Base):
    """One admin action: who (the token, or `cli:user@host`), what, on what, when, details."""

    __tablename__ = "audit_log"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(DateTime, default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(128))
    actor_token_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(256), default="")
    details: Mapped[Any] = mapped_column(JSON, nullable=True)


# ---- rows to records, and records to rows -------------------------------------------------


def record_of(cls: type[R], row: Base, **given: Any) -> R:
    """A `cls` record of `row`: the fields `given`, and every other field from the row's column
    of the same name (a field that neither names keeps its default)."""
    return cls(**{name: getattr(row, name) for name in _same_named(cls, type(row)) if name not in given}, **given)


@functools.cache
def _same_named(cls: type, row_type: type[Base]) -> tuple[str, ...]:
    columns = row_type.__table__.c.keys()
    return tuple(f.name for f in dataclasses.fields(cls) if f.name in columns)


def key_of(row: ResultColumns | TuningJobRow) -> TuneKey:
    problem = row.problem
    if isinstance(problem, str):  # corrupt, or a row written by hand or by a foreign tool
        problem = json.loads(problem)
    if not isinstance(problem, dict):
        raise ValueError(f"problem is a {type(problem).__name__}, not an object")
    return TuneKey(row.kernel, row.kernel_version, row.triton_version, row.arch, row.sm_count, problem)


def result_values(rec: ConfigRecord) -> dict:
    """A result's columns (ResultColumns) for a winner's or a submission's row."""
    return {**rec.result_fields(), "tuned_by": rec.tuned_by or whoami(), "tuned_at": rec.tuned_at or utcnow()}


def config_record(row: TunedConfigRow) -> ConfigRecord:
    """The winner as a record; raises ValueError/TypeError/KeyError on a row that cannot be read."""
    config = row.config
    if isinstance(config, str):
        config = json.loads(config)
    if not isinstance(config, dict):
        raise ValueError(f"config is a {type(config).__name__}, not an object")
    return record_of(ConfigRecord, row, key=key_of(row), config=config)


def submission_record(row: SubmissionRow) -> SubmissionRecord:
    return record_of(SubmissionRecord, row, key=key_of(row), accepted=bool(row.accepted))


def job_record(row: TuningJobRow, lease_secret: str | None = None) -> JobRecord:
    """The row as a record; never raises: a row that cannot be read comes back `unreadable`."""
    why = None
    try:
        key = key_of(row)
        if key.digest != row.digest:
            why = f"its fields hash to {key.digest[:12]}, not to its digest"
    except (ValueError, TypeError, KeyError) as e:
        why = f"{type(e).__name__}: {str(e)[:200]}"
    if why is not None:
        key = TuneKey(
            str(row.kernel), str(row.kernel_version), str(row.triton_version), str(row.arch), int(row.sm_count or 0), {}
        )
    return record_of(JobRecord, row, key=key, unreadable=why, lease_secret=lease_secret, retime=bool(row.retime))


def token_record(row: ApiTokenRow) -> TokenRecord:
    return record_of(TokenRecord, row, scopes=tuple(filter(None, row.scopes.split(","))))
