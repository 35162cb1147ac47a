"""/v1/best/{op}: the best config for a shape on a device class, asked the way a person asks.

    curl -H "Authorization: Bearer $TOKEN" \
      "$URL/v1/best/matmul?device=sm_90:132&M=4096&N=4096&K=4096&dtype=bfloat16"

The shape takes the same KEY=VALUE pairs as `tunecache tune -p`, completed by the same function
(`tunecache.shapes.canonical_problem`). The kernel and its version are resolved here: the
preferred backend the fleet holds a winner for on that device class (blackwell, hopper,
portable), the newest version of it, unless the caller names `backend` or `kernel_version`.
"""

from __future__ import annotations

import math
from typing import Literal, Optional

from fastapi import APIRouter, Depends, HTTPException, Query

from tunecache.errors import last_line
from tunecache.key import DeviceClass
from tunecache.server.configs import out
from tunecache.server.deps import ReadToken, StoreDep
from tunecache.server.schemas import ConfigOut, ErrorOut
from tunecache.shapes import KEYS, canonical_problem, problem_distance, shape_pairs
from tunecache.store.records import JobRecord
from tunecache_kernels.spaces import BACKENDS

router = APIRouter(prefix="/v1", tags=["configs"])

Shape = Optional[str]


def _given_shape(
    M: Shape = None,
    N: Shape = None,
    K: Shape = None,
    a_layout: Shape = None,
    b_layout: Shape = None,
    H: Shape = None,
    W: Shape = None,
    Ci: Shape = None,
    Co: Shape = None,
    R: Shape = None,
    S: Shape = None,
    stride: Shape = None,
    padding: Shape = None,
    stride_h: Shape = None,
    stride_w: Shape = None,
    pad_h: Shape = None,
    pad_w: Shape = None,
    dtype: Shape = None,
) -> dict[str, str]:
    """The shape's KEY=VALUE pairs the query gave: each of these query parameters is optional,
    and which an op takes is checked against its KEYS."""
    return {k: v for k, v in locals().items() if v is not None}


@router.get(
    "/best/{op}",
    response_model=ConfigOut,
    summary="The best config for a shape",
    responses={
        404: {
            "model": ErrorOut,
            "description": "no winner for this shape; the answer names the key it looked for, "
            "its pending tuning job (a submitted result waiting to be re-timed) and its state, "
            "and the nearest tuned shapes",
        }
    },
)
def best(
    op: Literal["matmul", "conv2d_fprop", "conv2d_wgrad", "conv2d_dgrad"],
    _: ReadToken,
    store: StoreDep,
    device: str = Query(..., max_length=40, description="the device class ARCH:SMS, e.g. sm_90:132"),
    backend: Optional[Literal["blackwell", "hopper", "portable"]] = Query(None),
    kernel_version: Optional[str] = Query(None, max_length=64),
    triton_version: Optional[str] = Query(None, max_length=32),
    given: dict[str, str] = Depends(_given_shape),
) -> ConfigOut:
    try:
        dev = DeviceClass.parse(device)
        unknown = sorted(k for k in given if k not in KEYS[op])
        if unknown:
            raise ValueError(f"{op} takes no {', '.join(unknown)}; it takes {', '.join(KEYS[op])}")
        problem = canonical_problem(op, given)
    except ValueError as e:
        raise HTTPException(422, str(e)) from None
    kernels = [f"{op}.{b}" for b in BACKENDS if backend in (None, b)]
    candidates = [
        r
        for k in kernels
        for r in store.list_configs(kernel=k, arch=dev.arch)
        if r.key.sm_count == dev.sm_count
        and (kernel_version is None or r.key.kernel_version == kernel_version)
        and (triton_version is None or r.key.triton_version == triton_version)
    ]
    hits = [r for r in candidates if dict(r.key.problem) == problem]
    if hits:
        # the preferred backend, then its newest version
        hits.sort(key=lambda r: (kernels.index(r.key.kernel), -(r.tuned_at.timestamp() if r.tuned_at else 0)))
        return out(hits[0])
    near = sorted(candidates, key=lambda r: problem_distance(problem, dict(r.key.problem)))[:3]
    shown = "; ".join(
        f"{r.key.kernel} {shape_pairs(r.key.problem)} (digest {r.digest[:12]})"
        for r in near
        if math.isfinite(problem_distance(problem, dict(r.key.problem)))
    )
    pending = [
        j
        for j in store.list_jobs(arch=dev.arch, sm_count=dev.sm_count, limit=10000)
        if j.status != "done"
        and j.key.kernel in kernels
        and dict(j.key.problem) == problem
        and (kernel_version is None or j.key.kernel_version == kernel_version)
        and (triton_version is None or j.key.triton_version == triton_version)
    ]
    raise HTTPException(
        404,
        f"no winner for {op} {shape_pairs(problem)} on {dev} among {', '.join(kernels)}"
        f"{'' if kernel_version is None else f' version {kernel_version}'}"
        f"{''.join(f'; {pending_text(j)}' for j in pending)}; "
        f"nearest tuned shapes: {shown or 'none on this device class'}",
    )


def pending_text(job: JobRecord) -> str:
    """What a key without a winner waits for: its tuning job (a submitted result's re-timing, or
    a queued key), in words, with what makes it move."""
    key = job.key
    head = f"job {job.digest[:12]} ({key.kernel}) is {job.status}, attempt {job.attempts}/{job.max_attempts}"
    if job.status == "queued":
        return f"{head}: the fleet's winner once a worker of {key.arch}:{key.sm_count} tunes it (`tunecache worker`)"
    if job.status == "running":
        return f"{head}: a worker ({job.lease_owner}) is tuning it; its result will be the fleet's winner"
    why = last_line(job.unreadable or job.last_error or "") or "no error recorded"
    return f"{head} ({why}): `tunecache jobs retry {job.digest[:12]}` queues it again"
