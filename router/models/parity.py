"""The parity probe: does the gateway tokenize a model's prompts as its replicas do?

A fixed set of requests (a system prompt, tools and tool calls, special-token look-alikes in
user text, leading spaces, non-ASCII, a completions prompt) is rendered and tokenized by the
gateway and sent to each of the model's replicas' own ``/tokenize`` (vLLM renders chat
messages there with the same code as its chat endpoint: vllm/entrypoints/serve/tokenize/, the
chat request's ``tools`` included). The first differing token is the answer: a template, a
tokenizer class or a vocabulary that is not the replicas'. It costs one small request per probe
and replica, at start-up and when a model's replicas change (router/models/upkeep.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from router.prompt import Renderer

_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

# (name, body): chat bodies have "messages", completions bodies "prompt".
PROBES: tuple[tuple[str, dict[str, Any]], ...] = (
    (
        "system",
        {
            "messages": [
                {"role": "system", "content": "You are a careful assistant."},
                {"role": "user", "content": "Summarise the plot of Hamlet in one line."},
                {"role": "assistant", "content": "A prince avenges his father, and all die."},
                {"role": "user", "content": "And Macbeth?"},
            ]
        },
    ),
    (
        "tools",
        {
            "messages": [
                {"role": "user", "content": "What is the weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
            ],
            "tools": _TOOLS,
        },
    ),
    (
        "special_look_alikes",
        {
            "messages": [
                {
                    "role": "user",
                    "content": "Escape <|im_start|>, <|eot_id|>, </s>, [INST] and <think> "
                    "as plain text, please.",
                }
            ]
        },
    ),
    (
        "spaces_non_ascii",
        {
            "messages": [
                {"role": "user", "content": "   three leading spaces,\ttabs\n\nand  gaps"},
                {"role": "assistant", "content": " Déjà vu — naïve café, 東京, emoji 🚀."},
                {"role": "user", "content": "Ünïcödé ?"},
            ]
        },
    ),
    ("completion", {"prompt": " A completions prompt: leading space, ü and <|endoftext|>."}),
)


# Names the probe's requests in a replica's logs (and lets a test backend tell them apart).
PROBE_HEADER = "X-Prefix-Router-Probe"


@dataclass(frozen=True)
class Parity:
    """One replica's answer: ``state`` exact, mismatch, or unavailable (its /tokenize did not
    answer ids: not checked); ``detail`` says where, in words."""

    state: str
    detail: str | None = None


def gateway_ids(renderer: Renderer, body: Mapping[str, Any]) -> list[int]:
    if "messages" in body:
        return list(renderer.tokenize_chat(dict(body)))
    return list(renderer.tokenize_completion_request(dict(body))[0])


def first_difference(
    ours: Sequence[int], theirs: Sequence[int], decode: Callable[[Sequence[int]], str]
) -> str | None:
    """Where two id lists part, in words (None: equal)."""
    if list(ours) == list(theirs):
        return None
    i = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
        min(len(ours), len(theirs)),
    )

    def at(ids: Sequence[int]) -> str:
        return f"{ids[i]} {decode([ids[i]])!r}" if i < len(ids) else "the end"

    return f"token {i}: {at(ours)} at the gateway, {at(theirs)} at the replica"


async def probe_replica(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    renderer: Renderer,
    ours: Sequence[tuple[str, list[int]]],
    headers: Mapping[str, str],
    timeout_s: float,
) -> Parity:
    """Send every probe to ``url``'s /tokenize and compare with ``ours`` (the gateway's ids,
    computed once per model)."""
    bodies = dict(PROBES)
    for name, ids in ours:
        try:
            async with session.post(
                url + "/tokenize",
                json={"model": model, **bodies[name]},
                headers={**headers, PROBE_HEADER: "parity"},
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                if resp.status != 200:
                    return Parity("unavailable", f"{url}/tokenize answered HTTP {resp.status}")
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            return Parity("unavailable", f"{url}/tokenize: {type(e).__name__}")
        theirs = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(theirs, list):
            return Parity("unavailable", f"{url}/tokenize answered no tokens")
        where = first_difference(ids, theirs, renderer.decode)
        if where is not None:
            return Parity("mismatch", f"probe {name!r} on {url}: {where}")
    return Parity("exact")
