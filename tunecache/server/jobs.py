"""/v1/jobs: the tuning queue. Hosts enqueue misses and announce the keys they tune; workers
claim, heartbeat, complete, fail; admins retry and drop jobs."""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from fastapi import APIRouter, HTTPException, Path, Query

from tunecache.server.configs import DigestPath, key_of
from tunecache.server.deps import AdminToken, MetricsDep, PublishToken, ReadToken, StoreDep, WorkerToken
from tunecache.server.schemas import (
    INT32_MAX,
    AnnounceIn,
    AnnounceOut,
    Arch,
    ClaimIn,
    ClaimOut,
    CompleteIn,
    DeleteOut,
    EnqueueIn,
    EnqueueManyIn,
    EnqueueManyOut,
    ErrorOut,
    FailIn,
    JobOut,
    JobStatusOut,
    LeaseHeldIn,
    LeaseIn,
    QueueOut,
    ReleaseIn,
    StatusesIn,
    StatusesOut,
)
from tunecache.store.faults import JobStateError
from tunecache.store.records import JOB_STATUSES, JobRecord

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

JobId = Annotated[int, Path(ge=1, le=INT32_MAX, description="the job's id (from claim)")]
LEASE_LOST = {
    403: {"model": ErrorOut, "description": "no lease secret was sent"},
    409: {"model": ErrorOut, "description": "the secret does not hold the job's lease (any more)"},
}
Status = Literal[JOB_STATUSES]  # type: ignore[valid-type]


def _lease_call(name: str, summary: str):
    """The route of a call a lease's holder makes on its job, POST /v1/jobs/{job_id}/NAME: the
    job's status after, or LEASE_LOST."""
    return router.post(f"/{{job_id}}/{name}", response_model=JobStatusOut, responses=LEASE_LOST, summary=summary)


def _job_or_404(job: JobRecord | None, digest: str) -> JobOut:
    """The job's answer, or a 404 where the store has no job for `digest`."""
    if job is None:
        raise HTTPException(404, f"no job for digest {digest}")
    return JobOut.of(job)


def _known_kernel(kernel: str, where: str = "") -> None:
    """A 422 that names a kernel outside the registry (a worker could never claim its job)."""
    from tunecache_kernels.spaces import UnknownKernel, space_for

    try:
        space_for(kernel)
    except UnknownKernel as e:
        raise HTTPException(422, f"{where}{e}") from None


def _secret(job_id: int, body: LeaseHeldIn) -> str:
    if not body.lease_secret:
        raise HTTPException(
            403,
            f"job {job_id}: no lease secret: heartbeat, complete, fail and release must send "
            f"the `lease_secret` that POST /v1/jobs/claim returned (the owner name does not "
            f"hold a lease; a worker older than the service does not send it: upgrade it)",
        )
    return body.lease_secret


def _lost(job_id: int) -> HTTPException:
    return HTTPException(
        409,
        f"job {job_id} is not held by this lease secret: its lease ran out and it was claimed "
        f"again, it is finished or dropped, or the secret is not the one its claim returned",
    )


@router.post(
    "",
    response_model=JobOut,
    summary="Enqueue a tuning job",
    description="One active job per digest: enqueueing a queued or running key returns its job.",
)
def enqueue(body: EnqueueIn, _: PublishToken, store: StoreDep, metrics: MetricsDep) -> JobOut:
    _known_kernel(body.kernel)
    metrics.enqueued.inc()
    return JobOut.of(store.enqueue(key_of(body), priority=body.priority, max_attempts=body.max_attempts))


@router.post(
    "/announce",
    response_model=AnnounceOut,
    summary="Say this host tunes a key, or learn who does",
    description="One tune of a key per fleet: a host that misses a key asks here before it tunes. `yours`: "
    "no worker and no other host tunes it, and the others are told this host does for `seconds` (renew by "
    "asking again; 0 withdraws). `tuning`: wait for the holder's result. `submitted`: the host that "
    "announced it submitted `hint`, a claim measured there only (a publish token's result is a submission "
    "until a worker re-times it): time it against your default before you run it.",
)
def announce(body: AnnounceIn, token: PublishToken, store: StoreDep) -> AnnounceOut:
    _known_kernel(body.kernel)
    return AnnounceOut.of(store.announce(key_of(body), f"{token.name}: {body.holder}", token.name, body.seconds))


@router.post(
    "/batch",
    response_model=EnqueueManyOut,
    summary="Enqueue the keys that have no tuned config",
    description="What `tunecache pretune` asks of the fleet before its workers start: for each key, in "
    "order, a tuned config means nothing to do; otherwise its job is enqueued (one active job per digest, "
    "as POST /v1/jobs). One request per hundred keys, where a lookup and an enqueue per key spent a "
    "token's rate limit on a manifest of a hundred shapes. A kernel outside the registry is a 422 that "
    "names it, and nothing is enqueued.",
)
def enqueue_missing(body: EnqueueManyIn, _: PublishToken, store: StoreDep, metrics: MetricsDep) -> EnqueueManyOut:
    for i, job in enumerate(body.jobs):
        _known_kernel(job.kernel, f"jobs[{i}]: ")
    tuned, queued = store.enqueue_missing((key_of(j), j.priority, j.max_attempts) for j in body.jobs)
    metrics.enqueued.inc(len(queued))
    return EnqueueManyOut(tuned=tuned, queued=queued)


@router.get("", response_model=list[JobOut], summary="List jobs")
def list_jobs(
    _: ReadToken,
    store: StoreDep,
    status: Optional[Status] = Query(None),
    arch: Optional[Arch] = Query(None),
    sm_count: Optional[int] = Query(None, ge=0, le=100_000),
    limit: int = Query(1000, ge=1, le=10000),
) -> list[JobOut]:
    return [JobOut.of(j) for j in store.list_jobs(status=status, limit=limit, arch=arch, sm_count=sm_count)]


@router.get("/stats", response_model=QueueOut, summary="Jobs per status (queue depth)")
def stats(
    _: ReadToken,
    store: StoreDep,
    arch: Optional[Arch] = Query(None),
    sm_count: Optional[int] = Query(None, ge=0, le=100_000),
) -> QueueOut:
    return QueueOut(**store.job_counts(arch=arch, sm_count=sm_count))


@router.post(
    "/statuses",
    response_model=StatusesOut,
    summary="The status of many keys' jobs",
    description="One request for what would be a GET per digest: a progress bar over a whole manifest "
    "(`tunecache pretune`) stays inside the rate limit however many shapes it tunes.",
)
def job_statuses(body: StatusesIn, _: ReadToken, store: StoreDep) -> StatusesOut:
    return StatusesOut(statuses=store.job_statuses(body.digests))


@router.get("/{digest}", response_model=JobOut, responses={404: {"model": ErrorOut}}, summary="The job of a key")
def get_job(digest: DigestPath, _: ReadToken, store: StoreDep) -> JobOut:
    return _job_or_404(store.get_job(digest), digest)


@router.post(
    "/{digest}/retry",
    response_model=JobOut,
    summary="Queue a failed job again (admin)",
    description="A failed, quarantined or backing-off job goes back to the queue now with its attempts "
    "reset (its last error is kept). A running or done job, or a row that cannot be read, "
    "is a 409 that says what to do instead.",
    responses={404: {"model": ErrorOut}, 409: {"model": ErrorOut, "description": "the job's state"}},
)
def retry(digest: DigestPath, token: AdminToken, store: StoreDep) -> JobOut:
    try:
        job = store.retry_job(digest, actor=token)
    except JobStateError as e:
        raise HTTPException(409, str(e)) from None
    return _job_or_404(job, digest)


@router.delete(
    "/{digest}",
    response_model=DeleteOut,
    summary="Drop a job (admin)",
    description="In whatever state; a worker holding it loses its lease (its result is not published).",
    responses={404: {"model": ErrorOut}},
)
def drop(digest: DigestPath, token: AdminToken, store: StoreDep) -> DeleteOut:
    if store.drop_job(digest, actor=token) is None:
        raise HTTPException(404, f"no job for digest {digest}")
    return DeleteOut(deleted=True)


@router.post(
    "/claim",
    response_model=ClaimOut,
    summary="Lease the most urgent job of a device class",
    description="The answer's `lease_secret` is shown once; heartbeat, complete, fail and release must "
    "send it. On the way, a job whose last attempt's lease ran out is marked failed and a "
    "row that cannot be read is quarantined; the claim goes on to the next job.",
)
def claim(body: ClaimIn, _: WorkerToken, store: StoreDep, metrics: MetricsDep) -> ClaimOut:
    job = store.claim_job(
        body.owner,
        arch=body.arch,
        sm_count=body.sm_count,
        lease_s=body.lease_s,
        kernels=body.kernels,
        kernel_versions=body.kernel_versions,
        triton_version=body.triton_version,
    )
    if job is None:
        return ClaimOut(job=None)
    metrics.job_events.labels("claimed").inc()
    return ClaimOut(job=JobOut.of(job), lease_secret=job.lease_secret)


@_lease_call("heartbeat", "Extend a lease")
def heartbeat(job_id: JobId, body: LeaseIn, _: WorkerToken, store: StoreDep) -> JobStatusOut:
    if not store.heartbeat(job_id, _secret(job_id, body), lease_s=body.lease_s):
        raise _lost(job_id)
    return JobStatusOut(id=job_id, status="running")


@_lease_call("complete", "Mark a job done")
def complete(job_id: JobId, body: CompleteIn, _: WorkerToken, store: StoreDep, metrics: MetricsDep) -> JobStatusOut:
    if not store.complete_job(job_id, _secret(job_id, body)):
        raise _lost(job_id)
    metrics.job_events.labels("completed").inc()
    if body.tune_seconds is not None:
        metrics.tune_seconds.observe(body.tune_seconds)
    return JobStatusOut(id=job_id, status="done")


@_lease_call("fail", "Record a failure: back to the queue after a backoff, or failed after max attempts")
def fail(job_id: JobId, body: FailIn, _: WorkerToken, store: StoreDep, metrics: MetricsDep) -> JobStatusOut:
    status = store.fail_job(job_id, _secret(job_id, body), body.error, backoff_s=body.backoff_s)
    if status is None:
        raise _lost(job_id)
    metrics.job_events.labels("failed" if status == "failed" else "retried").inc()
    return JobStatusOut(id=job_id, status=status)


@_lease_call("release", "Give a leased job back now, without spending an attempt (a worker shutting down)")
def release(job_id: JobId, body: ReleaseIn, _: WorkerToken, store: StoreDep, metrics: MetricsDep) -> JobStatusOut:
    if not store.release_job(job_id, _secret(job_id, body)):
        raise _lost(job_id)
    metrics.job_events.labels("released").inc()
    return JobStatusOut(id=job_id, status="queued")
