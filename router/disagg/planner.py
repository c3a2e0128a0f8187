"""Planning a request in a disaggregated fleet, decode first (as llm-d's default
``decode-first`` stage order): the decode replica is chosen by the decode pool's policy (by
default prefix-aware: a decode replica pulls only the blocks it lacks, so the one holding the
most needs the fewest), then whether a prefill leg is worth it (router/disagg/decision.py),
then the prefill replica by the prefill pool's policy (prefix-aware: its prefix cache decides
how much of the prompt is computed). Both are chosen before anything is sent: NIXL pull mode
lets the decode replica be chosen before or after the prefill leg, and choosing it first is
what lets its cache decide whether to split at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from router.core.errors import APIError
from router.disagg.decision import NO_PREFILL_REPLICA, Thresholds, skip_reason
from router.fleet.replicas import Role
from router.intake.routed_request import RoutedRequest
from router.routing.plan import Leg, Plan

STORED_RESPONSE = "stored_response"  # a Responses chain lives in one replica's store
CLIENT_TRANSFER_PARAMS = "client_transfer_params"  # the client set kv_transfer_params

ChooseLeg = Callable[[RoutedRequest, frozenset[str], "str | None", Role], Awaitable[Leg]]


async def plan(
    choose: ChooseLeg,
    rr: RoutedRequest,
    exclude: frozenset[str],
    slot: str | None,
    thresholds: Thresholds,
    prefill_first: bool = False,
) -> Plan:
    """The request's legs: a prefill leg then a decode leg, or the decode leg alone with why
    (``Plan.skipped``). ``slot``: flow control's reservation, on the prefill pool.
    ``prefill_first``: the decode leg's replica is chosen again after the prefill answer."""
    decode = await choose(rr, exclude, None, "decode")  # none left: the request's 502/503
    if "kv_transfer_params" in rr.body:
        # A client trusted to set them (auth off, or its tenant's allow_fields: tenancy
        # refuses them otherwise) drives the transfer itself: sent as it is.
        return Plan((decode,), CLIENT_TRANSFER_PARAMS)
    if rr.pinned_replica is not None:
        # previous_response_id: the chain is in the store of the replica that answered it,
        # which serves the request whole (a prefill replica would answer 404).
        return Plan((decode,), STORED_RESPONSE)
    held = decode.decision.matched_blocks * rr.block_size
    reason = skip_reason(rr.num_tokens, held, rr.sequences, thresholds)
    if reason is not None:
        return Plan((decode,), reason)
    try:
        prefill = await choose(rr, exclude, slot, "prefill")
    except APIError:  # every prefill replica down or failed this request: aggregated
        return Plan((decode,), NO_PREFILL_REPLICA)
    # The decode replica computes one token of the prompt (it pulls the rest).
    return Plan((prefill, dataclasses.replace(decode, prefill_tokens=0)), None, prefill_first)
