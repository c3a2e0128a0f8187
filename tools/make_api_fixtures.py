#!/usr/bin/env python
"""Regenerate tests/data/api_oracle_cases.jsonl: Anthropic Messages and OpenAI Responses
bodies with the prompt token ids vLLM 0.34.0 computes for them.

vLLM's own conversion runs inside the oracle's venv (its source:
vllm/entrypoints/anthropic/serving.py ``_convert_anthropic_to_openai_request``;
vllm/entrypoints/openai/responses/utils.py ``construct_input_messages`` /
``construct_tool_dicts`` / ``should_continue_final_message``), and its chat body is rendered by
the oracle (shared/tools/vllm_oracle: vLLM's OnlineRenderer on the CPU). tests/test_apis.py
checks the gateway's converters + Renderer against the file in the default test run.

    python tools/make_api_fixtures.py [--oracle ~/.cache/prefix-eval/vllm-oracle]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "data" / "api_oracle_cases.jsonl"
DEFAULT_ORACLE = Path.home() / ".cache" / "prefix-eval" / "vllm-oracle"
VLLM_DIR = "vllm-0.34.0"
LONG = "You are a careful coding agent. Read files before editing them. " * 6
TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
]
RTOOLS = [
    {
        "type": "function",
        "name": "read_file",
        "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
]

MESSAGES: list[tuple[str, dict[str, Any]]] = [
    ("msg_system_string", {"system": LONG, "messages": [{"role": "user", "content": "Hi"}]}),
    (
        "msg_system_blocks_cache_control",
        {
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; h=abc"},
                {"type": "text", "text": LONG, "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Be terse."},
            ],
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "text",
                            "text": "Fix the bug.",
                            "cache_control": {"type": "ephemeral"},
                        }
                    ],
                }
            ],
        },
    ),
    (
        "msg_tool_use_multi_turn",
        {
            "system": LONG,
            "tools": TOOLS,
            "tool_choice": {"type": "any"},
            "messages": [
                {"role": "user", "content": "What is in main.py?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Let me look."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "read_file",
                            "input": {"path": "main.py"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "print('hi')"},
                        {"type": "text", "text": "And now?"},
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use",
                            "id": "toolu_2",
                            "name": "read_file",
                            "input": {"path": "ü.py"},
                        }
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_2",
                            "content": [
                                {"type": "text", "text": "a"},
                                {"type": "text", "text": "b"},
                            ],
                        }
                    ],
                },
            ],
        },
    ),
    (
        "msg_thinking_blocks",
        {
            "messages": [
                {"role": "user", "content": "2+2?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Add them.", "signature": "sig"},
                        {"type": "redacted_thinking", "data": "xyz"},
                        {"type": "text", "text": "4"},
                    ],
                },
                {"role": "user", "content": "And 3+3?"},
            ]
        },
    ),
    (
        "msg_system_in_messages_and_text_parts",
        {
            "system": "Top.",
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": " Inner."}]},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
        },
    ),
]

RESPONSES: list[tuple[str, dict[str, Any]]] = [
    ("resp_instructions_string", {"instructions": LONG, "input": "Hi"}),
    (
        # (No input_text parts: the oracle renders through a ChatCompletionRequest, which
        # rejects them, where vLLM's Responses path takes them as text.)
        "resp_items_message_developer",
        {
            "input": [
                {"role": "developer", "content": "Use tabs."},
                {"type": "message", "role": "user", "content": "Hello"},
            ]
        },
    ),
    (
        "resp_function_call_round_trip",
        {
            "instructions": LONG,
            "tools": RTOOLS,
            "input": [
                {"role": "user", "content": "What is in main.py?"},
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "read_file",
                    "arguments": '{"path":"main.py"}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "print('hi')"},
            ],
        },
    ),
    (
        "resp_reasoning_then_message",
        {
            "input": [
                {"role": "user", "content": "2+2?"},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "Add them."}],
                },
                {
                    "type": "message",
                    "id": "msg_1",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "4", "annotations": []}],
                },
                {"role": "user", "content": "And 3+3?"},
            ]
        },
    ),
]

# Runs in the oracle venv: vLLM's own converters, printing one chat body per input line.
CONVERT = r"""
import json, sys
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.openai.responses.utils import (
    construct_input_messages, construct_tool_dicts, should_continue_final_message)
template = json.load(open("model/qwen3/tokenizer_config.json"))["chat_template"]
merge = AnthropicServingMessages._detect_merge_inline_system(template)
print("merge_inline_system", merge, file=sys.stderr)
for line in sys.stdin:
    case = json.loads(line)
    if case["api"] == "messages":
        req = AnthropicMessagesRequest.model_validate(case["body"])
        chat = AnthropicServingMessages.to_chat_completion_request(req, merge_inline_system=merge)
        out = json.loads(chat.model_dump_json(exclude_none=True))
        out = {k: out[k] for k in ("messages", "tools", "tool_choice") if k in out}
    else:
        req = ResponsesRequest.model_validate(case["body"])
        msgs = construct_input_messages(request_instructions=req.instructions, request_input=req.input)
        tools = construct_tool_dicts(req.tools, req.tool_choice)
        cont = should_continue_final_message(req.input)
        out = {"messages": json.loads(json.dumps(msgs, default=lambda o: o.model_dump() if hasattr(o, "model_dump") else list(o)))}
        if tools:
            out["tools"] = tools
        if cont:
            out["add_generation_prompt"] = False
            out["continue_final_message"] = True
    out["_id"] = case["id"]
    print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--oracle", type=Path, default=Path(os.environ.get("PREFIX_ROUTER_ORACLE", DEFAULT_ORACLE))
    )
    args = ap.parse_args()
    py = args.oracle / "venv" / "bin" / "python"
    env = {**os.environ, "PYTHONPATH": str(args.oracle / VLLM_DIR), "VLLM_TARGET_DEVICE": "cpu"}
    cases = [
        {"id": i, "api": "messages", "body": {"model": "m", "max_tokens": 16, **b}}
        for i, b in MESSAGES
    ]
    cases += [{"id": i, "api": "responses", "body": {"model": "m", **b}} for i, b in RESPONSES]
    lines = "".join(json.dumps(c) + "\n" for c in cases)
    converted = subprocess.run(
        [str(py), "-c", CONVERT],
        input=lines,
        capture_output=True,
        text=True,
        env=env,
        cwd=args.oracle,
        check=False,
    )
    sys.stderr.write("".join(ln + "\n" for ln in converted.stderr.splitlines() if "merge" in ln))
    if converted.returncode:
        sys.stderr.write(converted.stderr[-4000:])
        return 1
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write(converted.stdout)
    rendered = subprocess.run(
        [str(py), str(args.oracle / "oracle.py"), "-i", f.name],
        capture_output=True,
        text=True,
        env=env,
        cwd=args.oracle,
        check=False,
    )
    if rendered.returncode:
        sys.stderr.write(rendered.stderr[-4000:])
        return 1
    results = [json.loads(line) for line in rendered.stdout.splitlines() if line.startswith("{")]
    by_id = {r.get("_id"): r for r in results}
    with FIXTURE.open("w") as out:
        for c, chat_line in zip(cases, converted.stdout.splitlines(), strict=True):
            r = by_id.get(c["id"]) or results[cases.index(c)]
            expected = (
                {"token_ids": r["token_ids"]} if "token_ids" in r else {"error": r.get("error")}
            )
            chat = json.loads(chat_line)
            chat.pop("_id", None)
            out.write(
                json.dumps({**c, "vllm_chat": chat, "expected": expected}, ensure_ascii=False)
                + "\n"
            )
    print(f"wrote {len(cases)} cases to {FIXTURE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
