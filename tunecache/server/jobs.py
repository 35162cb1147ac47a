"""/v1/jobs: the tuning queue. Hosts enqueue misses; workers claim, heartbeat, complete, fail."""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from fastapi import APIRouter, HTTPException, Path, Query

from ..store import JobRecord
from .configs import DigestPath, key_of
from .deps import MetricsDep, PublishToken, ReadToken, StoreDep, WorkerToken
from .schemas import (INT32_MAX, Arch, ClaimIn, ClaimOut, CompleteIn, EnqueueIn, ErrorOut, FailIn, JobOut,
                      JobStatusOut, LeaseIn, QueueOut, ReleaseIn)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

JobId = Annotated[int, Path(ge=1, le=INT32_MAX, description="the job's id (from claim)")]
LEASE_LOST = {409: {"model": ErrorOut, "description": "the job is not leased to this owner (any more)"}}


def job_out(job: JobRecord) -> JobOut:
    return JobOut(**job.key.fields(), digest=job.digest, id=job.id, status=job.status, priority=job.priority,
                  attempts=job.attempts, max_attempts=job.max_attempts, lease_owner=job.lease_owner,
                  lease_expires_at=job.lease_expires_at, last_error=job.last_error)


def _lost(job_id: int, owner: str) -> HTTPException:
    return HTTPException(409, f"job {job_id} is not leased to {owner!r}: its lease ran out and it was claimed "
                              f"again, or it is finished")


@router.post("", response_model=JobOut, summary="Enqueue a tuning job",
             description="One active job per digest: enqueueing a queued or running key returns its job.")
def enqueue(body: EnqueueIn, _: PublishToken, store: StoreDep, metrics: MetricsDep) -> JobOut:
    from tunecache_kernels.spaces import space_for

    try:
        space_for(body.kernel)
    except KeyError as e:
        raise HTTPException(422, str(e).strip("'\"")) from None
    metrics.enqueued.inc()
    return job_out(store.enqueue(key_of(body), priority=body.priority, max_attempts=body.max_attempts))


@router.get("", response_model=list[JobOut], summary="List jobs")
def list_jobs(_: ReadToken, store: StoreDep,
              status: Optional[Literal["queued", "running", "done", "failed"]] = Query(None),
              limit: int = Query(1000, ge=1, le=10000)) -> list[JobOut]:
    return [job_out(j) for j in store.list_jobs(status=status, limit=limit)]


@router.get("/stats", response_model=QueueOut, summary="Jobs per status (queue depth)")
def stats(_: ReadToken, store: StoreDep, arch: Optional[Arch] = Query(None),
          sm_count: Optional[int] = Query(None, ge=0, le=100_000)) -> QueueOut:
    return QueueOut(**store.job_counts(arch=arch, sm_count=sm_count))


@router.get("/{digest}", response_model=JobOut, responses={404: {"model": ErrorOut}}, summary="The job of a key")
def get_job(digest: DigestPath, _: ReadToken, store: StoreDep) -> JobOut:
    job = store.get_job(digest)
    if job is None:
        raise HTTPException(404, f"no job for digest {digest}")
    return job_out(job)


@router.post("/claim", response_model=ClaimOut, summary="Lease the most urgent job of a device class")
def claim(body: ClaimIn, _: WorkerToken, store: StoreDep, metrics: MetricsDep) -> ClaimOut:
    job = store.claim_job(body.owner, arch=body.arch, sm_count=body.sm_count, lease_s=body.lease_s,
                          kernels=body.kernels, kernel_versions=body.kernel_versions,
                          triton_version=body.triton_version)
    if job is not None:
        metrics.job_events.labels("claimed").inc()
    return ClaimOut(job=None if job is None else job_out(job))


@router.post("/{job_id}/heartbeat", response_model=JobStatusOut, responses=LEASE_LOST, summary="Extend a lease")
def heartbeat(job_id: JobId, body: LeaseIn, _: WorkerToken, store: StoreDep) -> JobStatusOut:
    if not store.heartbeat(job_id, body.owner, lease_s=body.lease_s):
        raise _lost(job_id, body.owner)
    return JobStatusOut(id=job_id, status="running")


@router.post("/{job_id}/complete", response_model=JobStatusOut, responses=LEASE_LOST, summary="Mark a job done")
def complete(job_id: JobId, body: CompleteIn, _: WorkerToken, store: StoreDep, metrics: MetricsDep) -> JobStatusOut:
    if not store.complete_job(job_id, body.owner):
        raise _lost(job_id, body.owner)
    metrics.job_events.labels("completed").inc()
    if body.tune_seconds is not None:
        metrics.tune_seconds.observe(body.tune_seconds)
    return JobStatusOut(id=job_id, status="done")


@router.post("/{job_id}/fail", response_model=JobStatusOut, responses=LEASE_LOST,
             summary="Record a failure: back to the queue after a backoff, or failed after max attempts")
def fail(job_id: JobId, body: FailIn, _: WorkerToken, store: StoreDep, metrics: MetricsDep) -> JobStatusOut:
    status = store.fail_job(job_id, body.owner, body.error, backoff_s=body.backoff_s)
    if status is None:
        raise _lost(job_id, body.owner)
    metrics.job_events.labels("failed" if status == "failed" else "retried").inc()
    return JobStatusOut(id=job_id, status=status)


@router.post("/{job_id}/release", response_model=JobStatusOut, responses=LEASE_LOST,
             summary="Give a leased job back now, without spending an attempt (a worker shutting down)")
def release(job_id: JobId, body: ReleaseIn, _: WorkerToken, store: StoreDep, metrics: MetricsDep) -> JobStatusOut:
    if not store.release_job(job_id, body.owner):
        raise _lost(job_id, body.owner)
    metrics.job_events.labels("released").inc()
    return JobStatusOut(id=job_id, status="queued")
