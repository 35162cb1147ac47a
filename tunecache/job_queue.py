"""The tuning queue as workers, `tunecache pretune` and `tunecache jobs` see it: one interface,
`JobQueue`, over the two places a queue lives.

- `StoreQueue`: a store's own queue (SQLite on one host, or the fleet's Postgres reached
  directly with its URL).
- `FleetQueue`: the fleet service's queue, through `FleetClient` (TUNECACHE_SERVER_URL).

The adapters only translate calls. Every rule of the queue (lease secrets, caps, the database's
clock, backoff, quarantine) lives in the store, which the service runs too; the store and the
client take the same arguments for the lease calls (job id, lease secret).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Protocol

from .faults import JobStateError
from .key import DeviceClass, TuneKey
from .records import ConfigRecord, JobRecord, TrialRecord, whoami

if TYPE_CHECKING:  # the fleet client loads neither; a StoreQueue is handed a store already open
    from .binaries import Binary
    from .client import FleetClient
    from .store import Store


@dataclass
class ClaimedJob:
    """A leased job: what a worker needs to tune it, and the secret that holds its lease."""

    id: int
    key: TuneKey
    attempts: int
    max_attempts: int
    lease_secret: str = field(default="", repr=False)  # never in a log line
    retime: bool = False  # the key has a winner that a submission claimed to beat: tune it even so

    @property
    def digest(self) -> str:
        return self.key.digest


class QueueError(RuntimeError):
    """An operator's queue operation that could not be done; the message says why."""


class JobQueue(Protocol):
    """What a worker, pretune and the `jobs` commands need of a queue.

    The lease calls answer True (done), False (the lease is not held: it ran out and the job
    was claimed again, or it is finished) or None (the queue could not be reached: a lease may
    still hold). The operators' calls raise QueueError with the reason."""

    @property
    def where(self) -> str: ...

    # hosts and pretune
    def enqueue(self, key: TuneKey, priority: int = 0, max_attempts: int = 3) -> Any | None: ...
    def lookup(self, key: TuneKey) -> ConfigRecord | None: ...
    def enqueue_missing(self, keys: list[TuneKey], priority: int = 0) -> set[str] | None: ...
    def statuses(self, digests: Iterable[str]) -> dict[str, str] | None: ...
    def active(self, device: DeviceClass) -> int | None: ...

    # workers
    def claim(
        self,
        owner: str,
        device: DeviceClass,
        lease_s: float,
        kernel_versions: Mapping[str, str] | None = None,
        triton_version: str | None = None,
    ) -> ClaimedJob | None: ...
    def heartbeat(self, job: ClaimedJob, lease_s: float) -> bool | None: ...
    def complete(self, job: ClaimedJob, tune_seconds: float | None = None) -> bool | None: ...
    def fail(self, job: ClaimedJob, error: str, backoff_s: float = 5.0) -> bool | None: ...
    def release(self, job: ClaimedJob) -> bool | None: ...
    def publish(self, rec: ConfigRecord, trials: Iterable[TrialRecord], tune_seconds: float | None) -> Any: ...
    def publish_binaries(self, rec: ConfigRecord, binaries: list[Binary]) -> bool | None: ...

    # operators
    def jobs(
        self, status: str | None = None, limit: int = 1000, device: DeviceClass | None = None
    ) -> list[JobRecord]: ...
    def retry(self, digest: str) -> JobRecord: ...
    def drop(self, digest: str) -> None: ...


def made_winner(sent: Any) -> bool:
    """Whether a publish's answer (`JobQueue.publish`, `FleetClient.publish`) says the result
    is now the winner: a store queue's True, or the service's {"accepted": true}."""
    return sent is True or (isinstance(sent, dict) and bool(sent.get("accepted")))


class StoreQueue:
    """A store's queue. Results are kept by the tuner in this same store (publish is a no-op)."""

    def __init__(self, store: Store, actor: str | None = None) -> None:
        self.store = store
        self.actor = actor or f"lib:{whoami()}"  # who retries and drops are audited as (`cli:user@host`)

    @property
    def where(self) -> str:
        return self.store.safe_url

    def enqueue(self, key: TuneKey, priority: int = 0, max_attempts: int = 3) -> Any | None:
        return self.store.enqueue(key, priority=priority, max_attempts=max_attempts)

    def lookup(self, key: TuneKey) -> ConfigRecord | None:
        return self.store.get_config(key.digest)

    def enqueue_missing(self, keys: list[TuneKey], priority: int = 0) -> set[str] | None:
        """Enqueue, in order, the keys without a tuned config; the digests of those with one."""
        tuned, _ = self.store.enqueue_missing((k, priority, None) for k in keys)
        return set(tuned)

    def statuses(self, digests: Iterable[str]) -> dict[str, str] | None:
        return self.store.job_statuses(digests)

    def active(self, device: DeviceClass) -> int | None:
        c = self.store.job_counts(arch=device.arch, sm_count=device.sm_count)
        return c["queued"] + c["running"]

    def claim(
        self,
        owner: str,
        device: DeviceClass,
        lease_s: float,
        kernel_versions: Mapping[str, str] | None = None,
        triton_version: str | None = None,
    ) -> ClaimedJob | None:
        rec = self.store.claim_job(
            owner,
            arch=device.arch,
            sm_count=device.sm_count,
            lease_s=lease_s,
            kernel_versions=kernel_versions,
            triton_version=triton_version,
        )
        if rec is None:
            return None
        return ClaimedJob(rec.id, rec.key, rec.attempts, rec.max_attempts, rec.lease_secret or "", rec.retime)

    def heartbeat(self, job: ClaimedJob, lease_s: float) -> bool | None:
        return self.store.heartbeat(job.id, job.lease_secret, lease_s=lease_s)

    def complete(self, job: ClaimedJob, tune_seconds: float | None = None) -> bool | None:
        return self.store.complete_job(job.id, job.lease_secret)

    def fail(self, job: ClaimedJob, error: str, backoff_s: float = 5.0) -> bool | None:
        return self.store.fail_job(job.id, job.lease_secret, error, backoff_s=backoff_s) is not None

    def release(self, job: ClaimedJob) -> bool | None:
        return self.store.release_job(job.id, job.lease_secret)

    def publish(self, rec: ConfigRecord, trials: Iterable[TrialRecord], tune_seconds: float | None) -> Any:
        return True  # the tuner stored it in this very store

    def publish_binaries(self, rec: ConfigRecord, binaries: list[Binary]) -> bool | None:
        """A fleet's database (not a host's own SQLite file, whose kernels are in this host's
        Triton cache already) keeps them for the hosts that copy the winner."""
        if not binaries or self.store.dialect == "sqlite":
            return None
        return self.store.put_binaries(rec.digest, rec.config, binaries, self.actor)

    def jobs(self, status: str | None = None, limit: int = 1000, device: DeviceClass | None = None) -> list[JobRecord]:
        from .engine import STORE_ERRORS

        try:
            return self.store.list_jobs(
                status=status, limit=limit, arch=device and device.arch, sm_count=device and device.sm_count
            )
        except STORE_ERRORS as e:
            raise QueueError(f"cannot read the queue at {self.where}: {e}") from None

    def retry(self, digest: str) -> JobRecord:
        try:
            job = self.store.retry_job(digest)
        except JobStateError as e:
            raise QueueError(str(e)) from None
        if job is None:
            raise QueueError(f"no job for digest {digest} in {self.where}")
        self.store.audit(self.actor, "job.retry", f"job:{digest}", {"kernel": job.key.kernel})
        return job

    def drop(self, digest: str) -> None:
        job = self.store.get_job(digest)
        if job is None or not self.store.drop_job(digest):
            raise QueueError(f"no job for digest {digest} in {self.where}")
        self.store.audit(self.actor, "job.drop", f"job:{digest}", {"kernel": job.key.kernel, "status": job.status})


class FleetQueue:
    """The fleet service's queue. A worker keeps its results in its local store too (the worker
    writes them there before it publishes)."""

    def __init__(self, client: "FleetClient") -> None:
        self.client = client

    @property
    def where(self) -> str:
        return self.client.url

    def enqueue(self, key: TuneKey, priority: int = 0, max_attempts: int = 3) -> Any | None:
        return self.client.enqueue(key, priority=priority, max_attempts=max_attempts)

    def lookup(self, key: TuneKey) -> ConfigRecord | None:
        return self.client.lookup(key)

    def enqueue_missing(self, keys: list[TuneKey], priority: int = 0) -> set[str] | None:
        return self.client.enqueue_missing(keys, priority=priority)

    def statuses(self, digests: Iterable[str]) -> dict[str, str] | None:
        return self.client.job_statuses(digests)

    def active(self, device: DeviceClass) -> int | None:
        c = self.client.queue_counts(device)
        return None if c is None else c.get("queued", 0) + c.get("running", 0)

    def claim(
        self,
        owner: str,
        device: DeviceClass,
        lease_s: float,
        kernel_versions: Mapping[str, str] | None = None,
        triton_version: str | None = None,
    ) -> ClaimedJob | None:
        return self.client.claim(
            owner, device, lease_s=lease_s, kernel_versions=kernel_versions, triton_version=triton_version
        )

    def heartbeat(self, job: ClaimedJob, lease_s: float) -> bool | None:
        return self.client.heartbeat(job.id, job.lease_secret, lease_s=lease_s)

    def complete(self, job: ClaimedJob, tune_seconds: float | None = None) -> bool | None:
        return self.client.complete(job.id, job.lease_secret, tune_seconds=tune_seconds)

    def fail(self, job: ClaimedJob, error: str, backoff_s: float = 5.0) -> bool | None:
        return self.client.fail(job.id, job.lease_secret, error, backoff_s=backoff_s)

    def release(self, job: ClaimedJob) -> bool | None:
        return self.client.release(job.id, job.lease_secret)

    def publish(self, rec: ConfigRecord, trials: Iterable[TrialRecord], tune_seconds: float | None) -> Any:
        return self.client.publish(rec, trials, tune_seconds=tune_seconds)

    def publish_binaries(self, rec: ConfigRecord, binaries: list[Binary]) -> bool | None:
        return self.client.publish_binaries(rec.key, rec.config, binaries) if binaries else None

    def _answer(self, res: tuple[int, Any] | None, what: str) -> Any:
        if res is None:
            raise QueueError(f"the fleet at {self.where} could not be reached to {what} (see the warning above)")
        status, body = res
        if status != 200:
            raise QueueError(f"the fleet at {self.where} answered {status}: {body}")
        return body

    def jobs(self, status: str | None = None, limit: int = 1000, device: DeviceClass | None = None) -> list[JobRecord]:
        body = self._answer(self.client.list_jobs(status=status, limit=limit, device=device), "list its jobs")
        try:
            return [job_record_from_json(j) for j in body]
        except (TypeError, KeyError, ValueError) as e:
            raise QueueError(f"the fleet at {self.where} sent a job list this client cannot read: {e}") from None

    def retry(self, digest: str) -> JobRecord:
        return job_record_from_json(self._answer(self.client.retry_job(digest), f"retry job {digest[:12]}"))

    def drop(self, digest: str) -> None:
        self._answer(self.client.drop_job(digest), f"drop job {digest[:12]}")


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


def default_queue(store: Store | None = None) -> JobQueue:
    """The fleet's queue when TUNECACHE_SERVER_URL is set, else the local store's."""
    from . import settings
    from .store import default_store

    url = settings.server_url()
    if url:
        from .client import fleet_client

        return FleetQueue(fleet_client(url))
    return StoreQueue(store or default_store())
