"""/v1/whoami: what the caller's token is and may do (for `tunecache doctor`)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from tunecache.server.deps import ReadToken
from tunecache.store.records import TOKEN_SCOPES

router = APIRouter(prefix="/v1", tags=["system"])


class WhoamiOut(BaseModel):
    name: str = Field(description="the token's name ('anonymous' when anonymous reads are on and none was sent)")
    scopes: list[str] = Field(description="the scopes it was given")
    may: list[str] = Field(description="everything those scopes allow")


@router.get("/whoami", response_model=WhoamiOut, summary="The caller's token and what it may do")
def whoami(token: ReadToken) -> WhoamiOut:
    may = sorted({s for sc in token.scopes for s in TOKEN_SCOPES.get(sc, ())})
    return WhoamiOut(name=token.name, scopes=list(token.scopes), may=may)
