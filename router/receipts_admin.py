"""``GET /admin/receipts``: the newest per-request receipts (:mod:`kvroute.router.receipts`), admin only."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query
from kvroute.router.admin import require_admin
from kvroute.router.receipts import Receipts


def receipts_router(receipts: Receipts) -> APIRouter:
    """The newest ``limit`` receipts, newest last."""
    router = APIRouter(dependencies=[Depends(require_admin)])

    @router.get("/receipts", summary="The newest per-request receipts: plan, prediction, runner-up, observed")
    async def recent(limit: int = Query(100, ge=0, le=10_000)) -> dict[str, Any]:
        return {"receipts": receipts.recent(limit)}

    return router
