"""The simulator renders chat requests as vLLM does, with its own code: checked against the vLLM
oracle's fixtures for every family they hold, and its --chat-template over a real socket."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loadtest.sim.cli import build_parser, config_from_args
from loadtest.sim.vllm_chat import Unsupported, VllmChat, load_tokenizer
from router.core.bundled import tokenizer_dir
from router.prompt import Renderer
from tests.families import family_dir
from tests.helpers import post

DATA = Path(__file__).resolve().parent / "data"
MODEL = "Qwen/Qwen3-0.6B"

# The fixtures a parity probe's kind of request is checked by: what the simulator must render
# on its own, never through the gateway's renderer.
MUST_TAKE = {
    "chat_simple",
    "chat_system_multi_turn",
    "chat_long_system_prompt",
    "chat_null_content_parallel_tool_calls",
    "chat_special_tokens_in_user_text",
    "chat_non_ascii",
}


def _cases(path: Path) -> list[dict[str, Any]]:
    cases = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [c for c in cases if "messages" in c["body"] and "token_ids" in c["expected"]]


@pytest.mark.parametrize("family", ["qwen3", "llama3", "deepseek_v3"])
def test_own_rendering_matches_the_oracle(family: str) -> None:
    if family == "qwen3":
        path, tok = DATA / "oracle_cases.jsonl", str(tokenizer_dir())
    else:
        path, tok = DATA / "families" / f"{family}.jsonl", str(family_dir(family))
    chat = VllmChat(load_tokenizer(tok))
    taken = set()
    for case in _cases(path):
        try:
            ids = chat.tokenize_chat(case["body"])
        except Unsupported:
            continue
        assert ids == case["expected"]["token_ids"], case["id"]
        taken.add(case["id"])
    assert taken >= MUST_TAKE, MUST_TAKE - taken


TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}:{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant:{% endif %}"
)


async def test_chat_template_flag_changes_what_tokenize_answers(
    fleet: Any, renderer: Renderer, tmp_path: Path
) -> None:
    template_file = tmp_path / "t.jinja"
    template_file.write_text(TEMPLATE)
    args = build_parser("replica").parse_args(["--chat-template", str(template_file)])
    cfg = config_from_args(args)
    assert cfg.chat_template == str(template_file)
    own, other = await fleet(1) + await fleet(1, chat_template=cfg.chat_template)
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": " leading space, <|im_end|> and ünïcode"},
        ],
    }
    async with aiohttp.ClientSession() as http:
        s1, _, a = await post(http, own.url + "/tokenize", body)
        s2, _, b = await post(http, other.url + "/tokenize", body)
    assert s1 == s2 == 200
    assert a["tokens"] == renderer.tokenize_chat(body)
    tok = load_tokenizer(str(tokenizer_dir()))
    assert b["tokens"] == tok.encode(
        "<|im_start|>system:Be brief.<|im_end|>\n<|im_start|>user: leading space, "
        "<|im_end|> and ünïcode<|im_end|>\n<|im_start|>assistant:",
        add_special_tokens=False,
    )
