"""The fleet as every caller sees it: one `Fleet` protocol, declared here, implemented once per
side with the same signatures and result types.

- `tunecache.fleet.client.FleetClient`: the fleet service over HTTP (TUNECACHE_SERVER_URL);
- `tunecache.fleet.store_fleet.StoreFleet`: a store reached directly (a host's SQLite queue, or
  the fleet's Postgres with its URL, as the service itself does).

Every rule of the fleet (lease secrets, caps, the database's clock, backoff, quarantine, who may
make a winner, the audit log) lives in the store, which the service runs too; the two sides only
carry calls to it. The config cache (`tunecache.cache`), the worker, pretune and the CLI talk
to a `Fleet` and never to a side by name.

Answers: a lease call is True (done), False (the lease is not held: it ran out and the job was
claimed again, or it is finished) or None (the fleet could not be reached: a lease may still
hold). A host's calls answer None when the fleet could not be reached. An operator's call
raises FleetError with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping, NamedTuple, Protocol, runtime_checkable

from tunecache.key import DeviceClass, TuneKey
from tunecache.store.records import ANNOUNCE_S, Announcement, ConfigRecord, JobRecord, PurgeReport, TrialRecord

if TYPE_CHECKING:
    from tunecache.tuning.binaries import Binary


class Runs(NamedTuple):
    """What a worker can tune, for its claims: its kernels' versions and its Triton's (None:
    any; a job of another version is not its work)."""

    kernel_versions: Mapping[str, str] | None = None
    triton_version: str | None = None


ANY_RUNS = Runs()


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


class FleetError(RuntimeError):
    """An operator's fleet call that could not be done; the message says why."""


# what became of a published result
WON = "won"  # it is the winner now
KEPT_EXISTING = "kept_existing"  # the stored winner stays (the result was not faster)
QUEUED = "queued"  # a submission the fleet does not trust to win: a worker re-times the key
RECORDED = "recorded"  # a submission, kept for the record (the winner it claims no more than matches)
REFUSED = "refused"  # the fleet refused it (an invalid result, a token without the right)
UNREACHABLE = "unreachable"  # nothing is known: the fleet could not be reached


@dataclass(frozen=True)
class Published:
    """A publish's answer, the same from either side."""

    status: str
    submission_id: int | None = None
    kept: ConfigRecord | None = None  # the winner the fleet holds after the publish, when it said

    @property
    def won(self) -> bool:
        return self.status == WON

    @property
    def reached(self) -> bool:
        return self.status != UNREACHABLE


@dataclass
class SyncAnswer:
    """Every winner of a device class at once (`Fleet.sync`)."""

    generation: int | None
    configs: list[ConfigRecord]
    binaries: dict[str, list[Binary]]  # digest -> the winner's compiled kernels
    more_binaries: list[str]  # digests whose kernels did not fit the answer: ask `binaries` one by one
    skipped: list[str] = field(default_factory=list)  # entries that could not be read, in words


@runtime_checkable
class Fleet(Protocol):
    """What the config cache, a worker, pretune and the operators' commands need of a fleet."""

    @property
    def where(self) -> str: ...

    # configs: hosts
    generation: int | None  # the fleet's generation as last seen (it moves when a winner is removed or replaced)

    def lookup(self, key: TuneKey) -> ConfigRecord | None: ...
    def fetch(self, key: TuneKey) -> tuple[str, ConfigRecord | None]: ...
    def current_generation(self) -> int | None: ...
    def binaries(self, digest: str) -> tuple[dict, list[Binary]] | None: ...
    def publish(
        self, rec: ConfigRecord, trials: Iterable[TrialRecord] = (), tune_seconds: float | None = None
    ) -> Published: ...
    def publish_binaries(self, rec: ConfigRecord, binaries: list[Binary]) -> bool | None: ...
    def report(self, key: TuneKey, config: dict, error: str) -> bool | None: ...
    def sync(
        self, device: DeviceClass, triton_version: str, kernel_versions: Mapping[str, str] | None, binaries: bool = True
    ) -> SyncAnswer: ...
    # trusted trials of a kernel on an architecture, as (kernel, problem, config, milliseconds):
    # what a host ranks its tunes' candidates by (tunecache.tuning.ranking); None: unreachable
    def trials(self, kernel: str, arch: str) -> list[tuple] | None: ...

    # the queue: hosts and pretune
    def enqueue(self, key: TuneKey, priority: int = 0, max_attempts: int = 3) -> bool | None: ...
    def enqueue_missing(self, keys: list[TuneKey], priority: int = 0, max_attempts: int = 3) -> set[str] | None: ...
    def statuses(self, digests: Iterable[str]) -> dict[str, str] | None: ...
    def announce(self, key: TuneKey, holder: str, seconds: float = ANNOUNCE_S) -> Announcement | None: ...
    def active(self, device: DeviceClass) -> int | None: ...

    # the queue: workers
    def claim(self, owner: str, device: DeviceClass, lease_s: float, runs: Runs = ANY_RUNS) -> ClaimedJob | None: ...
    def heartbeat(self, job: ClaimedJob, lease_s: float) -> bool | None: ...
    def complete(self, job: ClaimedJob, tune_seconds: float | None = None) -> bool | None: ...
    def fail(self, job: ClaimedJob, error: str, backoff_s: float = 5.0) -> bool | None: ...
    def release(self, job: ClaimedJob) -> bool | None: ...

    # operators
    def jobs(
        self, status: str | None = None, limit: int = 1000, device: DeviceClass | None = None
    ) -> list[JobRecord]: ...
    def retry(self, digest: str) -> JobRecord: ...
    def drop_job(self, digest: str) -> None: ...
    def drop(self, digest: str) -> None: ...
    def purge(self, token_name: str, dry_run: bool = False) -> PurgeReport: ...
