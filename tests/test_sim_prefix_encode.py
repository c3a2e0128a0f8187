"""The simulator encodes a growing conversation from the ids of its longest prefix encoded
before (loadtest/sim/prefix_encode.py): the very ids vLLM's whole encode gives, for every
family it finds exact, and the whole encode for one it does not."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import AddedToken

from loadtest import agentic as ag
from loadtest import workloads as wl
from loadtest.sim.prefix_encode import PrefixEncoder
from loadtest.sim.tokens import get_vllm_chat
from loadtest.sim.vllm_chat import VllmChat, load_tokenizer
from tests.families import family_dir


def _texts(chat: VllmChat) -> list[str]:
    """An agent session's prompts as the family's template renders them, turn by turn."""
    workload = wl.build(
        "agentic",
        sessions=2,
        turns=(5, 5),
        system_words=600,
        subagent_share=0.0,
        messages_share=0.0,
        tool_result_words=(400, 1500),
    )
    out = []
    for spec in ag.iter_specs(workload, lambda s: f"Done with step {s.turn}; reading next."):
        body: dict[str, Any] = spec.body or {}
        if chat.template is None:  # a tokenizer without one (phi3's): turns between </s>
            out.append("</s>".join(str(m.get("content") or "") for m in body["messages"]))
            continue
        out.append(
            chat.tokenizer.apply_chat_template(
                [chat._message(m) for m in body["messages"]],
                tools=chat._tools(body.get("tools")),
                chat_template=chat.template,
                add_generation_prompt=True,
                tokenize=False,
            )
        )
    return out


def _check(chat: VllmChat) -> PrefixEncoder:
    encoder = PrefixEncoder(chat.tokenizer)
    for text in _texts(chat):
        assert encoder.encode(text) == list(chat.tokenizer.encode(text, add_special_tokens=False))
    return encoder


def test_qwen3_later_turns_come_from_the_cached_prefix_and_match_the_whole_encode() -> None:
    encoder = _check(get_vllm_chat())
    assert encoder.exact and encoder.hits >= 6  # every later turn of both sessions


@pytest.mark.parametrize("family", ["llama3", "deepseek_v3", "phi3"])
def test_other_families_match_the_whole_encode(family: str) -> None:
    tokenizer = load_tokenizer(str(family_dir(family)))
    _check(VllmChat(tokenizer))


def test_an_added_token_that_strips_spaces_turns_the_cut_off() -> None:
    tokenizer = load_tokenizer(str(get_vllm_chat().tokenizer.name_or_path))
    tokenizer.add_tokens([AddedToken("<|probe|>", rstrip=True)])
    encoder = PrefixEncoder(tokenizer)
    assert not encoder.exact
    text = ("word " * 1000 + "<|probe|>   tail") * 2
    assert encoder.encode(text) == list(tokenizer.encode(text, add_special_tokens=False))
    assert encoder.hits == 0
