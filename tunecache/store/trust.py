"""The fleet's trust: results published by workers, submissions others make, reports of configs
that cannot launch, API tokens, the audit log and retention."""

from __future__ import annotations

import secrets
from dataclasses import replace
from datetime import timedelta
from typing import Any, Iterable, Mapping

from sqlalchemy import func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tunecache.key import TuneKey
from tunecache.store.base import REPLACE_MARGIN, TOKEN_PREFIX, StoreBase, locked
from tunecache.store.engine import insert_ignore
from tunecache.store.jobs import NO_LEASE, update_jobs
from tunecache.store.records import (
    TOKEN_SCOPES,
    AuditRecord,
    ConfigRecord,
    JobRecord,
    PurgeReport,
    SubmissionRecord,
    TokenRecord,
    TrialRecord,
    hash_token,
    utcnow,
)
from tunecache.store.rows import (
    AnnouncementRow,
    ApiTokenRow,
    AuditRow,
    KernelBinaryRow,
    SubmissionRow,
    TrialRow,
    TunedConfigRow,
    TuningJobRow,
    config_record,
    job_record,
    key_of,
    record_of,
    result_values,
    submission_record,
    token_record,
)

# what the fleet keeps of one published run's trials (the rest are dropped: the request's cap
# is ConfigIn's 2,000, the largest shipped config space 720)
TRIALS_PER_SUBMISSION = 500
TRIAL_ERROR_CHARS = 500


class TrustStore(StoreBase):
    """The fleet's trust: results published by workers, submissions others make, reports of configs"""

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
        this for trusted results only (worker and admin tokens); others go to `submit`.

        A winner that hosts reported they cannot launch (`report`) is replaced by a result whose
        trials never ran it (a re-time whose pruning refused it too), slower or not: a time
        measured beats a time claimed that no host can reproduce."""
        values = result_values(rec)
        trials = list(trials)
        with self._write() as s:
            displace = self._unlaunchable_winner(s, rec, trials)
            self._add_fleet_trials(s, rec.key, trials, run_id, trusted=True)
            kept, won = self._keep_faster(s, rec, values, displace=displace)
            row = self._add_submission(s, values, submitted_by, won, tune_seconds)
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
            self._add_fleet_trials(s, rec.key, trials, run_id, trusted=False)
            sub = self._add_submission(s, values, submitted_by, False, tune_seconds)
            row = locked(s, TunedConfigRow, rec.digest)
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

    @staticmethod
    def _add_submission(
        s: Session, values: dict, submitted_by: str, accepted: bool, tune_seconds: float | None
    ) -> SubmissionRow:
        """The submission's row (its result's columns `values`), added and flushed for its id."""
        row = SubmissionRow(
            **values, submitted_by=submitted_by[:128], accepted=accepted, tune_seconds=tune_seconds, created_at=utcnow()
        )
        s.add(row)
        s.flush()
        return row

    def report(self, digest: str, config: dict, error: str, reported_by: str) -> tuple[bool, JobRecord | None]:
        """A host could not launch the winner's config: keep the report as a failed trial of the
        key and, if it is about the current winner, count it against the winner and queue the
        key's re-timing (at the first report against this winner, or once per winner as for a
        submission that beats it). A re-time that finds only other configs then replaces the
        winner (`publish`). Returns (whether there is a winner, the job)."""
        with self._write() as s:
            row = locked(s, TunedConfigRow, digest)
            if row is None:
                return False, None
            key = key_of(row)
            report = TrialRecord(config=config, status="failed", error=f"reported by {reported_by}: {error}")
            self._add_fleet_trials(s, key, [report], None, trusted=False)
            if row.config != config:
                return True, None
            row.reports = (row.reports or 0) + 1
            if row.reports > 1 and row.retime_queued_at is not None:
                return True, None  # re-timed already for this winner
            row.retime_queued_at = utcnow()
            job = self._queue_timing(s, key, retime=True)
            return True, job if job.status in ("queued", "running") else None

    def _unlaunchable_winner(self, s: Session, rec: ConfigRecord, trials: list[TrialRecord]) -> bool:
        """Whether `rec` (a trusted result with its trials) replaces the key's winner whatever
        their times: hosts reported the winner unlaunchable, and this run's trials, which hold
        every candidate its host could launch, never ran the winner's config."""
        if not trials:  # an import or a bare result says nothing of what its host could launch
            return False
        row = locked(s, TunedConfigRow, rec.digest)
        if row is None or not row.reports or row.config == rec.config:
            return False
        return not any(t.status == "ok" and t.config == row.config for t in trials)

    def _add_fleet_trials(
        self, s: Session, key: TuneKey, trials: Iterable[TrialRecord], run_id: str | None, trusted: bool
    ) -> None:
        """A published run's trials, bounded: the fastest TRIALS_PER_SUBMISSION (measured ones
        first, then failures, errors cut to TRIAL_ERROR_CHARS), and the key's newest
        TUNECACHE_TRIALS_PER_KEY kept (older ones deleted here). `trusted`: a worker's or an
        admin's (ranking_trials serves those), not a submission's claim."""
        from tunecache import settings

        trials = list(trials)
        timed = sorted((t for t in trials if t.median_ms is not None), key=lambda t: t.median_ms)
        kept = [*timed, *(t for t in trials if t.median_ms is None)][:TRIALS_PER_SUBMISSION]
        kept = [
            t if not t.error or len(t.error) <= TRIAL_ERROR_CHARS else replace(t, error=t.error[:TRIAL_ERROR_CHARS])
            for t in kept
        ]
        self._add_trials(s, key, kept, run_id, trusted)
        s.flush()
        newest = (
            select(TrialRow.id)
            .where(TrialRow.digest == key.digest)
            .order_by(TrialRow.id.desc())
            .limit(settings.trials_per_key())
        )
        s.execute(
            TrialRow.__table__.delete().where(
                TrialRow.digest == key.digest, TrialRow.id.not_in(newest.scalar_subquery())
            )
        )

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
                **NO_LEASE,
                last_error=None,
                retime=retime,
            )
        elif row.status in ("queued", "running") and retime and not row.retime:
            changes = dict(retime=True)
        if changes:
            update_jobs(s, (TuningJobRow.id == row.id,), **changes, updated_at=now)
            s.refresh(row)
        return job_record(row)

    def purge_token(self, name: str, *, dry_run: bool = False, actor: TokenRecord | str | None = None) -> PurgeReport:
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
        report = PurgeReport(name, removed, jobs, n_subs, self.generation(), dry_run)
        if actor is not None and not dry_run:
            self.audit(
                actor, "config.purge", f"token:{name}", {"removed": [r.digest for r in removed], "submissions": n_subs}
            )
        return report

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
                    # the database's clock, as for leases: the service's own clock never decides
                    created_at=self._now_sql(),
                    expires_at=None if expires_in is None else self._now_sql(expires_in.total_seconds()),
                )
                s.add(row)
                s.flush()
                return secret, token_record(row)
        except IntegrityError:  # created at the same moment by someone else
            raise taken from None

    def verify_tokens(self, secrets: list[str]) -> dict[str, TokenRecord | None]:
        """Each secret's live token, or None (unknown, revoked or expired), in one query (the
        service checks the tokens its cache lacks together). Expiry is by the database's clock,
        as leases are (create_token sets it by that clock too), so a service whose clock is off
        neither refuses a live token nor takes an expired one; `live_for_s` says how long it has
        left by that clock."""
        hashes = {hash_token(x): x for x in secrets}
        found: dict[str, TokenRecord | None] = dict.fromkeys(secrets)
        now = self._now_sql()
        with self._read() as s:
            rows = s.execute(
                select(ApiTokenRow, now).where(
                    ApiTokenRow.token_hash.in_(sorted(hashes)),
                    ApiTokenRow.revoked_at.is_(None),
                    or_(ApiTokenRow.expires_at.is_(None), ApiTokenRow.expires_at > now),
                )
            )
            for row, db_now in rows:
                rec = token_record(row)
                if rec.expires_at is not None and db_now is not None:
                    rec.live_for_s = (rec.expires_at - db_now).total_seconds()
                found[hashes[row.token_hash]] = rec
        return found

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
            return [record_of(AuditRecord, r) for r in s.execute(q).scalars()]

    # ---- retention: what grows forever unless pruned -------------------------------------------

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
            s.execute(
                AnnouncementRow.__table__.delete().where(AnnouncementRow.expires_at < self._now_sql(-older_than_s))
            )
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
