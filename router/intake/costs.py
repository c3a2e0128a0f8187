"""What a request will cost the replicas, in tokens, read from its body as vLLM 0.34 reads it:
the output it may generate, how many sequences generate it, and a cheap lower bound on its
prompt before anything is rendered. Rate limits (tpm), flow control's fair-queue cost and the
non-streamed slot timer all price a request from here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def output_limit(body: Mapping[str, Any]) -> int | None:
    """The most tokens one sequence may generate, or None when the body does not say.

    vLLM's chat request takes ``max_completion_tokens`` when it is not None, else
    ``max_tokens`` (``ChatCompletionRequest.build_tok_params``, vllm/entrypoints/openai/
    chat_completion/protocol.py): an explicit ``"max_completion_tokens": null`` falls back
    to ``max_tokens``. Completions, Messages (converted) and Responses (converted) bodies
    carry ``max_tokens`` only."""
    limit = body.get("max_completion_tokens")
    if limit is None:
        limit = body.get("max_tokens")
    return limit if type(limit) is int and limit >= 0 else None


def sequences(body: Mapping[str, Any], prompts: int = 1) -> int:
    """Sequences the replica generates: ``n`` per prompt (vLLM 0.34's ``SamplingParams.n``;
    with beam search, the beam width), for each prompt of a completions batch. ``best_of``
    is not read: vLLM 0.34's requests no longer have it (an unknown field is ignored)."""
    n = body.get("n")
    return (n if type(n) is int and n > 1 else 1) * max(1, prompts)


def prompt_count(body: Mapping[str, Any]) -> int:
    """Prompts in a completions body: a list of strings or of token-id lists is a batch;
    a string or a flat token-id list is one."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def text_chars(value: Any) -> tuple[int, int]:
    """(characters of text, token ids) in ``value``: strings anywhere in it, and integers in
    lists (token-id prompts: one token each). Iterative; the body was already bounded
    (router/intake/shapes.py), so this costs what a walk of its values costs."""
    chars = ids = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if type(v) is str:
            chars += len(v)
        elif type(v) is dict:
            stack.extend(v.values())
        elif type(v) is list:
            for x in v:
                if type(x) is int:
                    ids += 1
                else:
                    stack.append(x)
    return chars, ids


# Fields that hold what a replica tokenizes (generation, pooling, scoring and reranking
# bodies): their text is the prompt, whatever else the body carries.
PROMPT_FIELDS = (
    "messages",
    "prompt",
    "input",
    "query",
    "documents",
    "text_1",
    "text_2",
    "data_1",
    "data_2",
    "queries",
    "items",
    "text",
    "tokens",
)


def prompt_floor(body: Mapping[str, Any], max_chars_per_token: int) -> int:
    """Prompt tokens the body holds at the least: the text of its prompt fields over the
    longest string one token can stand for, plus the token ids given as such. A lower bound
    (what a template or a tokenizer adds is not counted), so a request refused on it would
    have been refused on its exact count too."""
    chars = ids = 0
    for key in PROMPT_FIELDS:
        if key in body:
            c, i = text_chars(body[key])
            chars += c
            ids += i
    return -(-chars // max(1, max_chars_per_token)) + ids
