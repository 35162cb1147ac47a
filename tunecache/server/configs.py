"""/v1/configs, /v1/lookup, /v1/export, /v1/import, /v1/sync, /v1/trials: tuned configs, their submissions and
their compiled kernels."""

from __future__ import annotations

from typing import Annotated, Callable, Optional

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from tunecache.key import TuneKey
from tunecache.server.deps import AdminToken, MetricsDep, PublishToken, ReadToken, StoreDep, WorkerToken
from tunecache.server.lookups import LookupCache, drops_lookups
from tunecache.server.metrics import Metrics
from tunecache.server.schemas import (
    Arch,
    BinariesIn,
    BinariesOut,
    BinariesStoredOut,
    BinaryJson,
    ConfigIn,
    ConfigOut,
    DeleteOut,
    ErrorOut,
    ExportOut,
    GenerationOut,
    ImportIn,
    ImportOut,
    Kernel,
    KeyIn,
    PublishOut,
    PurgeIn,
    PurgeOut,
    ReportIn,
    ReportOut,
    SubmissionOut,
    SyncIn,
    SyncOut,
    TrialsOut,
)
from tunecache.store import Store, floor
from tunecache.store.records import TRIALS_SERVED, ConfigRecord, PurgeReport, TokenRecord, TrialRecord
from tunecache.store.transfer import FORMAT

router = APIRouter(prefix="/v1", tags=["configs"])

NOT_FOUND = {404: {"model": ErrorOut, "description": "no tuned config for this key"}}
# every lookup answer (a miss too) says the fleet's generation, so that a host learns for free
# when the winners it copied may have been removed or replaced
GENERATION_HEADER = "X-Tunecache-Generation"
DigestPath = Annotated[str, Path(pattern=r"^[0-9a-f]{64}$", description="the key's sha256 digest")]
# the sources a worker token's result may name: ways a trusted host tunes. Anything else it
# names (fleet, import, submission, admin) is the service's to set: it becomes "worker".
TUNING_SOURCES = ("worker", "pretune", "cli", "inline")


def key_of(body: KeyIn) -> TuneKey:
    """The body's key; 422 when the body's `digest` is not the one its fields hash to."""
    key = TuneKey(body.kernel, body.kernel_version, body.triton_version, body.arch, body.sm_count, dict(body.problem))
    if body.digest is not None and body.digest != key.digest:
        raise HTTPException(422, f"digest {body.digest} does not match the key's fields (they hash to {key.digest})")
    return key


def check_kernel_config(kernel: str, config: dict) -> None:
    """422 unless the kernel is known and the config lies in its space (plain data, no Triton)."""
    from tunecache_kernels.spaces import UnknownKernel, space_for

    try:
        space = space_for(kernel)
    except UnknownKernel as e:
        raise HTTPException(422, str(e)) from None
    try:
        space.check(config)
    except ValueError as e:
        raise HTTPException(422, f"config is outside the space of {kernel}: {e}") from None


def record_of(body: ConfigIn, source: str, provenance: dict | None = None) -> ConfigRecord:
    """The result as a record, checked: its digest, its config against the kernel's space, its
    time against the device class's physical floor (422s that say why). `source` and
    `provenance` (tuned_by, device_name, tuned_at) are the service's word; without
    `provenance`, the body's (an admin's import)."""
    key = key_of(body)
    check_kernel_config(body.kernel, body.config)
    impossible = floor.refusal(body.kernel, body.arch, body.sm_count, body.problem, body.median_ms)
    if impossible:
        raise HTTPException(422, impossible)
    given = provenance or dict(tuned_by=body.tuned_by, device_name=body.device_name, tuned_at=body.tuned_at)
    return ConfigRecord(
        key=key,
        config=dict(body.config),
        median_ms=body.median_ms,
        tflops=body.tflops,
        candidates=body.candidates,
        default_ms=body.default_ms,
        vendor_ms=body.vendor_ms,
        source=source,
        **given,
    )


def provenance(token: TokenRecord, body: ConfigIn) -> tuple[str, dict]:
    """(source, {tuned_by, device_name, tuned_at}) of a published result: set from the token,
    never the body's word alone. A worker (or admin) token is one of the fleet's own tuning
    hosts: its body says which host tuned it, on what GPU, when, and how (TUNING_SOURCES; an
    admin's result is "admin"). A publish token's result is a submission by that token,
    nothing more."""
    if token.allows("admin"):
        source = "admin"
    elif token.allows("worker"):  # how the host tuned it (a queue worker, pretune, the CLI, a library call)
        source = body.source if body.source in TUNING_SOURCES else "worker"
    else:
        return "submission", dict(tuned_by=token.name, device_name="", tuned_at=None)
    return source, dict(tuned_by=body.tuned_by or token.name, device_name=body.device_name, tuned_at=body.tuned_at)


def _body_schema(model: type) -> dict:
    """The OpenAPI request body of a route that reads its body itself (the model's JSON Schema,
    its $defs inlined: OpenAPI resolves refs against the whole document)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(x):
        if isinstance(x, dict):
            ref = x.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in x.items()}
        return [inline(v) for v in x] if isinstance(x, list) else x

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


def out(rec: ConfigRecord) -> ConfigOut:
    return ConfigOut.model_validate(rec.to_json())


DigestOrPrefix = Annotated[
    str,
    Path(
        pattern=r"^[0-9a-f]{8,64}$",
        description="the key's sha256 digest, or a unique prefix of 8 or more of "
        "its hex digits (what `tunecache ls` shows)",
    ),
]


@router.get(
    "/configs/{digest}",
    response_model=ConfigOut,
    summary="Look up by digest (or a unique prefix)",
    responses={**NOT_FOUND, 409: {"model": ErrorOut, "description": "the prefix matches several digests"}},
)
async def get_config(digest: DigestOrPrefix, _: ReadToken, request: Request, metrics: MetricsDep) -> Response:
    if len(digest) < 64:
        digest = await run_in_threadpool(_unique_digest, request.app.state.store, digest)
    return await _answer(request, digest, metrics, lambda: f"no tuned config with digest {digest}")


def _unique_digest(store: Store, prefix: str) -> str:
    """The one digest that starts with `prefix` (409 when several do; the prefix itself when none)."""
    found = store.find_configs(prefix)
    if len(found) > 1:
        raise HTTPException(
            409,
            f"{len(found)} digests start with {prefix}: "
            f"{', '.join(r.digest[:16] for r in found[:5])}; give more digits",
        )
    return found[0].digest if found else prefix


async def _answer(request: Request, digest: str, metrics: Metrics, missing: Callable[[], str]) -> Response:
    """The lookup's answer: from this process's LookupCache, else from the store (on the
    thread pool) and kept there. Every answer, a miss too, says the fleet's generation."""
    state = request.app.state
    lookups: LookupCache = state.lookups
    store = state.store
    state.publish_pacer.reads += 1  # publishes make room for readers (tunecache.server.pacing)
    if lookups.poll_generation():  # one request reads it; the others answer with the one known
        await run_in_threadpool(lookups.refresh_generation, store.generation)
    cached = lookups.answer(digest)
    if cached is None:
        cached = await state.reads.get(digest)
        metrics.lookup_reads.inc()
    body, generation = cached
    metrics.lookup(body is not None)
    headers = {GENERATION_HEADER: str(generation)}
    if body is None:
        raise HTTPException(404, missing(), headers=headers)
    return Response(body, media_type="application/json", headers=headers)


def read_answers(store: Store, lookups: LookupCache, digests: list[str]) -> dict[str, tuple[bytes | None, int]]:
    """The answers of lookups the cache lacked, read together (`lookups.BatchedReads`) and kept."""
    generation = lookups.generation(store.generation)
    epoch = lookups.epoch  # after the generation: a move it noted dropped what was kept before
    recs = store.get_configs(d for d in digests if len(d) == 64)
    answers = {}
    for digest in digests:
        rec = recs.get(digest)
        body = None if rec is None else out(rec).model_dump_json().encode()
        lookups.keep(digest, body, generation, epoch)
        answers[digest] = (body, generation)
    return answers


@router.post("/lookup", response_model=ConfigOut, responses=NOT_FOUND, summary="Look up by key fields")
async def lookup(body: KeyIn, _: ReadToken, request: Request, metrics: MetricsDep) -> Response:
    key = key_of(body)
    return await _answer(
        request,
        key.digest,
        metrics,
        lambda: (
            f"no tuned config for {body.kernel} {dict(body.problem)} on "
            f"{body.arch}:{body.sm_count} (digest {key.digest})"
        ),
    )


@router.get(
    "/generation",
    response_model=GenerationOut,
    summary="The fleet's generation",
    description="Moves whenever a winner is removed or replaced. Hosts compare it with the one "
    "under which they copied a winner and recheck the copy when it moved.",
)
async def generation(_: ReadToken, request: Request) -> GenerationOut:
    lookups: LookupCache = request.app.state.lookups
    known = lookups.known_generation()
    if known is None:
        known = await run_in_threadpool(lookups.generation, request.app.state.store.generation)
    return GenerationOut(generation=known)


@router.post(
    "/configs/{digest}/reports",
    response_model=ReportOut,
    responses=NOT_FOUND,
    summary="Report a config that a host could not launch",
    description="Kept as a failed trial of the key; if the reported config is the current winner, "
    "the key is queued for re-timing (once per winner, like a submission that beats it): a "
    "worker tunes it although a winner exists, and its measurement decides. A report never "
    "removes a winner by itself; an admin may delete it.",
)
def report(digest: DigestPath, body: ReportIn, token: PublishToken, request: Request, store: StoreDep) -> ReportOut:
    found, job = store.report(digest, dict(body.config), body.error, token.name)
    if not found:
        raise HTTPException(404, f"no tuned config with digest {digest}")
    request.app.state.lookups.forget(digest)
    return ReportOut(recorded=True, job=None if job is None else job.status)


@router.get("/configs", response_model=list[ConfigOut], summary="List tuned configs")
def list_configs(
    _: ReadToken,
    store: StoreDep,
    kernel: Optional[Kernel] = Query(None),
    arch: Optional[Arch] = Query(None),
    limit: int = Query(100, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=10**9),
) -> list[ConfigOut]:
    return [out(r) for r in store.list_configs(kernel=kernel, arch=arch, limit=limit, offset=offset)]


@router.post(
    "/configs",
    response_model=PublishOut,
    summary="Publish a tuning result",
    description="The config is checked against the kernel's config space, and its time against "
    "what the device class can physically do (422 below it). Every result is recorded "
    "as a submission. Results of `worker` (and `admin`) tokens, the fleet's own tuning "
    "hosts, may become the winner: the faster of the stored and the new result is "
    "kept (the new one must be 3% faster to replace). Results of `publish` tokens never "
    "make or replace a winner: when the key has none, or the result claims to beat it, "
    "the key is queued for a worker of its device class to tune (`status` says "
    "which). Provenance (`source`, `tuned_by`, `device_name`) is set from the token.",
    openapi_extra=_body_schema(ConfigIn),
)
async def publish(token: PublishToken, request: Request, metrics: MetricsDep) -> PublishOut:
    # the body is parsed, checked and stored on the thread pool (FastAPI would parse and
    # validate a 2,000-trial body, ~900 KB, on the event loop, which answers every lookup), one
    # publish at a time and within the process's publish share (tunecache.server.pacing)
    raw = await request.body()
    state = request.app.state
    return await state.publish_pacer.run(lambda: run_in_threadpool(_publish, raw, token, state, metrics))


def _publish(raw: bytes, token: TokenRecord, state, metrics: Metrics) -> PublishOut:
    import json

    try:  # as FastAPI would (json.loads, then the model in Python mode), on this thread
        body = ConfigIn.model_validate(json.loads(raw))
    except json.JSONDecodeError as e:
        error = {"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error", "ctx": {"error": e.msg}}
        raise RequestValidationError([error]) from None
    except UnicodeDecodeError:
        raise HTTPException(400, "the body is not UTF-8") from None
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
        raise RequestValidationError(errors) from None
    store: Store = state.store
    source, given = provenance(token, body)
    rec = record_of(body, source, given)
    trials = [TrialRecord(config=t.config, status=t.status, median_ms=t.median_ms, error=t.error) for t in body.trials]
    if token.allows("worker"):
        kept, won, sid = store.publish(rec, trials, submitted_by=token.name, tune_seconds=body.tune_seconds)
        state.lookups.forget(rec.digest)  # its key's answer only (a submission changes none)
        metrics.publishes.labels("accepted" if won else "kept_existing").inc()
        return PublishOut(accepted=won, status="won" if won else "kept_existing", submission_id=sid, kept=out(kept))
    winner, sid, job = store.submit(rec, trials, submitted_by=token.name, tune_seconds=body.tune_seconds)
    metrics.publishes.labels("queued" if job else "recorded").inc()
    return PublishOut(
        accepted=False,
        status="queued" if job else "recorded",
        submission_id=sid,
        kept=None if winner is None else out(winner),
        job=None if job is None else job.status,
    )


@router.get(
    "/configs/{digest}/submissions", response_model=list[SubmissionOut], summary="Every result published for a key"
)
def submissions(
    digest: DigestPath, _: ReadToken, store: StoreDep, limit: int = Query(1000, ge=1, le=10000)
) -> list[SubmissionOut]:
    return [SubmissionOut.of(s) for s in store.submissions(digest, limit=limit)]


@router.delete(
    "/configs/{digest}",
    response_model=DeleteOut,
    responses=NOT_FOUND,
    summary="Delete a config",
    dependencies=[Depends(drops_lookups)],
)
def delete_config(digest: DigestPath, token: AdminToken, store: StoreDep) -> DeleteOut:
    if not store.delete_config(digest, actor=token):
        raise HTTPException(404, f"no tuned config with digest {digest}")
    return DeleteOut(deleted=True)


@router.get("/export", response_model=ExportOut, summary="Export tuned configs (for `tunecache import`)")
def export(
    _: ReadToken, store: StoreDep, kernel: Optional[Kernel] = Query(None), arch: Optional[Arch] = Query(None)
) -> ExportOut:
    return ExportOut(format=FORMAT, configs=[out(r) for r in store.list_configs(kernel=kernel, arch=arch)])


@router.post(
    "/import",
    response_model=ImportOut,
    summary="Import an export",
    description="Each entry is validated on its own; bad ones are reported, good ones published.",
    dependencies=[Depends(drops_lookups)],
)
def import_(body: ImportIn, token: AdminToken, store: StoreDep, metrics: MetricsDep) -> ImportOut:
    stored = kept = 0
    rejected: list[str] = []
    for i, entry in enumerate(body.configs):
        try:
            rec = record_of(ConfigIn.model_validate(entry), source="import")
        except ValidationError as e:
            rejected.append(
                f"#{i}: " + "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()[:5])
            )
            continue
        except HTTPException as e:
            rejected.append(f"#{i}: {e.detail}")
            continue
        _, won, _ = store.publish(rec, submitted_by=token.name)
        stored += won
        kept += not won
        metrics.publishes.labels("accepted" if won else "kept_existing").inc()
    store.audit(
        token,
        "config.import",
        f"configs:{len(body.configs)}",
        {"stored": stored, "kept": kept, "rejected": len(rejected)},
    )
    return ImportOut(stored=stored, kept=kept, rejected=rejected)


@router.post(
    "/admin/purge",
    response_model=PurgeOut,
    summary="Remove everything one token submitted (admin)",
    description="Removes every winner that a submission of the named token made, and every submission "
    "it sent; queues each displaced key for a worker to tune again (a failed job is left "
    "for `tunecache jobs retry`) and moves the generation, so that hosts drop their copies "
    "within TUNECACHE_FLEET_TTL_S or at their next generation poll. `tunecache fleet purge "
    "--token NAME` does the same on the database.",
    dependencies=[Depends(drops_lookups)],
)
def purge(body: PurgeIn, token: AdminToken, store: StoreDep) -> PurgeOut:
    report = store.purge_token(body.token_name, dry_run=body.dry_run, actor=token)
    return purge_out(report)


def purge_out(report: PurgeReport) -> PurgeOut:
    return PurgeOut(
        token_name=report.token_name,
        dry_run=report.dry_run,
        removed=[out(r) for r in report.removed],
        jobs=report.jobs,
        submissions_removed=report.submissions,
        generation=report.generation,
    )


# ---- a winner's compiled kernels (tunecache.tuning.binaries), and a host's sync ------------------

# compiled kernels in one sync answer; the rest are named for the host to fetch one by one
SYNC_BINARY_BYTES = 64 << 20


@router.put(
    "/configs/{digest}/binaries",
    response_model=BinariesStoredOut,
    responses={**NOT_FOUND, 409: {"model": ErrorOut, "description": "the winner is another config"}},
    summary="Publish the winner's compiled kernels (worker)",
    description="The Triton cache entries (metadata and cubin) that a launch of the winner used on "
    "the tuning host, so that hosts that copy the winner need not compile it. Only worker and "
    "admin tokens: a binary is code that runs on the hosts' GPUs. Each is checked against the "
    "key (its hash, its target GPU and Triton version); they replace the key's earlier ones and "
    "are served while `config` is the key's winner.",
)
def put_binaries(digest: DigestPath, body: BinariesIn, token: WorkerToken, store: StoreDep) -> BinariesStoredOut:
    from tunecache.tuning.binaries import Binary, refusal

    rec = store.get_config(digest)
    if rec is None:
        raise HTTPException(404, f"no tuned config with digest {digest}")
    if dict(body.config) != rec.config:
        raise HTTPException(409, f"the winner of {digest[:12]} is {rec.config}, not {dict(body.config)}")
    binaries = []
    for i, b in enumerate(body.binaries):
        try:
            binary = Binary.from_json(b.model_dump())
        except ValueError as e:
            raise HTTPException(422, f"binaries.{i}: {e}") from None
        why = refusal(binary, rec.key.arch, rec.key.triton_version)
        if why:
            raise HTTPException(422, f"binaries.{i}: {why}")
        binaries.append(binary)
    if len({b.triton_hash for b in binaries}) != len(binaries):
        raise HTTPException(422, "binaries: the same triton_hash twice")
    if not store.put_binaries(digest, rec.config, binaries, token.name):
        raise HTTPException(409, f"the winner of {digest[:12]} changed meanwhile; tune again")
    return BinariesStoredOut(stored=len(binaries))


@router.get(
    "/configs/{digest}/binaries",
    response_model=BinariesOut,
    responses=NOT_FOUND,
    summary="The winner's compiled kernels",
)
def get_binaries(digest: DigestPath, _: ReadToken, store: StoreDep) -> BinariesOut:
    rec = store.get_config(digest)
    if rec is None:
        raise HTTPException(404, f"no tuned config with digest {digest}")
    found = store.get_binaries([digest]).get(digest, [])
    return BinariesOut(digest=digest, config=rec.config, binaries=[BinaryJson(**b.to_json()) for b in found])


@router.get(
    "/trials",
    response_model=TrialsOut,
    summary="Trusted trials of a kernel, to rank candidates by",
    description="The newest measured trials of one kernel on one architecture that workers and "
    "admins published (never a submission's claims), packed. A host asks once per 10 minutes a "
    "kernel and times first what ran fastest on the problems nearest its own.",
)
def trials(
    _: ReadToken, store: StoreDep, kernel: Annotated[Kernel, Query()], arch: Annotated[Arch, Query()]
) -> TrialsOut:
    from tunecache.tuning import ranking

    rows = store.ranking_trials(arch, kernel, limit=TRIALS_SERVED, trusted_only=True)
    packed = ranking.pack(ranking.trial_rows(rows)).get(kernel, {"problems": [], "configs": [], "rows": []})
    return TrialsOut(kernel=kernel, arch=arch, **packed)


@router.post(
    "/sync",
    response_model=SyncOut,
    summary="Every winner of a device class (and its compiled kernels)",
    description="What `tunecache sync` copies to a host in one request: the winners of one device "
    "class and Triton version, of the given kernel versions, with their compiled kernels (up to "
    "64 MiB of them; `more_binaries` names the digests whose kernels did not fit). At most 6 "
    "a minute per token and client address (429 with Retry-After).",
)
def sync(body: SyncIn, token: ReadToken, request: Request, store: StoreDep) -> SyncOut:
    from tunecache.server.guards import client_address

    request.app.state.rate_limits.hit_sync(token, client_address(request))
    generation = store.generation()
    recs = store.device_configs(body.arch, body.sm_count, body.triton_version, body.kernel_versions)
    binaries: dict[str, list[BinaryJson]] = {}
    more: list[str] = []
    if body.binaries and recs:
        size = 0
        for digest, found in store.get_binaries([r.digest for r in recs]).items():
            n = sum(len(x) for b in found for x in b.files.values())
            if size + n > SYNC_BINARY_BYTES:
                more.append(digest)
                continue
            size += n
            binaries[digest] = [BinaryJson(**b.to_json()) for b in found]
    return SyncOut(generation=generation, configs=[out(r) for r in recs], binaries=binaries, more_binaries=more)
