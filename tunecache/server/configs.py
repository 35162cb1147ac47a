"""/v1/configs, /v1/lookup, /v1/export, /v1/import: tuned configs and their submissions."""

from __future__ import annotations

from typing import Annotated, Optional

from fastapi import APIRouter, HTTPException, Path, Query, Response
from pydantic import ValidationError

from ..key import TuneKey
from ..store import ConfigRecord, TrialRecord
from ..transfer import FORMAT
from .deps import AdminToken, MetricsDep, PublishToken, ReadToken, StoreDep
from .schemas import (Arch, ConfigIn, ConfigOut, DeleteOut, ErrorOut, ExportOut, GenerationOut, ImportIn,
                      ImportOut, KeyIn, Kernel, PublishOut, ReportIn, ReportOut, SubmissionOut)

router = APIRouter(prefix="/v1", tags=["configs"])

NOT_FOUND = {404: {"model": ErrorOut, "description": "no tuned config for this key"}}
# every lookup answer (a miss too) says the fleet's generation, so that a host learns for free
# when the winners it copied may have been removed or replaced
GENERATION_HEADER = "X-Tunecache-Generation"
DigestPath = Annotated[str, Path(pattern=r"^[0-9a-f]{64}$", description="the key's sha256 digest")]


def key_of(body: KeyIn) -> TuneKey:
    return TuneKey(body.kernel, body.kernel_version, body.triton_version, body.arch, body.sm_count,
                   dict(body.problem))


def check_kernel_config(kernel: str, config: dict) -> None:
    """422 unless the kernel is known and the config lies in its space (plain data, no Triton)."""
    from tunecache_kernels.spaces import space_for

    try:
        space = space_for(kernel)
    except KeyError as e:
        raise HTTPException(422, str(e).strip("'\"")) from None
    try:
        space.check(config)
    except ValueError as e:
        raise HTTPException(422, f"config is outside the space of {kernel}: {e}") from None


def record_of(body: ConfigIn, source: str | None = None) -> ConfigRecord:
    key = key_of(body)
    if body.digest is not None and body.digest != key.digest:
        raise HTTPException(422, f"digest {body.digest} does not match the key's fields (they hash to {key.digest})")
    check_kernel_config(body.kernel, body.config)
    return ConfigRecord(key=key, config=dict(body.config), median_ms=body.median_ms, tflops=body.tflops,
                        candidates=body.candidates, device_name=body.device_name, tuned_by=body.tuned_by,
                        tuned_at=body.tuned_at, source=source or body.source)


def out(rec: ConfigRecord) -> ConfigOut:
    return ConfigOut.model_validate(rec.to_json())


@router.get("/configs/{digest}", response_model=ConfigOut, responses=NOT_FOUND, summary="Look up by digest")
def get_config(digest: DigestPath, _: ReadToken, store: StoreDep, metrics: MetricsDep,
               response: Response) -> ConfigOut:
    generation = {GENERATION_HEADER: str(store.generation())}
    rec = store.get_config(digest)
    metrics.lookup(rec is not None)
    if rec is None:
        raise HTTPException(404, f"no tuned config with digest {digest}", headers=generation)
    response.headers.update(generation)
    return out(rec)


@router.post("/lookup", response_model=ConfigOut, responses=NOT_FOUND, summary="Look up by key fields")
def lookup(body: KeyIn, _: ReadToken, store: StoreDep, metrics: MetricsDep, response: Response) -> ConfigOut:
    generation = {GENERATION_HEADER: str(store.generation())}
    key = key_of(body)
    rec = store.get_config(key.digest)
    metrics.lookup(rec is not None)
    if rec is None:
        raise HTTPException(404, f"no tuned config for {body.kernel} {dict(body.problem)} on "
                                 f"{body.arch}:{body.sm_count} (digest {key.digest})", headers=generation)
    response.headers.update(generation)
    return out(rec)


@router.get("/generation", response_model=GenerationOut, summary="The fleet's generation",
            description="Moves whenever a winner is removed or replaced. Hosts compare it with the one "
                        "under which they copied a winner and recheck the copy when it moved.")
def generation(_: ReadToken, store: StoreDep) -> GenerationOut:
    return GenerationOut(generation=store.generation())


@router.post("/configs/{digest}/reports", response_model=ReportOut, responses=NOT_FOUND,
             summary="Report a config that a host could not launch",
             description="Kept as a failed trial of the key, and a job to re-tune the key is queued if the "
                         "reported config is the current winner. A report never removes a winner by itself: "
                         "a worker re-times the key, and an admin may delete it.")
def report(digest: DigestPath, body: ReportIn, token: PublishToken, store: StoreDep) -> ReportOut:
    rec = store.get_config(digest)
    if rec is None:
        raise HTTPException(404, f"no tuned config with digest {digest}")
    store.add_trials(rec.key, [TrialRecord(config=dict(body.config), status="failed",
                                           error=f"reported by {token.name}: {body.error}")])
    job = store.enqueue(rec.key).status if body.config == rec.config else None
    return ReportOut(recorded=True, job=job)


@router.get("/configs", response_model=list[ConfigOut], summary="List tuned configs")
def list_configs(_: ReadToken, store: StoreDep,
                 kernel: Optional[Kernel] = Query(None), arch: Optional[Arch] = Query(None),
                 limit: int = Query(100, ge=1, le=1000), offset: int = Query(0, ge=0, le=10**9)) -> list[ConfigOut]:
    return [out(r) for r in store.list_configs(kernel=kernel, arch=arch, limit=limit, offset=offset)]


@router.post("/configs", response_model=PublishOut, summary="Publish a tuning result",
             description="The config is checked against the kernel's config space. The faster of the "
                         "stored and the new result is kept (the new one must be 3% faster to replace), "
                         "and every submission is recorded.")
def publish(body: ConfigIn, token: PublishToken, store: StoreDep, metrics: MetricsDep) -> PublishOut:
    rec = record_of(body)
    trials = [TrialRecord(config=t.config, status=t.status, median_ms=t.median_ms, error=t.error)
              for t in body.trials]
    kept, won, sid = store.publish(rec, trials, submitted_by=token.name, tune_seconds=body.tune_seconds)
    metrics.publishes.labels("accepted" if won else "kept_existing").inc()
    return PublishOut(accepted=won, submission_id=sid, kept=out(kept))


@router.get("/configs/{digest}/submissions", response_model=list[SubmissionOut],
            summary="Every result published for a key")
def submissions(digest: DigestPath, _: ReadToken, store: StoreDep,
                limit: int = Query(1000, ge=1, le=10000)) -> list[SubmissionOut]:
    rows = store.submissions(digest, limit=limit)
    return [SubmissionOut(**s.key.fields(), digest=s.digest, id=s.id, config=s.config, median_ms=s.median_ms,
                          tflops=s.tflops, candidates=s.candidates, device_name=s.device_name, tuned_by=s.tuned_by,
                          source=s.source, submitted_by=s.submitted_by, accepted=s.accepted,
                          tune_seconds=s.tune_seconds, created_at=s.created_at) for s in rows]


@router.delete("/configs/{digest}", response_model=DeleteOut, responses=NOT_FOUND, summary="Delete a config")
def delete_config(digest: DigestPath, _: AdminToken, store: StoreDep) -> DeleteOut:
    if not store.delete_config(digest):
        raise HTTPException(404, f"no tuned config with digest {digest}")
    return DeleteOut(deleted=True)


@router.get("/export", response_model=ExportOut, summary="Export tuned configs (for `tunecache import`)")
def export(_: ReadToken, store: StoreDep, kernel: Optional[Kernel] = Query(None),
           arch: Optional[Arch] = Query(None)) -> ExportOut:
    return ExportOut(format=FORMAT, configs=[out(r) for r in store.list_configs(kernel=kernel, arch=arch)])


@router.post("/import", response_model=ImportOut, summary="Import an export",
             description="Each entry is validated on its own; bad ones are reported, good ones published.")
def import_(body: ImportIn, token: AdminToken, store: StoreDep, metrics: MetricsDep) -> ImportOut:
    stored = kept = 0
    rejected: list[str] = []
    for i, entry in enumerate(body.configs):
        try:
            rec = record_of(ConfigIn.model_validate(entry), source="import")
        except ValidationError as e:
            rejected.append(f"#{i}: " + "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}"
                                                  for x in e.errors()[:5]))
            continue
        except HTTPException as e:
            rejected.append(f"#{i}: {e.detail}")
            continue
        _, won, _ = store.publish(rec, submitted_by=token.name)
        stored += won
        kept += not won
        metrics.publishes.labels("accepted" if won else "kept_existing").inc()
    return ImportOut(stored=stored, kept=kept, rejected=rejected)
