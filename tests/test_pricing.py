"""What a request is charged, over real sockets: tpm, flow control's fair-queue cost and the
checks made before a prompt is rendered. A tenant's tpm refuses a request larger than its
whole minute ("can never be admitted"), so whether a body is charged its full size shows as
a refusal, not as a timed reading of the bucket."""

from __future__ import annotations

from typing import Any

import aiohttp

from tests.helpers import chat_body, post

MODEL = "Qwen/Qwen3-0.6B"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "


def long_text(i: int, words: int) -> str:
    return f"Document {i}: " + (WORDS * (words // 16 + 1))[: words * 6]


def completion(prompt: Any, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, **extra}


async def test_a_completions_batch_is_charged_every_prompt(fleet, gateway) -> None:
    """``prompt: ["hi", <8 long prompts>]`` was charged as "hi" (the prompt it routes on):
    ~17 tokens against the tpm limit, the fair-queue cost and the slot timer alike."""
    (replica,) = await fleet(1)
    gw = await gateway(
        [replica.url],
        flow_control=True,
        tenant_header="X-Tenant",
        tenants={"metered": {"tpm": 3000}, "free": {}},
    )
    renderer = gw.gateway.renderer
    batch = ["hi"] + [long_text(i, 500) for i in range(8)]
    ids = renderer.completion_request_ids({"prompt": batch})
    total = sum(len(p) for p in ids)
    assert len(ids[0]) < 5 and total > 3000  # its first prompt alone would fit
    token_batch = [list(p) for p in ids]
    async with aiohttp.ClientSession() as http:
        url = gw.url + "/v1/completions"
        for prompt in (batch, token_batch):
            status, headers, err = await post(
                http, url, completion(prompt), {"X-Tenant": "metered"}
            )
            assert status == 429, err
            assert "can never be admitted" in err["error"]["message"]
            assert "Retry-After" not in headers
        # the first prompt alone passes: the refusal is the batch's size
        ok = await post(http, url, completion(batch[:1]), {"X-Tenant": "metered"})
        assert ok[0] == 200
        # flow control's cost (the fair queue's usage) counts every prompt and every output
        status, _, _ = await post(http, url, completion(token_batch), {"X-Tenant": "free"})
    assert status == 200
    usage = gw.gateway.flow.usage[(MODEL, "free")]
    assert usage == total + 8 * len(batch)


async def test_tpm_counts_the_output_vllm_would_allow(fleet, gateway) -> None:
    """``max_completion_tokens: null`` with ``max_tokens: 4000`` is 4000 output tokens (vLLM
    falls back to ``max_tokens``), not the 256 of a body that says nothing; ``n`` sequences
    each generate up to ``max_tokens``; a request over the tenant's whole minute is refused
    at once, saying it can never pass, instead of being admitted."""
    (replica,) = await fleet(1)
    gw = await gateway(
        [replica.url],
        tenant_header="X-Tenant",
        tenants={f"t{i}": {"tpm": 3000} for i in range(6)},
    )
    url = gw.url + "/v1/chat/completions"

    async def send(tenant: str, **extra: Any) -> tuple[int, Any, Any]:
        body = chat_body("Hello there")
        del body["max_tokens"]
        body.update(extra)
        return await post(http, url, body, {"X-Tenant": tenant})

    async with aiohttp.ClientSession() as http:
        s, _, err = await send("t0", max_completion_tokens=None, max_tokens=4000)
        assert s == 429 and "can never be admitted" in err["error"]["message"], err
        assert (await send("t1", max_completion_tokens=None, max_tokens=100))[0] == 200
        s, headers, err = await send("t2", max_tokens=200, n=16)
        assert s == 429 and "can never be admitted" in err["error"]["message"], err
        assert err["error"]["code"] == "rate_limit_exceeded" and "Retry-After" not in headers
        assert (await send("t3", max_tokens=200, n=2))[0] == 200
        # larger than the minute's budget by its prompt alone
        s, _, err = await send("t4", messages=[{"role": "user", "content": long_text(0, 4000)}])
        assert s == 429 and "can never be admitted" in err["error"]["message"], err


async def test_over_its_rpm_a_request_is_refused_before_it_is_rendered(
    fleet, gateway, monkeypatch
) -> None:
    """Over its rpm, a tenant's request was parsed, rendered and tokenized (3-12 ms for a
    28k-token prompt) before its 429; now rpm is checked first, and a prompt whose text
    alone is over the tenant's tpm is refused before rendering too."""
    (replica,) = await fleet(1)
    gw = await gateway(
        [replica.url],
        tenant_header="X-Tenant",
        tenants={"metered": {"rpm": 1}, "small": {"tpm": 1000}},
    )
    renderer = gw.gateway.renderer
    renders: list[int] = []
    real_render = renderer._render

    def counted(norm: dict[str, Any]) -> str:
        renders.append(1)
        return real_render(norm)

    monkeypatch.setattr(renderer, "_render", counted)
    url = gw.url + "/v1/chat/completions"
    async with aiohttp.ClientSession() as http:
        first = await post(http, url, chat_body("One"), {"X-Tenant": "metered"})
        assert first[0] == 200 and len(renders) == 1  # rendered: the count watches it
        second = await post(http, url, chat_body("Two"), {"X-Tenant": "metered"})
        assert second[0] == 429 and second[2]["error"]["code"] == "rate_limit_exceeded"
        assert int(second[1]["Retry-After"]) >= 1
        big = chat_body("x " * 300_000)  # 600k characters: over 1,000 tokens at any rate
        third = await post(http, url, big, {"X-Tenant": "small"})
        assert third[0] == 429 and "can never be admitted" in third[2]["error"]["message"]
    assert len(renders) == 1
