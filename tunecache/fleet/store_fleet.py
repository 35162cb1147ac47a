"""`StoreFleet`: the `Fleet` of a store reached directly — a host's SQLite file (its own queue),
or the fleet's Postgres with its URL, as the service reaches it. The store holds every rule;
this side only answers in the protocol's types."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping

from tunecache.fleet.protocol import ANY_RUNS, KEPT_EXISTING, WON, ClaimedJob, FleetError, Published, Runs, SyncAnswer
from tunecache.key import DeviceClass, TuneKey
from tunecache.store.records import (
    ANNOUNCE_S,
    TRIALS_SERVED,
    Announcement,
    ConfigRecord,
    JobRecord,
    PurgeReport,
    TrialRecord,
    whoami,
)

if TYPE_CHECKING:
    from tunecache.store import Store
    from tunecache.tuning.binaries import Binary


class StoreFleet:
    def __init__(self, store: Store, actor: str | None = None) -> None:
        self.store = store
        self.actor = actor or f"lib:{whoami()}"  # who publishes and whose admin actions are audited
        self.generation: int | None = None

    @property
    def where(self) -> str:
        return self.store.safe_url

    # ---- configs --------------------------------------------------------------------------

    def lookup(self, key: TuneKey) -> ConfigRecord | None:
        return self.store.get_config(key.digest)

    def fetch(self, key: TuneKey) -> tuple[str, ConfigRecord | None]:
        rec = self.lookup(key)
        return ("miss", None) if rec is None else ("hit", rec)

    def current_generation(self) -> int | None:
        self.generation = self.store.generation()
        return self.generation

    def binaries(self, digest: str) -> tuple[dict, list[Binary]] | None:
        rec = self.store.get_config(digest)
        found = self.store.get_binaries([digest]).get(digest)
        return None if rec is None or not found else (rec.config, found)

    def publish(
        self, rec: ConfigRecord, trials: Iterable[TrialRecord] = (), tune_seconds: float | None = None
    ) -> Published:
        """A worker's result, as the service keeps a worker token's: the faster one wins, and the
        submission is recorded either way."""
        kept, won, sid = self.store.publish(rec, trials, submitted_by=self.actor, tune_seconds=tune_seconds)
        return Published(WON if won else KEPT_EXISTING, sid, kept)

    def publish_binaries(self, rec: ConfigRecord, binaries: list[Binary]) -> bool | None:
        """A fleet's database (not a host's own SQLite file, whose kernels are in this host's
        Triton cache already) keeps them for the hosts that copy the winner."""
        if not binaries or self.store.dialect == "sqlite":
            return None
        return self.store.put_binaries(rec.digest, rec.config, binaries, self.actor)

    def report(self, key: TuneKey, config: dict, error: str) -> bool | None:
        self.store.report(key.digest, config, error, self.actor)
        return True

    def sync(
        self, device: DeviceClass, triton_version: str, kernel_versions: Mapping[str, str] | None, binaries: bool = True
    ) -> SyncAnswer:
        recs = self.store.device_configs(device.arch, device.sm_count, triton_version, kernel_versions)
        found = self.store.get_binaries([r.digest for r in recs]) if binaries and recs else {}
        return SyncAnswer(self.store.generation(), recs, found, [])

    def trials(self, kernel: str, arch: str) -> list[tuple] | None:
        return self.store.ranking_trials(arch, kernel, limit=TRIALS_SERVED, trusted_only=True)

    # ---- the queue ------------------------------------------------------------------------

    def enqueue(self, key: TuneKey, priority: int = 0, max_attempts: int = 3) -> bool | None:
        return self.store.enqueue(key, priority=priority, max_attempts=max_attempts) is not None

    def enqueue_missing(self, keys: list[TuneKey], priority: int = 0, max_attempts: int = 3) -> set[str] | None:
        """Enqueue, in order, the keys without a tuned config; the digests of those with one."""
        tuned, _ = self.store.enqueue_missing((k, priority, max_attempts) for k in keys)
        return set(tuned)

    def statuses(self, digests: Iterable[str]) -> dict[str, str] | None:
        return self.store.job_statuses(digests)

    def announce(self, key: TuneKey, holder: str, seconds: float = ANNOUNCE_S) -> Announcement | None:
        return self.store.announce(key, holder, self.actor, seconds)

    def active(self, device: DeviceClass) -> int | None:
        c = self.store.job_counts(arch=device.arch, sm_count=device.sm_count)
        return c["queued"] + c["running"]

    def claim(self, owner: str, device: DeviceClass, lease_s: float, runs: Runs = ANY_RUNS) -> ClaimedJob | None:
        rec = self.store.claim_job(
            owner,
            arch=device.arch,
            sm_count=device.sm_count,
            lease_s=lease_s,
            kernel_versions=runs.kernel_versions,
            triton_version=runs.triton_version,
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

    # ---- operators ------------------------------------------------------------------------

    def jobs(self, status: str | None = None, limit: int = 1000, device: DeviceClass | None = None) -> list[JobRecord]:
        from tunecache.store.engine import STORE_ERRORS

        try:
            return self.store.list_jobs(
                status=status, limit=limit, arch=device and device.arch, sm_count=device and device.sm_count
            )
        except STORE_ERRORS as e:
            raise FleetError(f"cannot read the queue at {self.where}: {e}") from None

    def retry(self, digest: str) -> JobRecord:
        from tunecache.store.faults import JobStateError

        try:
            job = self.store.retry_job(digest, actor=self.actor)
        except JobStateError as e:
            raise FleetError(str(e)) from None
        if job is None:
            raise FleetError(f"no job for digest {digest} in {self.where}")
        return job

    def drop_job(self, digest: str) -> None:
        if self.store.drop_job(digest, actor=self.actor) is None:
            raise FleetError(f"no job for digest {digest} in {self.where}")

    def drop(self, digest: str) -> None:
        if not self.store.delete_config(digest, actor=self.actor):
            raise FleetError(f"no tuned config with digest {digest} in {self.where}")

    def purge(self, token_name: str, dry_run: bool = False) -> PurgeReport:
        return self.store.purge_token(token_name, dry_run=dry_run, actor=self.actor)
