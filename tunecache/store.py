"""The store: `Store`, the one class that reads and writes a database of tuned configs, tuning
jobs and trials, in SQLite (one host) or Postgres (the fleet, which also keeps every
submission, its API tokens and the audit log there). `default_store()` opens the process's.

Beside this module, and re-exported from it (`from tunecache.store import ConfigRecord` works):
- tunecache.records: the plain records the store takes and hands out (no SQLAlchemy: the
  client and the service's schemas import only that module);
- tunecache.rows: the tables as SQLAlchemy rows, and rows to records;
- tunecache.engine: opening a database (URLs, engine set-up, ON CONFLICT) and STORE_ERRORS;
- tunecache.faults: the store's exceptions, and a database's faults in words.

The schema is created and upgraded by the Alembic revisions in `tunecache_migrations`; a
local SQLite file is migrated on first open.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import uuid
from datetime import datetime, timedelta
from typing import Any, Iterable, Iterator, Mapping

from sqlalchemy import DateTime, and_, case, false, func, literal_column, or_, select, type_coerce, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DatabaseError, IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from .binaries import Binary
from .engine import STORE_ERRORS, dialect_insert, insert_ignore, make_engine, sqlite_path, sqlite_url
from .faults import JobStateError, NewerSchemaError, ReadOnlyStoreError, StoreError, describe_fault, fault_kind
from .key import TuneKey
from .records import (
    JOB_STATUSES,
    MAX_BACKOFF_S,
    MAX_LEASE_S,
    TOKEN_SCOPES,
    AuditRecord,
    ConfigRecord,
    JobRecord,
    PurgeReport,
    QueueWait,
    SubmissionRecord,
    TokenRecord,
    TrialRecord,
    hash_token,
    utcnow,
    whoami,
)
from .rows import (
    ApiTokenRow,
    AuditRow,
    Base,
    FleetMetaRow,
    KernelBinaryRow,
    ResultColumns,
    SelfCheckRow,
    SubmissionRow,
    TrialRow,
    TunedConfigRow,
    TuningJobRow,
    config_record,
    job_record,
    key_of,
    result_values,
    submission_record,
    token_record,
)

# the names this module has always offered: most now live in tunecache.records, .rows,
# .engine and .faults, and are re-exported here
__all__ = [
    "JOB_STATUSES",
    "MAX_BACKOFF_S",
    "MAX_LEASE_S",
    "REPLACE_MARGIN",
    "STORE_ERRORS",
    "TOKEN_SCOPES",
    "ApiTokenRow",
    "AuditRecord",
    "AuditRow",
    "Base",
    "ConfigRecord",
    "FleetMetaRow",
    "JobRecord",
    "JobStateError",
    "NewerSchemaError",
    "PurgeReport",
    "QueueWait",
    "ReadOnlyStoreError",
    "ResultColumns",
    "SelfCheckRow",
    "Store",
    "StoreError",
    "SubmissionRecord",
    "SubmissionRow",
    "TokenRecord",
    "TrialRecord",
    "TrialRow",
    "TunedConfigRow",
    "TuningJobRow",
    "default_store",
    "describe_fault",
    "fault_kind",
    "hash_token",
    "sqlite_path",
    "sqlite_url",
    "utcnow",
    "whoami",
]

log = logging.getLogger("tunecache.store")

# A new result replaces a stored one only when it is this much faster: timing noise must
# not flip the winner back and forth between hosts.
REPLACE_MARGIN = 0.03
# a claim passes over at most this many lapsed last attempts and unreadable rows per call
CLAIM_SCAN = 100
LEASE_PREFIX = "tcl_"
TOKEN_PREFIX = "tc_"


def _readable(rows: Iterable[TunedConfigRow]) -> list[ConfigRecord]:
    """The rows as records, a corrupt one reported and skipped."""
    out = []
    for row in rows:
        try:
            out.append(config_record(row))
        except (ValueError, TypeError, KeyError) as e:
            log.warning("tunecache: skipping corrupt store row %s (%s)", row.digest[:12], e)
    return out


class Store:
    """One database, local or fleet. Thread-safe; safe for many processes on one SQLite file.

    A store opened with `writable=False` (tunecache.local_store does, for a file it may only
    read) skips put_config and add_trials, and raises ReadOnlyStoreError on any other write.
    """

    def __init__(self, url: str | None = None, *, migrate: bool = True, writable: bool = True) -> None:
        from . import settings

        self.url = url or settings.db_url()
        self.writable = writable
        self.path = sqlite_path(self.url)  # the SQLite file; None in memory or on Postgres
        self._keepalive: Any = None
        self.engine = make_engine(self.url, writable=writable)
        self._read = sessionmaker(self.engine, expire_on_commit=False)
        self._write_maker = sessionmaker(self.engine.execution_options(tunecache_write=True), expire_on_commit=False)
        try:
            if migrate:
                self._migrate()
            else:
                with self.engine.connect() as conn:
                    conn.exec_driver_sql("SELECT 1")
        except DatabaseError as e:
            raise StoreError(
                f"cannot open the store at {self.safe_url} (TUNECACHE_DB_URL): {describe_fault(e, self.path) or e.orig}"
            ) from None

    def _migrate(self) -> None:
        """Upgrade to head unless already there (the common case costs one small query and no
        Alembic import); a store migrated by a newer tunecache is refused, never downgraded."""
        from .migrate import current_revision, head_revision

        head = head_revision()
        current = current_revision(self.engine)
        if current == head:
            return
        if current is not None and not (current.isdigit() and int(current) < int(head)):
            what = (
                f"was written by a newer tunecache (schema revision {current}, this one knows up to {head})"
                if current.isdigit()
                else f"has schema revision {current!r}, unknown to this tunecache (it knows up to {head})"
            )
            raise NewerSchemaError(f"{self._where()} {what}", current, head)
        from .migrate import upgrade

        upgrade(self.engine)

    @classmethod
    def in_memory(cls) -> "Store":
        """A store in this process's memory, schema created: what this process tunes is kept
        for its lifetime only (the last resort of tunecache.local_store)."""
        # a named shared-cache database, so that every pooled connection (one per thread at
        # a time) sees the same one; it lives while a connection to it is open
        store = cls(f"sqlite:///file:tunecache-{uuid.uuid4().hex}?mode=memory&cache=shared&uri=true", migrate=False)
        store._keepalive = store.engine.raw_connection()
        Base.metadata.create_all(store.engine)
        return store

    @property
    def safe_url(self) -> str:
        return make_url(self.url).render_as_string(hide_password=True)

    def _where(self) -> str:
        return f"the store file {self.path}" if self.path is not None else f"the store at {self.safe_url}"

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextlib.contextmanager
    def _write(self) -> Iterator[Session]:
        if not self.writable:
            raise ReadOnlyStoreError(
                f"{self._where()} is open read-only: nothing can be written to it (the "
                f"warning given when it was opened says why)"
            )
        with self._write_maker.begin() as s:
            yield s

    def close(self) -> None:
        if self._keepalive is not None:
            self._keepalive.close()
            self._keepalive = None
        self.engine.dispose()

    # ---- configs ------------------------------------------------------------------------

    def get_config(self, digest: str) -> ConfigRecord | None:
        """The stored winner, or None. A corrupt row is reported and treated as a miss."""
        with self._read() as s:
            row = s.execute(select(TunedConfigRow).where(TunedConfigRow.digest == digest)).scalar_one_or_none()
            if row is None:
                return None
            try:
                rec = config_record(row)
            except (ValueError, TypeError, KeyError) as e:
                log.warning("tunecache: skipping corrupt store row %s (%s)", digest[:12], e)
                return None
        if rec.digest != digest:
            log.warning("tunecache: skipping store row %s whose fields hash to %s", digest[:12], rec.digest[:12])
            return None
        return rec

    def put_config(
        self, rec: ConfigRecord, trials: Iterable[TrialRecord] = (), run_id: str | None = None
    ) -> tuple[ConfigRecord, bool]:
        """Store a result unless a faster one is kept; returns (the kept record, whether `rec` won).

        On a read-only store nothing is written and `rec` is returned as kept: this process
        goes on with its own result (and still publishes it to a fleet)."""
        if not self.writable:
            log.debug("tunecache: not keeping %s in the read-only store %s", rec.digest[:12], self.safe_url)
            return rec, True
        with self._write() as s:
            self._add_trials(s, rec.key, trials, run_id)
            return self._keep_faster(s, rec, result_values(rec))

    def _keep_faster(self, s: Session, rec: ConfigRecord, values: dict) -> tuple[ConfigRecord, bool]:
        if insert_ignore(s, TunedConfigRow.__table__, values):
            return rec, True
        row = s.execute(
            select(TunedConfigRow).where(TunedConfigRow.digest == rec.digest).with_for_update()
        ).scalar_one()
        try:
            old = config_record(row)
        except (ValueError, TypeError, KeyError):
            old = None  # a corrupt row loses to any valid result
        # a fleet copy's claimed time is the fleet's word, not a measurement of this host:
        # it never keeps a result of this host out
        fleet_copy = old is not None and old.source == "fleet" and rec.source != "fleet"
        if old is not None and not fleet_copy and rec.median_ms >= old.median_ms * (1 - REPLACE_MARGIN):
            return old, False
        for k, v in values.items():
            setattr(row, k, v)
        row.fleet_checked_at = row.fleet_generation = None
        row.submission_id = row.retime_queued_at = None  # a new winner: Store.publish links its submission
        self._bump_generation(s)
        return rec, True

    # ---- fleet copies and the fleet's generation ------------------------------------------

    def _bump_generation(self, s: Session) -> None:
        table = FleetMetaRow.__table__
        stmt = dialect_insert(s)(table).values(name="generation", value=1)
        s.execute(stmt.on_conflict_do_update(index_elements=[table.c.name], set_={"value": table.c.value + 1}))

    def generation(self) -> int:
        """The fleet's generation: moves whenever a winner is removed or replaced."""
        with self._read() as s:
            v = s.execute(select(FleetMetaRow.value).where(FleetMetaRow.name == "generation")).scalar()
            return int(v or 0)

    def put_fleet_copy(self, rec: ConfigRecord, generation: int | None) -> bool:
        """Keep (or refresh) this host's copy of the fleet's winner. A result of this host's own
        for the key is never overwritten; returns whether the copy was written."""
        values = dict(
            result_values(rec),
            tuned_by=rec.tuned_by or "",
            source="fleet",
            fleet_checked_at=utcnow(),
            fleet_generation=generation,
        )
        with self._write() as s:
            if insert_ignore(s, TunedConfigRow.__table__, values):
                return True
            row = s.execute(
                select(TunedConfigRow).where(TunedConfigRow.digest == rec.digest).with_for_update()
            ).scalar_one()
            if row.source != "fleet":
                return False
            for k, v in values.items():
                setattr(row, k, v)
            return True

    def mark_fleet_checked(self, digest: str, generation: int | None) -> None:
        with self._write() as s:
            s.execute(
                update(TunedConfigRow)
                .where(TunedConfigRow.digest == digest, TunedConfigRow.source == "fleet")
                .values(fleet_checked_at=utcnow(), fleet_generation=generation)
            )

    def delete_fleet_copy(self, digest: str) -> bool:
        """Remove this host's copy of a winner the fleet no longer has (never a result of its own)."""
        with self._write() as s:
            res = s.execute(
                TunedConfigRow.__table__.delete().where(
                    TunedConfigRow.digest == digest, TunedConfigRow.source == "fleet"
                )
            )
            return res.rowcount == 1

    # ---- backend self-checks ----------------------------------------------------------------

    def get_selfcheck(
        self, kernel: str, kernel_version: str, triton_version: str, arch: str, sm_count: int
    ) -> tuple[bool, str | None] | None:
        """(ok, detail) of the stored verdict, or None if this backend never met this device class."""
        with self._read() as s:
            row = s.execute(
                select(SelfCheckRow).where(
                    SelfCheckRow.kernel == kernel,
                    SelfCheckRow.kernel_version == kernel_version,
                    SelfCheckRow.triton_version == triton_version,
                    SelfCheckRow.arch == arch,
                    SelfCheckRow.sm_count == sm_count,
                )
            ).scalar_one_or_none()
            return None if row is None else (bool(row.ok), row.detail)

    def put_selfcheck(
        self,
        kernel: str,
        kernel_version: str,
        triton_version: str,
        arch: str,
        sm_count: int,
        ok: bool,
        detail: str | None,
        seconds: float | None,
        device_name: str = "",
    ) -> None:
        values = dict(
            kernel=kernel, kernel_version=kernel_version, triton_version=triton_version, arch=arch, sm_count=sm_count
        )
        with self._write() as s:
            s.execute(
                SelfCheckRow.__table__.delete().where(*(getattr(SelfCheckRow, k) == v for k, v in values.items()))
            )
            s.add(
                SelfCheckRow(
                    **values,
                    ok=ok,
                    detail=(detail or None) and detail[:8000],
                    seconds=seconds,
                    device_name=device_name[:128],
                    checked_at=utcnow(),
                )
            )

    def _add_trials(self, s: Session, key: TuneKey, trials: Iterable[TrialRecord], run_id: str | None) -> None:
        run_id = run_id or uuid.uuid4().hex
        rows = [
            TrialRow(
                digest=key.digest,
                run_id=run_id,
                kernel=key.kernel,
                config=t.config,
                status=t.status,
                median_ms=t.median_ms,
                error=(t.error or None) and t.error[:4000],
            )
            for t in trials
        ]
        s.add_all(rows)

    def add_trials(self, key: TuneKey, trials: Iterable[TrialRecord], run_id: str | None = None) -> None:
        if not self.writable:
            return  # as put_config: a read-only store keeps nothing, and says so once when opened
        with self._write() as s:
            self._add_trials(s, key, trials, run_id)

    def trials(self, digest: str | None = None) -> list[TrialRecord]:
        with self._read() as s:
            q = select(TrialRow).order_by(TrialRow.id)
            if digest:
                q = q.where(TrialRow.digest == digest)
            return [TrialRecord(r.config, r.status, r.median_ms, r.error) for r in s.execute(q).scalars()]

    def list_configs(
        self, kernel: str | None = None, arch: str | None = None, limit: int | None = None, offset: int = 0
    ) -> list[ConfigRecord]:
        with self._read() as s:
            q = select(TunedConfigRow).order_by(TunedConfigRow.kernel, TunedConfigRow.id)
            if kernel:
                q = q.where(TunedConfigRow.kernel == kernel)
            if arch:
                q = q.where(TunedConfigRow.arch == arch)
            if offset:
                q = q.offset(offset)
            if limit is not None:
                q = q.limit(limit)
            return _readable(s.execute(q).scalars())

    def find_configs(self, prefix: str) -> list[ConfigRecord]:
        """Rows whose digest starts with `prefix` (for `tunecache show`)."""
        with self._read() as s:
            q = select(TunedConfigRow).where(TunedConfigRow.digest.startswith(prefix)).limit(20)
            return [config_record(r) for r in s.execute(q).scalars()]

    def delete_config(self, digest: str) -> bool:
        with self._write() as s:
            row = s.execute(select(TunedConfigRow).where(TunedConfigRow.digest == digest)).scalar_one_or_none()
            if row is None:
                return False
            s.delete(row)
            s.execute(KernelBinaryRow.__table__.delete().where(KernelBinaryRow.digest == digest))
            self._bump_generation(s)
            return True

    # ---- a winner's compiled kernels (tunecache.binaries) ---------------------------------

    def put_binaries(self, digest: str, config: dict, binaries: list[Binary], uploaded_by: str) -> bool:
        """Keep `binaries` as the compiled kernels of the key's winner, replacing the key's
        others; False (nothing kept) unless `config` is the winner's config. Callers check each
        binary against the key first (`binaries.refusal`)."""
        with self._write() as s:
            row = s.execute(
                select(TunedConfigRow).where(TunedConfigRow.digest == digest).with_for_update()
            ).scalar_one_or_none()
            if row is None or row.config != config:
                return False
            s.execute(KernelBinaryRow.__table__.delete().where(KernelBinaryRow.digest == digest))
            for b in binaries:
                s.add(
                    KernelBinaryRow(
                        digest=digest,
                        config=config,
                        triton_hash=b.triton_hash,
                        files=b.to_json()["files"],
                        size=sum(len(x) for x in b.files.values()),
                        uploaded_by=uploaded_by,
                        created_at=utcnow(),
                    )
                )
            return True

    def get_binaries(self, digests: Iterable[str]) -> dict[str, list[Binary]]:
        """The compiled kernels of each key's winner (those built for its current config)."""
        digests = list(digests)
        out: dict[str, list[Binary]] = {}
        with self._read() as s:
            for i in range(0, len(digests), 500):
                chunk = digests[i : i + 500]
                q = (
                    select(KernelBinaryRow, TunedConfigRow.config)
                    .join(TunedConfigRow, TunedConfigRow.digest == KernelBinaryRow.digest)
                    .where(KernelBinaryRow.digest.in_(chunk))
                    .order_by(KernelBinaryRow.id)
                )
                for row, winner_config in s.execute(q):
                    if row.config != winner_config:
                        continue
                    try:
                        binary = Binary.from_json({"triton_hash": row.triton_hash, "files": row.files})
                    except ValueError as e:
                        log.warning("tunecache: skipping unreadable binary of %s (%s)", row.digest[:12], e)
                        continue
                    out.setdefault(row.digest, []).append(binary)
        return out

    def device_configs(
        self, arch: str, sm_count: int, triton_version: str, kernel_versions: Mapping[str, str] | None = None
    ) -> list[ConfigRecord]:
        """Every winner of one device class and Triton, of the given kernel versions (all when
        None): what `tunecache sync` copies to a host."""
        with self._read() as s:
            q = (
                select(TunedConfigRow)
                .where(TunedConfigRow.arch == arch)
                .where(TunedConfigRow.sm_count == sm_count)
                .where(TunedConfigRow.triton_version == triton_version)
                .order_by(TunedConfigRow.id)
            )
            if kernel_versions is not None:
                pairs = [
                    and_(TunedConfigRow.kernel == k, TunedConfigRow.kernel_version == v)
                    for k, v in kernel_versions.items()
                ]
                q = q.where(or_(*pairs) if pairs else false())
            return _readable(s.execute(q).scalars())

    def counts(self) -> dict[str, int]:
        with self._read() as s:
            out = {}
            for name, model in (("tuned_configs", TunedConfigRow), ("tuning_jobs", TuningJobRow), ("trials", TrialRow)):
                out[name] = s.execute(select(func.count()).select_from(model)).scalar_one()
            for status, n in s.execute(select(TuningJobRow.status, func.count()).group_by(TuningJobRow.status)):
                out[f"jobs_{status}"] = n
            return out

    # ---- jobs ---------------------------------------------------------------------------

    def _now_sql(self, plus_s: float = 0.0) -> Any:
        """The database's time (+ `plus_s` seconds) as naive UTC, computed in SQL: replicas of
        the service whose clocks disagree still agree on every lease and backoff."""
        if self.dialect == "postgresql":
            now = func.now()
            if plus_s:
                now = now + literal_column("interval '1 second'") * float(plus_s)
            return type_coerce(func.timezone("UTC", now), DateTime)
        # SQLite's own clock, in the text form SQLAlchemy stores DateTime in (text order = time order)
        return type_coerce(func.strftime("%Y-%m-%d %H:%M:%f000", "now", f"{float(plus_s):+.3f} seconds"), DateTime)

    def db_now(self) -> datetime:
        """The database's time now (naive UTC): the clock of every lease, backoff and wait."""
        with self._read() as s:
            return s.execute(select(self._now_sql())).scalar_one()

    def enqueue_missing(self, jobs: Iterable[tuple[TuneKey, int, int | None]]) -> tuple[list[str], list[str]]:
        """Enqueue, in order, the (key, priority, max_attempts or None for enqueue's default) jobs
        whose key has no tuned config: (the digests found tuned, the digests queued). What a
        pretune asks before its workers start, of a store queue or the service's POST
        /v1/jobs/batch."""
        tuned: list[str] = []
        queued: list[str] = []
        for key, priority, max_attempts in jobs:
            if self.get_config(key.digest) is not None:
                tuned.append(key.digest)
                continue
            attempts = {} if max_attempts is None else {"max_attempts": max_attempts}
            self.enqueue(key, priority=priority, **attempts)
            queued.append(key.digest)
        return tuned, queued

    def enqueue(self, key: TuneKey, priority: int = 0, max_attempts: int = 3) -> JobRecord:
        """One active job per digest: a queued or running job is returned as it is. A done job
        whose winner is gone, or a quarantined one, is queued again (the key's fields are
        written again: enqueueing the key repairs a row that could not be read)."""
        now = self._now_sql()
        values = dict(
            digest=key.digest,
            **key.fields(),
            status="queued",
            priority=priority,
            attempts=0,
            max_attempts=max_attempts,
            not_before=now,
            created_at=now,
            updated_at=now,
        )
        with self._write() as s:
            insert_ignore(s, TuningJobRow.__table__, values)
            row = s.execute(
                select(TuningJobRow).where(TuningJobRow.digest == key.digest).with_for_update()
            ).scalar_one()
            changes: dict[str, Any] = {}
            if job_record(row).unreadable is not None:
                changes.update(key.fields())  # the key hashes to this digest: its fields are the row's
            if row.status == "quarantined" or (
                row.status == "done"
                and s.execute(select(TunedConfigRow.id).where(TunedConfigRow.digest == key.digest)).first() is None
            ):
                # done, but its winner is gone (deleted): tune again
                changes.update(
                    status="queued",
                    attempts=0,
                    not_before=now,
                    lease_owner=None,
                    lease_hash=None,
                    lease_expires_at=None,
                )
            if priority > row.priority and (row.status == "queued" or changes):
                changes["priority"] = priority
            if changes:
                s.execute(
                    update(TuningJobRow)
                    .where(TuningJobRow.id == row.id)
                    .values(**changes, updated_at=now)
                    .execution_options(synchronize_session=False)
                )
                s.refresh(row)
            return job_record(row)

    def claim_job(
        self,
        owner: str,
        arch: str | None = None,
        sm_count: int | None = None,
        lease_s: float = 60.0,
        kernels: Iterable[str] | None = None,
        *,
        kernel_versions: Mapping[str, str] | None = None,
        triton_version: str | None = None,
    ) -> JobRecord | None:
        """Lease the most urgent job of this device class: queued, or running with a lapsed lease.

        The answer carries `lease_secret`, random and returned only here (the store keeps its
        sha256): heartbeat, complete, fail and release must present it. `owner` only names the
        holder for people. `lease_s` is capped at MAX_LEASE_S. `kernel_versions` ({kernel:
        version}) and `triton_version` restrict the claim to jobs whose key this worker
        reproduces: a worker on other code would tune another digest.

        On the way, in the same call: a job whose last attempt's lease ran out is marked failed
        (its worker died on every attempt), and a row that cannot be read is quarantined; the
        claim goes on to the next job.
        """
        lease_s = min(float(lease_s), MAX_LEASE_S)
        now = self._now_sql()
        with self._write() as s:
            self._fail_lapsed_last_attempts(s, arch, sm_count)
            self._expire_queued(s)  # a job nobody took for TUNECACHE_JOB_TTL_S is not handed out
            q = self._device_class_filter(
                select(TuningJobRow).where(
                    ((TuningJobRow.status == "queued") & (TuningJobRow.not_before <= now))
                    | (
                        (TuningJobRow.status == "running")
                        & (TuningJobRow.lease_expires_at < now)
                        & (TuningJobRow.attempts < TuningJobRow.max_attempts)
                    )
                ),
                arch,
                sm_count,
            )
            if kernels is not None:
                q = q.where(TuningJobRow.kernel.in_(list(kernels)))
            if kernel_versions is not None:
                q = q.where(
                    or_(
                        false(),
                        *(
                            and_(TuningJobRow.kernel == k, TuningJobRow.kernel_version == v)
                            for k, v in kernel_versions.items()
                        ),
                    )
                )
            if triton_version is not None:
                q = q.where(TuningJobRow.triton_version == triton_version)
            q = q.order_by(TuningJobRow.priority.desc(), TuningJobRow.id).limit(1)
            if self.dialect == "postgresql":
                q = q.with_for_update(skip_locked=True)
            for _ in range(CLAIM_SCAN):
                row = s.execute(q).scalar_one_or_none()
                if row is None:
                    return None
                rec = job_record(row)
                if rec.unreadable is not None:
                    log.warning(
                        "tunecache: job %d (%s) cannot be read (%s); quarantined",
                        row.id,
                        row.digest[:12],
                        rec.unreadable,
                    )
                    s.execute(
                        update(TuningJobRow)
                        .where(TuningJobRow.id == row.id)
                        .values(
                            status="quarantined",
                            lease_owner=None,
                            lease_hash=None,
                            lease_expires_at=None,
                            last_error=f"quarantined: the row cannot be read ({rec.unreadable})",
                            updated_at=now,
                        )
                        .execution_options(synchronize_session=False)
                    )
                    continue
                secret = LEASE_PREFIX + secrets.token_urlsafe(32)
                s.execute(
                    update(TuningJobRow)
                    .where(TuningJobRow.id == row.id)
                    .values(
                        status="running",
                        lease_owner=owner[:128],
                        lease_hash=hash_token(secret),
                        lease_expires_at=self._now_sql(lease_s),
                        attempts=TuningJobRow.attempts + 1,
                        updated_at=now,
                    )
                    .execution_options(synchronize_session=False)
                )
                s.refresh(row)
                return job_record(row, lease_secret=secret)
            return None  # only unreadable rows so far; the next claim goes on

    def _device_class_filter(self, q: Any, arch: str | None, sm_count: int | None) -> Any:
        if arch is not None:
            q = q.where(TuningJobRow.arch == arch)
        if sm_count is not None:
            q = q.where(TuningJobRow.sm_count == sm_count)
        return q

    def _fail_lapsed_last_attempts(self, s: Session, arch: str | None, sm_count: int | None) -> None:
        """Mark failed the running jobs of this device class whose last attempt's lease ran out."""
        now = self._now_sql()
        q = self._device_class_filter(
            select(
                TuningJobRow.id,
                TuningJobRow.digest,
                TuningJobRow.lease_owner,
                TuningJobRow.attempts,
                TuningJobRow.max_attempts,
                TuningJobRow.last_error,
            ).where(
                TuningJobRow.status == "running",
                TuningJobRow.lease_expires_at < now,
                TuningJobRow.attempts >= TuningJobRow.max_attempts,
            ),
            arch,
            sm_count,
        ).limit(CLAIM_SCAN)
        if self.dialect == "postgresql":
            q = q.with_for_update(skip_locked=True)
        for job_id, digest, owner, attempts, max_attempts, last_error in s.execute(q).all():
            why = f"the lease of {owner or 'its worker'} ran out on the last attempt ({attempts}/{max_attempts})"
            log.warning("tunecache: job %d (%s): %s; marked failed", job_id, digest[:12], why)
            s.execute(
                update(TuningJobRow)
                .where(TuningJobRow.id == job_id)
                .values(
                    status="failed",
                    lease_owner=None,
                    lease_hash=None,
                    lease_expires_at=None,
                    updated_at=now,
                    last_error="\n".join(filter(None, [last_error, why]))[-8000:],
                )
                .execution_options(synchronize_session=False)
            )

    @staticmethod
    def _held(job_id: int, lease_secret: str) -> tuple:
        """The running job `job_id` whose lease this secret holds."""
        return (
            TuningJobRow.id == job_id,
            TuningJobRow.status == "running",
            TuningJobRow.lease_hash == hash_token(lease_secret),
        )

    def heartbeat(self, job_id: int, lease_secret: str, lease_s: float = 60.0) -> bool:
        """Extend the lease (capped at MAX_LEASE_S); False unless `lease_secret` holds it (the
        lease ran out and the job was claimed again, it is finished, or the secret is wrong)."""
        if not lease_secret:
            return False
        now = self._now_sql()
        with self._write() as s:
            res = s.execute(
                update(TuningJobRow)
                .where(*self._held(job_id, lease_secret))
                .values(lease_expires_at=self._now_sql(min(float(lease_s), MAX_LEASE_S)), updated_at=now)
                .execution_options(synchronize_session=False)
            )
            return res.rowcount == 1

    def complete_job(self, job_id: int, lease_secret: str) -> bool:
        if not lease_secret:
            return False
        with self._write() as s:
            res = s.execute(
                update(TuningJobRow)
                .where(*self._held(job_id, lease_secret))
                .values(
                    status="done", lease_owner=None, lease_hash=None, lease_expires_at=None, updated_at=self._now_sql()
                )
                .execution_options(synchronize_session=False)
            )
            return res.rowcount == 1

    def fail_job(self, job_id: int, lease_secret: str, error: str, backoff_s: float = 5.0) -> str | None:
        """Record a failure: back to the queue after a backoff (doubling per attempt, at most
        MAX_BACKOFF_S), or `failed` after max attempts. None unless `lease_secret` holds the lease."""
        if not lease_secret:
            return None
        now = self._now_sql()
        with self._write() as s:
            row = s.execute(
                select(TuningJobRow).where(*self._held(job_id, lease_secret)).with_for_update()
            ).scalar_one_or_none()
            if row is None:
                return None
            values: dict[str, Any] = dict(
                last_error=error[:8000], lease_owner=None, lease_hash=None, lease_expires_at=None, updated_at=now
            )
            if row.attempts >= row.max_attempts:
                values["status"] = "failed"
            else:
                # capped: an exponent of a few dozen attempts would overflow datetime
                wait = min(max(float(backoff_s), 0.0) * 2 ** min(row.attempts - 1, 30), MAX_BACKOFF_S)
                values.update(status="queued", not_before=self._now_sql(wait))
            s.execute(
                update(TuningJobRow)
                .where(TuningJobRow.id == row.id)
                .values(**values)
                .execution_options(synchronize_session=False)
            )
            return values["status"]

    def get_job(self, digest: str) -> JobRecord | None:
        with self._read() as s:
            row = s.execute(select(TuningJobRow).where(TuningJobRow.digest == digest)).scalar_one_or_none()
            return None if row is None else job_record(row)

    def list_jobs(
        self, status: str | None = None, limit: int = 1000, *, arch: str | None = None, sm_count: int | None = None
    ) -> list[JobRecord]:
        """Jobs by id; a row that cannot be read is listed with `unreadable` saying why."""
        with self._read() as s:
            q = self._device_class_filter(select(TuningJobRow), arch, sm_count).order_by(TuningJobRow.id).limit(limit)
            if status:
                q = q.where(TuningJobRow.status == status)
            return [job_record(r) for r in s.execute(q).scalars()]

    # ---- queue operations (operators: `tunecache jobs`, the admin routes, /healthz) ---------

    def retry_job(self, digest: str) -> JobRecord | None:
        """Queue a failed, quarantined or backing-off job again now, its attempts reset (its
        last error is kept). None if there is no such job; JobStateError if it is running, done,
        or cannot be read."""
        now = self._now_sql()
        with self._write() as s:
            row = s.execute(
                select(TuningJobRow).where(TuningJobRow.digest == digest).with_for_update()
            ).scalar_one_or_none()
            if row is None:
                return None
            rec = job_record(row)
            if rec.unreadable is not None:
                raise JobStateError(
                    f"job {digest[:12]} cannot be read ({rec.unreadable}): drop it, and enqueue "
                    f"its key again to tune it"
                )
            if row.status == "running":
                raise JobStateError(
                    f"job {digest[:12]} is running (leased to {row.lease_owner!r} until "
                    f"{row.lease_expires_at} UTC): let it finish, or drop it"
                )
            if row.status == "done":
                raise JobStateError(
                    f"job {digest[:12]} is done and its winner is stored: delete the config "
                    f"(DELETE /v1/configs/{digest}) and enqueue the key to tune it again"
                )
            s.execute(
                update(TuningJobRow)
                .where(TuningJobRow.id == row.id)
                .values(
                    status="queued",
                    attempts=0,
                    not_before=now,
                    lease_owner=None,
                    lease_hash=None,
                    lease_expires_at=None,
                    updated_at=now,
                )
                .execution_options(synchronize_session=False)
            )
            s.refresh(row)
            return job_record(row)

    def drop_job(self, digest: str) -> bool:
        """Delete the job of this digest, in whatever state (a worker holding it loses its lease)."""
        with self._write() as s:
            res = s.execute(TuningJobRow.__table__.delete().where(TuningJobRow.digest == digest))
            return res.rowcount == 1

    def queue_waits(self) -> tuple[datetime, list[QueueWait]]:
        """(the database's time now, per device class: the jobs a worker could claim now, how
        long the oldest of them has waited, and the live leases)."""
        with self._read() as s:
            now = s.execute(select(self._now_sql())).scalar_one()
            claimable = or_(
                and_(TuningJobRow.status == "queued", TuningJobRow.not_before <= now),
                and_(TuningJobRow.status == "running", TuningJobRow.lease_expires_at < now),
            )
            since = case(
                (TuningJobRow.status == "queued", TuningJobRow.not_before), else_=TuningJobRow.lease_expires_at
            )
            out: dict[tuple[str, int], QueueWait] = {}
            for arch, sms, n, oldest in s.execute(
                select(TuningJobRow.arch, TuningJobRow.sm_count, func.count(), func.min(since))
                .where(claimable)
                .group_by(TuningJobRow.arch, TuningJobRow.sm_count)
            ):
                wait = max((now - oldest).total_seconds(), 0.0) if oldest is not None else 0.0
                out[(arch, sms)] = QueueWait(arch, sms, waiting=n, oldest_wait_s=wait)
            for arch, sms, n in s.execute(
                select(TuningJobRow.arch, TuningJobRow.sm_count, func.count())
                .where(TuningJobRow.status == "running", TuningJobRow.lease_expires_at >= now)
                .group_by(TuningJobRow.arch, TuningJobRow.sm_count)
            ):
                out.setdefault((arch, sms), QueueWait(arch, sms)).running = n
            return now, sorted(out.values(), key=lambda w: (w.arch, w.sm_count))

    # ---- fleet: submissions, tokens and queue state (the service's side of the store) ------

    def publish(
        self,
        rec: ConfigRecord,
        trials: Iterable[TrialRecord] = (),
        run_id: str | None = None,
        *,
        submitted_by: str = "",
        tune_seconds: float | None = None,
    ) -> tuple[ConfigRecord, bool, int]:
        """put_config that also records the submission, won or lost, in the same transaction.

        Returns (the kept record, whether `rec` won, the submission's id). The service calls
        this for trusted results only (worker and admin tokens); others go to `submit`."""
        values = result_values(rec)
        with self._write() as s:
            self._add_trials(s, rec.key, trials, run_id)
            kept, won = self._keep_faster(s, rec, values)
            row = SubmissionRow(
                **values, submitted_by=submitted_by[:128], accepted=won, tune_seconds=tune_seconds, created_at=utcnow()
            )
            s.add(row)
            s.flush()
            if won:  # the winner remembers who made it (purge_token)
                s.execute(
                    update(TunedConfigRow).where(TunedConfigRow.digest == rec.digest).values(submission_id=row.id)
                )
            return kept, won, row.id

    def submit(
        self,
        rec: ConfigRecord,
        trials: Iterable[TrialRecord] = (),
        run_id: str | None = None,
        *,
        submitted_by: str = "",
        tune_seconds: float | None = None,
    ) -> tuple[ConfigRecord | None, int, JobRecord | None]:
        """Record an untrusted result (a `publish` token's): it never makes or replaces a winner.

        When the key has no winner, or the result claims to beat the winner by REPLACE_MARGIN,
        the key is queued for a worker of its device class to tune (one active job per key; a
        failed job is left for an operator). A winner is re-timed once: later claims against it
        are recorded only, until a worker's result replaces it. Returns (the key's winner or
        None, the submission's id, the key's queued or running job or None)."""
        values = result_values(rec)
        with self._write() as s:
            self._add_trials(s, rec.key, trials, run_id)
            sub = SubmissionRow(
                **values,
                submitted_by=submitted_by[:128],
                accepted=False,
                tune_seconds=tune_seconds,
                created_at=utcnow(),
            )
            s.add(sub)
            s.flush()
            row = s.execute(
                select(TunedConfigRow).where(TunedConfigRow.digest == rec.digest).with_for_update()
            ).scalar_one_or_none()
            try:
                winner = None if row is None else config_record(row)
            except (ValueError, TypeError, KeyError):
                winner = None  # a corrupt row: as if there were none (a worker's result replaces it)
            job = None
            if winner is None:
                job = self._queue_timing(s, rec.key, retime=False)
            elif rec.median_ms < winner.median_ms * (1 - REPLACE_MARGIN):
                if row.retime_queued_at is None:
                    row.retime_queued_at = utcnow()
                    job = self._queue_timing(s, rec.key, retime=True)
                else:  # re-timed already: a job still under way covers this claim too
                    job_row = s.execute(
                        select(TuningJobRow).where(TuningJobRow.digest == rec.digest)
                    ).scalar_one_or_none()
                    if job_row is not None and job_row.status in ("queued", "running"):
                        job = job_record(job_row)
            if job is not None and job.status not in ("queued", "running"):
                job = None  # failed or quarantined: an operator's to retry
            return winner, sub.id, job

    def report(self, digest: str, config: dict, error: str, reported_by: str) -> tuple[bool, JobRecord | None]:
        """A host could not launch the winner's config: keep the report as a failed trial of the
        key and, if it is about the current winner, queue the key's re-timing (once per winner,
        as for a submission that beats it). Returns (whether there is a winner, the job)."""
        with self._write() as s:
            row = s.execute(
                select(TunedConfigRow).where(TunedConfigRow.digest == digest).with_for_update()
            ).scalar_one_or_none()
            if row is None:
                return False, None
            key = key_of(row)
            self._add_trials(
                s, key, [TrialRecord(config=config, status="failed", error=f"reported by {reported_by}: {error}")], None
            )
            if row.config != config or row.retime_queued_at is not None:
                return True, None
            row.retime_queued_at = utcnow()
            job = self._queue_timing(s, key, retime=True)
            return True, job if job.status in ("queued", "running") else None

    def _queue_timing(self, s: Session, key: TuneKey, *, retime: bool) -> JobRecord:
        """In the caller's transaction, the key's tuning job (one active job per digest): a new
        one, or a done one queued again; a queued or running one is kept (marked as a re-timing
        when `retime`: the key has a winner, tune it even so); a failed or quarantined one is
        left as it is (`tunecache jobs retry`)."""
        now = self._now_sql()
        insert_ignore(
            s,
            TuningJobRow.__table__,
            dict(
                digest=key.digest,
                **key.fields(),
                status="queued",
                priority=0,
                attempts=0,
                max_attempts=3,
                not_before=now,
                created_at=now,
                updated_at=now,
                retime=retime,
            ),
        )
        row = s.execute(select(TuningJobRow).where(TuningJobRow.digest == key.digest).with_for_update()).scalar_one()
        changes: dict[str, Any] = {}
        if row.status == "done":
            changes = dict(
                status="queued",
                attempts=0,
                not_before=now,
                lease_owner=None,
                lease_hash=None,
                lease_expires_at=None,
                last_error=None,
                retime=retime,
            )
        elif row.status in ("queued", "running") and retime and not row.retime:
            changes = dict(retime=True)
        if changes:
            s.execute(
                update(TuningJobRow)
                .where(TuningJobRow.id == row.id)
                .values(**changes, updated_at=now)
                .execution_options(synchronize_session=False)
            )
            s.refresh(row)
        return job_record(row)

    def purge_token(self, name: str, *, dry_run: bool = False) -> PurgeReport:
        """Remove every winner that a submission of the token `name` made (of every token that
        had the name) and every submission it sent; queue each displaced key for tuning (a done
        job again; a failed one is left for `tunecache jobs retry`), and move the generation so
        that hosts drop their copies. `dry_run`: report what would be removed, change nothing."""
        made_by_token = (
            select(TunedConfigRow)
            .join(SubmissionRow, SubmissionRow.id == TunedConfigRow.submission_id)
            .where(SubmissionRow.submitted_by == name)
            .order_by(TunedConfigRow.id)
        )
        count_subs = select(func.count()).select_from(SubmissionRow).where(SubmissionRow.submitted_by == name)
        removed: list[ConfigRecord] = []
        jobs: dict[str, str] = {}
        if dry_run:
            with self._read() as s:
                for row in s.execute(made_by_token).scalars():
                    try:
                        removed.append(config_record(row))
                    except (ValueError, TypeError, KeyError):
                        jobs[row.digest] = "unreadable"
                return PurgeReport(
                    name, removed, jobs, s.execute(count_subs).scalar_one(), self.generation(), dry_run=True
                )
        with self._write() as s:
            rows = s.execute(made_by_token.with_for_update(of=TunedConfigRow)).scalars().all()
            for row in rows:
                try:
                    removed.append(config_record(row))
                except (ValueError, TypeError, KeyError):
                    jobs[row.digest] = "unreadable"  # removed; its key cannot be queued
                s.delete(row)
            s.flush()
            for rec in removed:
                jobs[rec.digest] = self._queue_timing(s, rec.key, retime=False).status
            gone = [row.digest for row in rows]
            if gone:
                s.execute(KernelBinaryRow.__table__.delete().where(KernelBinaryRow.digest.in_(gone)))
            # the winners this token's claims had queued a re-timing of may be re-timed again
            s.execute(
                update(TunedConfigRow)
                .where(
                    TunedConfigRow.digest.in_(select(SubmissionRow.digest).where(SubmissionRow.submitted_by == name))
                )
                .values(retime_queued_at=None)
            )
            n_subs = s.execute(SubmissionRow.__table__.delete().where(SubmissionRow.submitted_by == name)).rowcount
            # the compiled kernels the token's tuning hosts uploaded, for any key
            s.execute(KernelBinaryRow.__table__.delete().where(KernelBinaryRow.uploaded_by == name))
            if rows:
                self._bump_generation(s)
        return PurgeReport(name, removed, jobs, n_subs, self.generation())

    def submissions(self, digest: str | None = None, limit: int = 1000) -> list[SubmissionRecord]:
        with self._read() as s:
            q = select(SubmissionRow).order_by(SubmissionRow.id).limit(limit)
            if digest:
                q = q.where(SubmissionRow.digest == digest)
            return [submission_record(r) for r in s.execute(q).scalars()]

    def create_token(
        self, name: str, scopes: Iterable[str], *, expires_in: timedelta | None = None
    ) -> tuple[str, TokenRecord]:
        """A new API token; returns (the secret, shown once, never stored; its record).

        Live tokens have unique names (ValueError naming the one in the way); `expires_in`
        makes the token stop working that long from now."""
        scopes = tuple(dict.fromkeys(scopes))
        bad = [sc for sc in scopes if sc not in TOKEN_SCOPES]
        if bad or not scopes:
            raise ValueError(f"scopes must be some of {list(TOKEN_SCOPES)}, got {list(scopes)}")
        if not name or len(name) > 128:
            raise ValueError("a token needs a name of 1 to 128 characters")
        if expires_in is not None and not timedelta(0) < expires_in <= timedelta(days=36500):
            raise ValueError(f"a token's lifetime must be positive and under a century, got {expires_in}")
        secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
        now = utcnow()
        taken = ValueError(
            f"a live token named {name!r} exists; choose another name, or revoke that one first "
            f"(`tunecache token revoke {name}`)"
        )
        try:
            with self._write() as s:
                if (
                    s.execute(
                        select(ApiTokenRow.id).where(ApiTokenRow.name == name, ApiTokenRow.revoked_at.is_(None))
                    ).first()
                    is not None
                ):
                    raise taken
                row = ApiTokenRow(
                    name=name,
                    token_hash=hash_token(secret),
                    scopes=",".join(scopes),
                    created_at=now,
                    expires_at=None if expires_in is None else now + expires_in,
                )
                s.add(row)
                s.flush()
                return secret, token_record(row)
        except IntegrityError:  # created at the same moment by someone else
            raise taken from None

    def verify_token(self, secret: str) -> TokenRecord | None:
        """The live token with this secret, or None (unknown, revoked or expired)."""
        with self._read() as s:
            row = s.execute(
                select(ApiTokenRow).where(
                    ApiTokenRow.token_hash == hash_token(secret),
                    ApiTokenRow.revoked_at.is_(None),
                    or_(ApiTokenRow.expires_at.is_(None), ApiTokenRow.expires_at > utcnow()),
                )
            ).scalar_one_or_none()
            return None if row is None else token_record(row)

    def list_tokens(self) -> list[TokenRecord]:
        with self._read() as s:
            return [token_record(r) for r in s.execute(select(ApiTokenRow).order_by(ApiTokenRow.id)).scalars()]

    def revoke_token(self, name: str | None = None, *, token_id: int | None = None) -> int:
        """Revoke the live token with this name (names of live tokens are unique), or with this
        id; returns how many were revoked (0 or 1)."""
        if (name is None) == (token_id is None):
            raise ValueError("revoke a token by its name or by its id, not both")
        where = ApiTokenRow.name == name if token_id is None else ApiTokenRow.id == token_id
        with self._write() as s:
            res = s.execute(
                update(ApiTokenRow).where(where, ApiTokenRow.revoked_at.is_(None)).values(revoked_at=utcnow())
            )
            return res.rowcount

    # ---- the audit log: every admin action ---------------------------------------------------

    def audit(
        self, actor: TokenRecord | str, action: str, target: str = "", details: Mapping[str, Any] | None = None
    ) -> int:
        """Record an admin action; returns the row's id. `actor` is the caller's token (its name
        and id are kept) or a name (`cli:user@host` for the command line); `action` names what
        was done ("config.delete"), `target` on what ("config:<digest>", "token:7")."""
        name, token_id = (actor.name, actor.id or None) if isinstance(actor, TokenRecord) else (str(actor), None)
        with self._write() as s:
            row = AuditRow(
                at=utcnow(),
                actor=name[:128],
                actor_token_id=token_id,
                action=action[:64],
                target=(target or "")[:256],
                details=None if details is None else dict(details),
            )
            s.add(row)
            s.flush()
            return row.id

    def audit_log(
        self, limit: int = 100, offset: int = 0, action: str | None = None, actor: str | None = None
    ) -> list[AuditRecord]:
        """Audit rows, newest first."""
        with self._read() as s:
            q = select(AuditRow).order_by(AuditRow.id.desc()).offset(offset).limit(limit)
            if action:
                q = q.where(AuditRow.action == action)
            if actor:
                q = q.where(AuditRow.actor == actor)
            return [
                AuditRecord(
                    id=r.id,
                    at=r.at,
                    actor=r.actor,
                    actor_token_id=r.actor_token_id,
                    action=r.action,
                    target=r.target,
                    details=r.details,
                )
                for r in s.execute(q).scalars()
            ]

    # ---- retention: what grows forever unless pruned -------------------------------------------

    def _expire_queued(self, s: Session, ttl_s: float | None = None) -> int:
        """Mark jobs queued for longer than the TTL (TUNECACHE_JOB_TTL_S, since they last became
        queued, by the database's clock) as failed, saying so: no worker of their device class
        took them. Runs in the caller's write transaction (prune; a claim may call it first);
        returns how many."""
        from . import settings

        ttl = settings.job_ttl_s() if ttl_s is None else ttl_s
        res = s.execute(
            update(TuningJobRow)
            .where(TuningJobRow.status == "queued", TuningJobRow.updated_at < self._now_sql(-ttl))
            .values(
                status="failed",
                updated_at=self._now_sql(),
                last_error=f"expired: queued for over {ttl / 86400:g} day(s) without a worker claiming it "
                f"(TUNECACHE_JOB_TTL_S); `tunecache jobs retry` queues it again",
            )
            .execution_options(synchronize_session=False)
        )
        return res.rowcount

    def expire_queued_jobs(self, ttl_s: float | None = None) -> int:
        """_expire_queued in a transaction of its own."""
        with self._write() as s:
            return self._expire_queued(s, ttl_s)

    def prune(self, older_than_s: float, *, job_ttl_s: float | None = None) -> dict[str, int]:
        """Delete trials and submissions older than `older_than_s` (each key's latest accepted
        submission is kept: it says who made the current winner), finished jobs (done, failed,
        quarantined) last changed before then, and compiled kernels no winner uses (any age), and
        expire queued jobs past their TTL first. Returns {what: how many}. The audit log is kept."""
        if not older_than_s > 0:
            raise ValueError(f"older_than_s must be > 0, got {older_than_s}")
        cutoff = utcnow() - timedelta(seconds=older_than_s)  # trials and submissions: the service's clock
        with self._write() as s:
            expired = self._expire_queued(s, job_ttl_s)
            trials = s.execute(TrialRow.__table__.delete().where(TrialRow.created_at < cutoff)).rowcount
            latest = (
                select(func.max(SubmissionRow.id))
                .where(SubmissionRow.accepted.is_(True))
                .group_by(SubmissionRow.digest)
            )
            subs = s.execute(
                SubmissionRow.__table__.delete().where(
                    SubmissionRow.created_at < cutoff, SubmissionRow.id.not_in(latest)
                )
            ).rowcount
            jobs = s.execute(
                TuningJobRow.__table__.delete().where(  # jobs: the database's, as the queue's
                    TuningJobRow.status.in_(("done", "failed", "quarantined")),
                    TuningJobRow.updated_at < self._now_sql(-older_than_s),
                )
            ).rowcount
            unused = [  # the kernels of a replaced or removed winner (configs compared as Python objects)
                row_id
                for row_id, config, winner_config in s.execute(
                    select(KernelBinaryRow.id, KernelBinaryRow.config, TunedConfigRow.config).outerjoin(
                        TunedConfigRow, TunedConfigRow.digest == KernelBinaryRow.digest
                    )
                )
                if config != winner_config
            ]
            for i in range(0, len(unused), 500):
                s.execute(KernelBinaryRow.__table__.delete().where(KernelBinaryRow.id.in_(unused[i : i + 500])))
        return {"trials": trials, "submissions": subs, "jobs": jobs, "expired_jobs": expired, "binaries": len(unused)}

    def job_counts(self, arch: str | None = None, sm_count: int | None = None) -> dict[str, int]:
        """Jobs per status (the queue depth), optionally of one device class."""
        with self._read() as s:
            q = select(TuningJobRow.status, func.count()).group_by(TuningJobRow.status)
            if arch is not None:
                q = q.where(TuningJobRow.arch == arch)
            if sm_count is not None:
                q = q.where(TuningJobRow.sm_count == sm_count)
            out = {status: 0 for status in JOB_STATUSES}
            out.update({status: n for status, n in s.execute(q)})
            return out

    def job_statuses(self, digests: Iterable[str]) -> dict[str, str]:
        """{digest: status} of the jobs for these digests (absent: no job)."""
        digests = list(digests)
        out: dict[str, str] = {}
        with self._read() as s:
            for i in range(0, len(digests), 500):
                q = select(TuningJobRow.digest, TuningJobRow.status).where(
                    TuningJobRow.digest.in_(digests[i : i + 500])
                )
                out.update({d: st for d, st in s.execute(q)})
        return out

    def release_job(self, job_id: int, lease_secret: str) -> bool:
        """Give a leased job back to the queue now, without spending an attempt (a worker
        stopped by Ctrl-C or SIGTERM: its job need not wait for the lease to run out)."""
        if not lease_secret:
            return False
        now = self._now_sql()
        with self._write() as s:
            res = s.execute(
                update(TuningJobRow)
                .where(*self._held(job_id, lease_secret))
                .values(
                    status="queued",
                    lease_owner=None,
                    lease_hash=None,
                    lease_expires_at=None,
                    not_before=now,
                    attempts=func.max(TuningJobRow.attempts - 1, 0)
                    if self.dialect == "sqlite"
                    else func.greatest(TuningJobRow.attempts - 1, 0),
                    updated_at=now,
                )
                .execution_options(synchronize_session=False)
            )
            return res.rowcount == 1


from .process_store import default_store  # noqa: E402, F401 - where callers have always found it
