"""/v1/audit: the log of admin actions (deletes, imports, token and queue operations)."""

from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from tunecache.server.deps import AdminToken, StoreDep
from tunecache.server.schemas import UtcTime

router = APIRouter(prefix="/v1", tags=["system"])
_NO_NUL = r"^[^\x00]*$"  # Postgres text cannot hold NUL


class AuditOut(BaseModel):
    id: int
    at: UtcTime
    actor: str = Field(description="the token's name, or `cli:user@host` for the command line")
    actor_token_id: Optional[int] = Field(None, description="the token's id (none for the command line)")
    action: str = Field(description="what was done, e.g. `config.delete`, `token.revoke`")
    target: str = Field(description="on what, e.g. `config:<digest>`, `token:7`")
    details: Optional[dict[str, Any]] = None


@router.get("/audit", response_model=list[AuditOut], summary="The audit log of admin actions, newest first")
def audit_log(
    _: AdminToken,
    store: StoreDep,
    action: Optional[str] = Query(None, max_length=64, pattern=_NO_NUL),
    actor: Optional[str] = Query(None, max_length=128, pattern=_NO_NUL),
    limit: int = Query(100, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=10**9),
) -> list[AuditOut]:
    return [AuditOut(**r.__dict__) for r in store.audit_log(limit=limit, offset=offset, action=action, actor=actor)]
