"""Explain, online and offline: the same ids from the same code path, equal to vLLM's own."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from pathlib import Path

import aiohttp

from router.ops import explain
from tests.helpers import chat_body, post

CASES = [
    json.loads(line)
    for line in (Path(__file__).parent / "data" / "oracle_cases.jsonl").read_text().splitlines()
]
# Bodies vLLM renders (ids fixed by the oracle), and that the gateway routes unchanged: a
# cache_salt would be validated the same way, so keep those too.
VALID = [c for c in CASES if "token_ids" in c["expected"]]


def run_offline(tmp_path: Path, bodies: list[dict], tokenizer_dir: str, *args: str) -> list[dict]:
    src = tmp_path / "bodies.jsonl"
    src.write_text("".join(json.dumps(b) + "\n" for b in bodies) + "not json\n")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = explain.main([str(src), "--tokenizer", tokenizer_dir, *args])
    assert status == 1  # the last line is not JSON: reported, and the exit status says so
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[-1]["error"].startswith("not JSON")
    return lines[:-1]


def test_offline_ids_equal_vllms_own(tmp_path, tokenizer_dir):
    assert len(VALID) >= 40
    rows = run_offline(tmp_path, [c["body"] for c in VALID], tokenizer_dir)
    for case, row in zip(VALID, rows, strict=True):
        assert row["token_ids"] == case["expected"]["token_ids"], case["id"]
        assert len(row["block_hashes"]) == min(8, len(case["expected"]["token_ids"]) // 16)


async def test_online_and_offline_agree(tmp_path, tokenizer_dir, fleet, gateway):
    replicas = await fleet(2)
    gw = await gateway([r.url for r in replicas])
    bodies = [c["body"] for c in VALID[:20]] + [chat_body("explain me")]
    # The offline command runs its own event loop: give it a thread.
    offline = await asyncio.to_thread(run_offline, tmp_path, bodies, tokenizer_dir, "--all-hashes")
    async with aiohttp.ClientSession() as s:
        for body, off in zip(bodies, offline, strict=True):
            status, _, online = await post(
                s, gw.url + "/v1/route/explain?token_ids=1&all_hashes=1", body
            )
            assert status == 200, online
            assert online["token_ids"] == off["token_ids"]
            assert online["block_hashes"] == off["block_hashes"]
            assert online["decision"]["replica"] in {r.url for r in replicas}
            assert {c["replica"] for c in online["candidates"]} == {r.url for r in replicas}


async def test_explain_shows_the_decision_the_live_path_makes(fleet, gateway):
    replicas = await fleet(3)
    gw = await gateway([r.url for r in replicas])
    async with aiohttp.ClientSession() as s:
        _, h, _ = await post(s, gw.url + "/v1/chat/completions", chat_body("first"))
        status, _, ex = await post(s, gw.url + "/v1/route/explain", chat_body("second"))
        assert status == 200
        assert "token_ids" not in ex  # only on request: they can be long
        assert ex["decision"]["replica"] == h["x-prefix-router-replica"]
        assert ex["decision"]["reason"] == "prefix"
        chosen = [c for c in ex["candidates"] if c["chosen"]]
        assert (
            len(chosen) == 1
            and chosen[0]["matched_blocks"] == ex["decision"]["predicted_cached_blocks"] > 0
        )
        # It routes nothing: the replicas saw only the first request.
        _, h2, body = await post(s, gw.url + "/v1/chat/completions", chat_body("second"))
        assert int(h2["x-prefix-router-cached-blocks"]) == ex["decision"]["predicted_cached_blocks"]


async def test_explain_never_shows_the_salt_and_needs_the_admin_key(fleet, gateway, tmp_path):
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url], admin_key="adm-key-123")
    body = chat_body("salted", cache_salt="client-salt-value")
    async with aiohttp.ClientSession() as s:
        status, _, err = await post(s, gw.url + "/v1/route/explain", body)
        assert status == 401 and err["error"]["code"] == "invalid_admin_key"
        status, _, ex = await post(
            s, gw.url + "/v1/route/explain", body, {"X-Admin-Key": "adm-key-123"}
        )
        assert status == 200 and ex["salted"] is True
        assert "client-salt-value" not in json.dumps(ex)
        status, _, err = await post(
            s, gw.url + "/v1/route/explain", {"neither": 1}, {"X-Admin-Key": "adm-key-123"}
        )
        assert status == 400


async def test_gateway_ids_equal_the_replicas_tokenize(fleet, gateway):
    """The gateway's ids (segment-cached fast path) equal what the replica's own /tokenize
    returns (whole-prompt path) for varied chat requests: system prompts, multi-turn, tools,
    content parts, non-ASCII, special-token text."""
    replicas = await fleet(1)
    gw = await gateway([replicas[0].url])
    # Truncation and kv_transfer_params change the prompt outside the chat form of /tokenize.
    chats = [
        c["body"]
        for c in VALID
        if "messages" in c["body"]
        and not {"truncate_prompt_tokens", "kv_transfer_params"} & set(c["body"])
    ]
    assert len(chats) >= 25
    async with aiohttp.ClientSession() as s:
        for body in chats:
            _, _, ex = await post(s, gw.url + "/v1/route/explain?token_ids=1", body)
            tok_body = {
                k: v
                for k, v in body.items()
                if k
                in (
                    "messages",
                    "tools",
                    "add_generation_prompt",
                    "continue_final_message",
                    "chat_template_kwargs",
                    "reasoning_effort",
                )
            }
            status, _, tok = await post(
                s, replicas[0].url + "/tokenize", {"model": "Qwen/Qwen3-0.6B", **tok_body}
            )
            assert status == 200, tok
            assert ex["token_ids"] == tok["tokens"], body
