"""Prefill/decode disaggregation through the endpoint picker: the picker runs the prefill leg
itself over its own HTTP client, as proxy mode does (router/disagg/collect.py), then hands
Envoy the decode leg, its body carrying the prefill's kv_transfer_params, with fallbacks that
can decode."""

from __future__ import annotations

import json
from typing import Any

from loadtest.envoy_standin import EnvoyStandIn
from tests.helpers import chat_body
from tests.test_pd import LONG_USER, Fleet, corrupt, nixl

CHAT = "/v1/chat/completions"


async def test_both_legs_through_the_picker_and_fallbacks_that_decode(
    fleet: Fleet, gateway: Any
) -> None:
    p, d1, d2 = await nixl(fleet, 3)
    running = await gateway(
        [],
        prefill_replicas=[p.url],
        decode_replicas=[d1.url, d2.url],
        decision_headers=True,
        ext_proc_port=0,
        ext_proc_fallbacks=2,
    )
    envoy = EnvoyStandIn(f"127.0.0.1:{running.ext_proc_port}")
    try:
        got = await envoy.post(CHAT, chat_body(LONG_USER))
    finally:
        await envoy.close()
    assert got.status == 200, got.body
    decoders = {d.url.removeprefix("http://"): d for d in (d1, d2)}
    # Envoy is told the decode replica, and only decode replicas to fall back on: a prefill
    # replica would answer the decode leg with a prefill of its own.
    assert set(got.pick.split(",")) == set(decoders) and got.served == got.pick.split(",")[0]
    d = decoders[got.served]
    assert got.headers["x-prefix-router-replica"] == d.url
    assert got.headers["x-prefix-router-prefill-replica"] == p.url
    # The prefill leg went from the picker to P; the decode leg, through Envoy, pulled it all.
    (p_leg,) = p.stats["records"]
    n = p_leg["prompt_tokens"]
    assert p_leg["completion_tokens"] == 1
    params = json.loads(got.sent_body)["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_port"] == int(p.url.rsplit(":", 1)[1])
    assert d.stats["pulled_blocks"] == -(-n // 16)
    assert json.loads(got.body)["usage"]["prompt_tokens"] == n
    assert corrupt([p, d1, d2]) == 0
    gw = running.gateway
    assert gw.fleet is not None
    assert all(r.inflight == 0 and r.pending_requests == 0 for r in gw.fleet.replicas.values())
