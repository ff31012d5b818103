"""The trainer's binary read of rollouts' calls and rewards (`reins.recordbatch`)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Response
from pydantic import BaseModel, Field

from reins.gateway.deps import Admin, StoreDep
from reins.gateway.guards import GuardedRoute
from reins.recordbatch import MEDIA_TYPE, encode
from reins.schemas import Identifier

router = APIRouter(prefix="/api/records", tags=["events"], route_class=GuardedRoute)

MAX_ROLLOUTS_PER_READ = 4096


class RecordsRequest(BaseModel):
    # Identifiers as rollouts are declared with: anything else could name no rollout (and a NUL
    # could not even be sent to PostgreSQL).
    rollout_ids: list[Identifier] = Field(min_length=1, max_length=MAX_ROLLOUTS_PER_READ)
    model: Identifier | None = None
    """The policy's registered name: the calls another model served are marked (never
    trained; `samples.records.of_another_model`). None: every call is the policy's."""


@router.post("", response_class=Response, responses={200: {"content": {MEDIA_TYPE: {}}}})
async def read_records(body: RecordsRequest, store: StoreDep, _: Admin) -> Response:
    """The token IDs, logprobs, versions and last reward of each rollout's latest attempt, in
    one binary answer (`reins.recordbatch`; `GatewayClient.get_records` reads it). 404 when a
    rollout does not exist."""
    parts = await store.record_parts(body.rollout_ids, body.model)
    # In a thread: a Python loop over every call of the chunk (thousands), then the join of its
    # blobs, which would hold up the proxied calls sharing the event loop.
    return Response(content=await asyncio.to_thread(encode, parts), media_type=MEDIA_TYPE)
