"""The tuning queue: enqueue, claim under a lease, heartbeat, complete, fail, retry, drop, expire;
and who tunes a key of the fleet (announce)."""

from __future__ import annotations

import secrets
from datetime import datetime
from typing import Any, Iterable, Mapping

from sqlalchemy import and_, case, false, func, or_, select, update
from sqlalchemy.orm import Session

from tunecache.key import TuneKey
from tunecache.store.base import CLAIM_SCAN, LEASE_PREFIX, StoreBase, locked, log
from tunecache.store.engine import insert_ignore
from tunecache.store.faults import (
    JobStateError,
)
from tunecache.store.records import (
    ANNOUNCE_S,
    JOB_STATUSES,
    MAX_BACKOFF_S,
    MAX_LEASE_S,
    Announcement,
    JobRecord,
    QueueWait,
    TokenRecord,
    hash_token,
)
from tunecache.store.rows import (
    AnnouncementRow,
    SubmissionRow,
    TunedConfigRow,
    TuningJobRow,
    job_record,
)

# what a job without a lease holds: no owner, no secret's hash, no expiry
NO_LEASE: dict[str, Any] = {"lease_owner": None, "lease_hash": None, "lease_expires_at": None}


def update_jobs(s: Session, where: tuple, **values: Any) -> Any:
    """UPDATE tuning_jobs SET `values` WHERE all of `where`, in one statement; the session's
    loaded rows are left as they are (a caller that reads one again refreshes it)."""
    return s.execute(update(TuningJobRow).where(*where).values(**values).execution_options(synchronize_session=False))


class JobStore(StoreBase):
    """The tuning queue: enqueue, claim under a lease, heartbeat, complete, fail, retry, drop, expire."""

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
                    **NO_LEASE,
                )
            if priority > row.priority and (row.status == "queued" or changes):
                changes["priority"] = priority
            if changes:
                update_jobs(s, (TuningJobRow.id == row.id,), **changes, updated_at=now)
                s.refresh(row)
            return job_record(row)

    def announce(self, key: TuneKey, holder: str, token_name: str, seconds: float = ANNOUNCE_S) -> Announcement:
        """Who tunes `key` across the fleet: a worker holding its job's lease, another host that
        announced it (until its announcement lapses, or its submission answers it), or else the
        caller, `holder` (for people: the host's words) with the token `token_name`, for the
        next `seconds` (a call again renews it; 0 withdraws it). Times are the database's.

        A host's result stays a submission (the fleet's winner is made by a worker's re-time):
        what the others get of it is `hint`, to time against their default before they run it."""
        seconds = min(max(float(seconds), 0.0), MAX_LEASE_S)
        now = self._now_sql()
        with self._write() as s:
            db_now = s.execute(select(now)).scalar_one()
            job = s.execute(select(TuningJobRow).where(TuningJobRow.digest == key.digest)).scalar_one_or_none()
            if job is not None and job.status == "running" and job.lease_expires_at is not None:
                if job.lease_expires_at > db_now:
                    left = (job.lease_expires_at - db_now).total_seconds()
                    return Announcement("tuning", holder=f"worker {job.lease_owner or ''}".strip(), seconds_left=left)
            mine = dict(
                holder=holder[:128], token_name=token_name[:128], created_at=now, expires_at=self._now_sql(seconds)
            )
            if insert_ignore(s, AnnouncementRow.__table__, dict(digest=key.digest, **mine)):
                return Announcement("yours", seconds_left=seconds)
            row = locked(s, AnnouncementRow, key.digest)
            if row.holder == holder[:128] and row.token_name == token_name[:128]:
                s.execute(update(AnnouncementRow).where(AnnouncementRow.id == row.id).values(**mine))
                return Announcement("yours", seconds_left=seconds)
            sub = s.execute(
                select(SubmissionRow)
                .where(SubmissionRow.digest == key.digest, SubmissionRow.submitted_by == row.token_name)
                .order_by(SubmissionRow.id.desc())
                .limit(1)
            ).scalar_one_or_none()
            if sub is not None and isinstance(sub.config, dict):
                return Announcement("submitted", holder=row.holder, hint=sub.config, hint_ms=sub.median_ms)
            if row.expires_at > db_now:
                left = (row.expires_at - db_now).total_seconds()
                return Announcement("tuning", holder=row.holder, seconds_left=left)
            # it lapsed with nothing submitted (that host died, or gave up): the caller's now
            s.execute(update(AnnouncementRow).where(AnnouncementRow.id == row.id).values(**mine))
            return Announcement("yours", seconds_left=seconds)

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

        A job whose key a host announced it tunes (`announce`) waits until that host is done.

        On the way, in the same call: a job whose last attempt's lease ran out is marked failed
        (its worker died on every attempt), and a row that cannot be read is quarantined; the
        claim goes on to the next job.
        """
        lease_s = min(float(lease_s), MAX_LEASE_S)
        now = self._now_sql()
        with self._write() as s:
            self._fail_lapsed_last_attempts(s, arch, sm_count)
            self._expire_queued(s)  # a job nobody took for TUNECACHE_JOB_TTL_S is not handed out
            announced = (  # a host of the fleet tunes the key now (announce): its result comes first
                select(AnnouncementRow.id)
                .where(AnnouncementRow.digest == TuningJobRow.digest, AnnouncementRow.expires_at > now)
                .exists()
            )
            q = self._device_class_filter(
                select(TuningJobRow).where(
                    ((TuningJobRow.status == "queued") & (TuningJobRow.not_before <= now))
                    | (
                        (TuningJobRow.status == "running")
                        & (TuningJobRow.lease_expires_at < now)
                        & (TuningJobRow.attempts < TuningJobRow.max_attempts)
                    ),
                    ~announced,
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
                    update_jobs(
                        s,
                        (TuningJobRow.id == row.id,),
                        status="quarantined",
                        **NO_LEASE,
                        last_error=f"quarantined: the row cannot be read ({rec.unreadable})",
                        updated_at=now,
                    )
                    continue
                secret = LEASE_PREFIX + secrets.token_urlsafe(32)
                update_jobs(
                    s,
                    (TuningJobRow.id == row.id,),
                    status="running",
                    lease_owner=owner[:128],
                    lease_hash=hash_token(secret),
                    lease_expires_at=self._now_sql(lease_s),
                    attempts=TuningJobRow.attempts + 1,
                    updated_at=now,
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
            update_jobs(
                s,
                (TuningJobRow.id == job_id,),
                status="failed",
                **NO_LEASE,
                updated_at=now,
                last_error="\n".join(filter(None, [last_error, why]))[-8000:],
            )

    @staticmethod
    def _held(job_id: int, lease_secret: str) -> tuple:
        """The running job `job_id` whose lease this secret holds."""
        return (
            TuningJobRow.id == job_id,
            TuningJobRow.status == "running",
            TuningJobRow.lease_hash == hash_token(lease_secret),
        )

    def _update_held(self, job_id: int, lease_secret: str, **values: Any) -> bool:
        """Set `values` on the job if `lease_secret` holds its lease; whether it did (a lease
        call without a secret holds nothing)."""
        if not lease_secret:
            return False
        with self._write() as s:
            return update_jobs(s, self._held(job_id, lease_secret), **values).rowcount == 1

    def heartbeat(self, job_id: int, lease_secret: str, lease_s: float = 60.0) -> bool:
        """Extend the lease (capped at MAX_LEASE_S); False unless `lease_secret` holds it (the
        lease ran out and the job was claimed again, it is finished, or the secret is wrong)."""
        return self._update_held(
            job_id,
            lease_secret,
            lease_expires_at=self._now_sql(min(float(lease_s), MAX_LEASE_S)),
            updated_at=self._now_sql(),
        )

    def complete_job(self, job_id: int, lease_secret: str) -> bool:
        return self._update_held(job_id, lease_secret, status="done", **NO_LEASE, updated_at=self._now_sql())

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
            values: dict[str, Any] = dict(last_error=error[:8000], **NO_LEASE, updated_at=now)
            if row.attempts >= row.max_attempts:
                values["status"] = "failed"
            else:
                # capped: an exponent of a few dozen attempts would overflow datetime
                wait = min(max(float(backoff_s), 0.0) * 2 ** min(row.attempts - 1, 30), MAX_BACKOFF_S)
                values.update(status="queued", not_before=self._now_sql(wait))
            update_jobs(s, (TuningJobRow.id == row.id,), **values)
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

    def retry_job(self, digest: str, actor: TokenRecord | str | None = None) -> JobRecord | None:
        """Queue a failed, quarantined or backing-off job again now, its attempts reset (its
        last error is kept), audited as `actor`'s. None if there is no such job; JobStateError if
        it is running, done, or cannot be read."""
        now = self._now_sql()
        with self._write() as s:
            row = locked(s, TuningJobRow, digest)
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
            update_jobs(
                s,
                (TuningJobRow.id == row.id,),
                status="queued",
                attempts=0,
                not_before=now,
                **NO_LEASE,
                updated_at=now,
            )
            s.refresh(row)
            job = job_record(row)
        if actor is not None:
            self.audit(actor, "job.retry", f"job:{digest}", {"kernel": job.key.kernel})
        return job

    def drop_job(self, digest: str, actor: TokenRecord | str | None = None) -> JobRecord | None:
        """Delete the job of this digest, in whatever state (a worker holding it loses its lease),
        audited as `actor`'s; the job as it was, or None if there was none."""
        with self._write() as s:
            row = locked(s, TuningJobRow, digest)
            if row is None:
                return None
            job = job_record(row)
            s.execute(TuningJobRow.__table__.delete().where(TuningJobRow.id == row.id))
        if actor is not None:
            self.audit(actor, "job.drop", f"job:{digest}", {"kernel": job.key.kernel, "status": job.status})
        return job

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

    def _expire_queued(self, s: Session, ttl_s: float | None = None) -> int:
        """Mark jobs queued for longer than the TTL (TUNECACHE_JOB_TTL_S, since they last became
        queued, by the database's clock) as failed, saying so: no worker of their device class
        took them. Runs in the caller's write transaction (prune; a claim may call it first);
        returns how many."""
        from tunecache import settings

        ttl = settings.job_ttl_s() if ttl_s is None else ttl_s
        res = update_jobs(
            s,
            (
                TuningJobRow.status == "queued",
                TuningJobRow.updated_at < self._now_sql(-ttl),
            ),
            status="failed",
            updated_at=self._now_sql(),
            last_error=f"expired: queued for over {ttl / 86400:g} day(s) without a worker claiming it "
            f"(TUNECACHE_JOB_TTL_S); `tunecache jobs retry` queues it again",
        )
        return res.rowcount

    def expire_queued_jobs(self, ttl_s: float | None = None) -> int:
        """_expire_queued in a transaction of its own."""
        with self._write() as s:
            return self._expire_queued(s, ttl_s)

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
        now = self._now_sql()
        return self._update_held(
            job_id,
            lease_secret,
            status="queued",
            **NO_LEASE,
            not_before=now,
            attempts=func.max(TuningJobRow.attempts - 1, 0)
            if self.dialect == "sqlite"
            else func.greatest(TuningJobRow.attempts - 1, 0),
            updated_at=now,
        )
