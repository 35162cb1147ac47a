"""Tuned configs, their trials and binaries, fleet copies and self-checks: what a store keeps."""

from __future__ import annotations

import uuid
from typing import Iterable, Mapping

from sqlalchemy import and_, false, func, or_, select, update
from sqlalchemy.orm import Session

from tunecache.key import TuneKey
from tunecache.store.base import REPLACE_MARGIN, StoreBase, _readable, locked, log
from tunecache.store.engine import dialect_insert, insert_ignore
from tunecache.store.records import (
    ConfigRecord,
    TokenRecord,
    TrialRecord,
    utcnow,
)
from tunecache.store.rows import (
    FleetMetaRow,
    KernelBinaryRow,
    SelfCheckRow,
    TrialRow,
    TunedConfigRow,
    TuningJobRow,
    config_record,
    result_values,
)
from tunecache.tuning.binaries import Binary

# from this many trials on, Postgres takes them by COPY: a publish's 500 trials by executemany
# were a third of the service's time on it (the driver's per-row pipeline)
COPY_ROWS = 50
_TRIAL_COLUMNS = ("digest", "run_id", "kernel", "config", "status", "median_ms", "error", "created_at", "trusted")


def _copy_trials(s: Session, rows: list[dict]) -> None:
    """`rows` into trials with one COPY, on the session's own connection (its transaction)."""
    from psycopg.types.json import Json

    raw = s.connection().connection.driver_connection
    with raw.cursor() as cur, cur.copy(f"COPY trials ({', '.join(_TRIAL_COLUMNS)}) FROM STDIN") as copy:
        for r in rows:
            copy.write_row(tuple(Json(r[c]) if c == "config" else r[c] for c in _TRIAL_COLUMNS))


class ConfigStore(StoreBase):
    """Tuned configs, their trials and binaries, fleet copies and self-checks: what a store keeps."""

    def get_config(self, digest: str) -> ConfigRecord | None:
        """The stored winner, or None. A corrupt row is reported and treated as a miss."""
        return self.get_configs([digest]).get(digest)

    def get_configs(self, digests: Iterable[str]) -> dict[str, ConfigRecord]:
        """The stored winners of `digests` that have one, in one query (the service reads the
        lookups that missed its cache together). A corrupt row is reported and left out."""
        wanted = sorted(set(digests))
        found: dict[str, ConfigRecord] = {}
        if not wanted:
            return found
        with self._read() as s:
            for row in s.execute(select(TunedConfigRow).where(TunedConfigRow.digest.in_(wanted))).scalars():
                try:
                    rec = config_record(row)
                except (ValueError, TypeError, KeyError) as e:
                    log.warning("tunecache: skipping corrupt store row %s (%s)", row.digest[:12], e)
                    continue
                if rec.digest != row.digest:
                    log.warning(
                        "tunecache: skipping store row %s whose fields hash to %s", row.digest[:12], rec.digest[:12]
                    )
                    continue
                found[row.digest] = rec
        return found

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
            self._add_trials(s, rec.key, trials, run_id, trusted=True)
            return self._keep_faster(s, rec, result_values(rec))

    def _keep_faster(
        self, s: Session, rec: ConfigRecord, values: dict, *, displace: bool = False
    ) -> tuple[ConfigRecord, bool]:
        """Keep `rec` unless the stored result is as fast (within REPLACE_MARGIN); `displace`:
        keep `rec` whatever the times (the stored winner cannot be launched: TrustStore.publish)."""
        values = dict(values, tune_seconds=rec.tune_seconds, start_seconds=rec.start_seconds)  # a winner's own
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
        if (
            old is not None
            and not fleet_copy
            and not displace
            and rec.median_ms >= old.median_ms * (1 - REPLACE_MARGIN)
        ):
            return old, False
        for k, v in values.items():
            setattr(row, k, v)
        row.fleet_checked_at = row.fleet_generation = None
        row.submission_id = row.retime_queued_at = None  # a new winner: Store.publish links its submission
        row.reports = 0
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
            tune_seconds=rec.tune_seconds,
            start_seconds=rec.start_seconds,
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

    def _add_trials(
        self, s: Session, key: TuneKey, trials: Iterable[TrialRecord], run_id: str | None, trusted: bool
    ) -> None:
        """`trusted`: measured by this host, a worker or an admin; not a submission's claim."""
        run_id = run_id or uuid.uuid4().hex
        rows = [
            dict(
                digest=key.digest,
                run_id=run_id,
                kernel=key.kernel,
                config=t.config,
                status=t.status,
                median_ms=t.median_ms,
                error=(t.error or None) and t.error[:4000],
                created_at=utcnow(),
                trusted=trusted,
            )
            for t in trials
        ]
        if len(rows) >= COPY_ROWS and self.dialect == "postgresql":
            _copy_trials(s, rows)
        elif rows:  # one executemany, not the ORM's unit of work: 500 trials cost 10 ms, not 50
            s.execute(TrialRow.__table__.insert(), rows)

    def add_trials(self, key: TuneKey, trials: Iterable[TrialRecord], run_id: str | None = None) -> None:
        if not self.writable:
            return  # as put_config: a read-only store keeps nothing, and says so once when opened
        with self._write() as s:
            self._add_trials(s, key, trials, run_id, trusted=True)

    def trials(self, digest: str | None = None) -> list[TrialRecord]:
        with self._read() as s:
            q = select(TrialRow).order_by(TrialRow.id)
            if digest:
                q = q.where(TrialRow.digest == digest)
            return [TrialRecord(r.config, r.status, r.median_ms, r.error) for r in s.execute(q).scalars()]

    def ranking_trials(
        self, arch: str, kernel: str | None = None, limit: int = 50_000, trusted_only: bool = False
    ) -> list[tuple]:
        """Measured trials of the problems tuned on `arch`, newest first, as (kernel, problem,
        config, milliseconds): what tunecache.tuning.ranking learns the candidates' order from.
        `trusted_only`: none a submission only claimed (what the fleet serves)."""
        with self._read() as s:
            q = (
                select(TrialRow.kernel, TunedConfigRow.problem, TrialRow.config, TrialRow.median_ms)
                .join(TunedConfigRow, TunedConfigRow.digest == TrialRow.digest)
                .where(TrialRow.status == "ok", TrialRow.median_ms > 0, TunedConfigRow.arch == arch)
                .order_by(TrialRow.id.desc())
                .limit(limit)
            )
            if kernel:
                q = q.where(TrialRow.kernel == kernel)
            if trusted_only:
                q = q.where(TrialRow.trusted)
            return [tuple(r) for r in s.execute(q)]

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

    def past_tunes(self, kernel: str, arch: str, sm_count: int, limit: int = 50) -> list[ConfigRecord]:
        """The winners of `kernel` on a device class that were tuned here, with how long each
        tune took (`tune_seconds`, `start_seconds`), newest first: what the next tune's estimate
        learns from (tunecache.tuning.estimate). Fleet copies and imports took no time here."""
        with self._read() as s:
            q = (
                select(TunedConfigRow)
                .where(
                    TunedConfigRow.kernel == kernel,
                    TunedConfigRow.arch == arch,
                    TunedConfigRow.sm_count == sm_count,
                    TunedConfigRow.tune_seconds.is_not(None),
                    TunedConfigRow.candidates > 0,
                    TunedConfigRow.source != "fleet",
                )
                .order_by(TunedConfigRow.tuned_at.desc(), TunedConfigRow.id.desc())
                .limit(limit)
            )
            return _readable(s.execute(q).scalars())

    def find_configs(self, prefix: str) -> list[ConfigRecord]:
        """Rows whose digest starts with `prefix` (for `tunecache show`)."""
        with self._read() as s:
            q = select(TunedConfigRow).where(TunedConfigRow.digest.startswith(prefix)).limit(20)
            return [config_record(r) for r in s.execute(q).scalars()]

    def delete_config(self, digest: str, actor: TokenRecord | str | None = None) -> bool:
        """Remove a winner and its compiled kernels (hosts drop their copies: the generation
        moves), audited as `actor`'s when one is given; False if there was none."""
        with self._write() as s:
            row = s.execute(select(TunedConfigRow).where(TunedConfigRow.digest == digest)).scalar_one_or_none()
            if row is None:
                return False
            s.delete(row)
            s.execute(KernelBinaryRow.__table__.delete().where(KernelBinaryRow.digest == digest))
            self._bump_generation(s)
        if actor is not None:
            self.audit(actor, "config.delete", f"config:{digest}")
        return True

    # ---- a winner's compiled kernels (tunecache.tuning.binaries) ---------------------------------

    def put_binaries(self, digest: str, config: dict, binaries: list[Binary], uploaded_by: str) -> bool:
        """Keep `binaries` as the compiled kernels of the key's winner, replacing the key's
        others; False (nothing kept) unless `config` is the winner's config. Callers check each
        binary against the key first (`binaries.refusal`)."""
        with self._write() as s:
            row = locked(s, TunedConfigRow, digest)
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
