"""Prompt → token ids, exactly as vLLM renders and tokenizes them.

STUB INTERFACE (to be completed): normalisation of chat requests as vLLM does it, and a
segment cache for the tokenization fast path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from router.errors import bad_request


class Renderer:
    """Renders and tokenizes requests for one model's tokenizer.

    ``tokenize_chat(body)`` and ``tokenize_completion(prompt)`` are the live path;
    ``segment_cache=False`` gives the plain whole-prompt path (what the simulated replica uses).
    """

    def __init__(self, tokenizer: Any, *, segment_cache: bool = True) -> None:
        self.tokenizer = tokenizer
        self.segment_cache = segment_cache

    @classmethod
    def from_pretrained(cls, name_or_path: str, **kwargs: Any) -> Renderer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(name_or_path), **kwargs)

    def render_chat(self, body: dict[str, Any]) -> str:
        tools = body.get("tools")
        kwargs = dict(body.get("chat_template_kwargs") or {})
        return self.tokenizer.apply_chat_template(
            body["messages"], tools=tools, tokenize=False,
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False), **kwargs)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def tokenize_chat(self, body: dict[str, Any]) -> list[int]:
        return self.encode(self.render_chat(body), add_special_tokens=False)

    def tokenize_completion(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens=True)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise bad_request("prompt must be a string or a list of token ids", "prompt")

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids)))
