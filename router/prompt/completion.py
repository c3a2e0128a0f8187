"""Completions prompts as vLLM's prompt_to_seq sees them (a string, token ids, or a batch of
either), their truncation, and the validation of token ids a client sends (completions
prompts, and ``kv_transfer_params.prompt_token_ids`` in disaggregated serving)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.core.salt import validate_cache_salt
from router.prompt.fields import TokenIds, as_token_id, bool_field, check_mm_kwargs, error, lax_bool
from router.prompt.limits import PromptLimits, Truncation

MAX_COMPLETION_PROMPTS = 1024
"""vLLM's ``VLLM_MAX_COMPLETION_PROMPTS`` default."""


def reused_prompt_token_ids(body: Mapping[str, Any], vocab_size: int) -> list[int] | None:
    """Disaggregated serving: vLLM takes ``kv_transfer_params.prompt_token_ids`` as the
    prompt (no rendering, no truncation) unless ``echo`` is set."""
    kv = body.get("kv_transfer_params")
    if not isinstance(kv, dict) or kv.get("prompt_token_ids") is None:
        return None
    if lax_bool(body.get("echo", False)):
        return None
    ids = kv["prompt_token_ids"]
    param = "kv_transfer_params.prompt_token_ids"
    if not isinstance(ids, list) or not ids or any(type(x) is not int or x < 0 for x in ids):
        raise error(
            "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of "
            "non-negative integers.",
            param,
        )
    bad = max(ids)
    if bad >= vocab_size:
        raise error(f"Token id {bad} is out of vocabulary", param)
    return list(ids)


class CompletionPrompts:
    """The prompts of a completions request -> token ids, one list per prompt."""

    def __init__(
        self, limits: PromptLimits, *, vocab_size: int, trust_request_mm_kwargs: bool
    ) -> None:
        self.limits = limits
        self.vocab_size = vocab_size
        self.trust_request_mm_kwargs = trust_request_mm_kwargs

    def request_ids(self, body: Mapping[str, Any]) -> list[TokenIds]:
        """All prompts of a completions request body, honouring add_special_tokens,
        truncate_prompt_tokens, truncation_side and cache_salt validation."""
        if not isinstance(body, Mapping):
            raise error("the request body must be a JSON object")
        validate_cache_salt(body.get("cache_salt"))
        check_mm_kwargs(body, self.trust_request_mm_kwargs)
        if body.get("suffix") is not None:
            raise error(
                "suffix is only supported for models with FIM completion rendering", "suffix"
            )
        return self.batch_ids(
            body.get("prompt"), bool_field(body, "add_special_tokens", True), body
        )

    def batch_ids(
        self, prompt: Any, add_special_tokens: bool, body: Mapping[str, Any] | None
    ) -> list[TokenIds]:
        """Token ids of each prompt: a string or a list of ints is one prompt; a list of
        strings / of int lists is several. ``body`` supplies truncate_prompt_tokens /
        truncation_side / max_tokens."""
        trunc = Truncation(body or {}, chat=False)
        if prompt is None or prompt == "":
            raise error("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        if isinstance(prompt, str):
            return [self.limits.tokenize_text(prompt, add_special_tokens, trunc, "prompt")]
        if not isinstance(prompt, list):
            raise error(
                "prompt must be a string, a list of strings, a list of token ids or "
                "a list of token-id lists",
                "prompt",
            )
        if not prompt:
            raise error("You must pass at least one prompt", "prompt")
        as_ids = self.token_ids(prompt)
        if as_ids is not None:
            return [self.limits.post_tokenize(as_ids, trunc, "prompt")]
        if len(prompt) > MAX_COMPLETION_PROMPTS:
            raise error(
                f"prompt list length {len(prompt)} exceeds the maximum allowed count "
                f"of {MAX_COMPLETION_PROMPTS}.",
                "prompt",
            )
        if all(isinstance(p, str) for p in prompt):
            total = sum(len(p) for p in prompt)
            if total > self.limits.max_prompt_chars:
                raise self.limits.too_long(total)
            return [
                self.limits.tokenize_text(p, add_special_tokens, trunc, "prompt") for p in prompt
            ]
        if all(isinstance(p, list) for p in prompt):
            out = []
            for p in prompt:
                ids = self.token_ids(p) if p else []
                if ids is None:
                    raise error(
                        "each prompt must be a list of non-negative integer token ids", "prompt"
                    )
                out.append(self.limits.post_tokenize(ids, trunc, "prompt"))
            return out
        raise error(
            "prompt must be a string, a list of strings, a list of token ids or a "
            "list of token-id lists (not a mix)",
            "prompt",
        )

    def token_ids(self, prompt: list[Any]) -> list[int] | None:
        # Fast path for the common case, plain JSON integers in range: C-speed scans only.
        if (
            prompt
            and all(type(t) is int for t in prompt)
            and min(prompt) >= 0
            and max(prompt) < self.vocab_size
        ):
            return list(prompt)
        ids = []
        for t in prompt:
            v = as_token_id(t)
            if v is None:
                return None
            ids.append(v)
        if not ids:
            return None
        bad = next((v for v in ids if v < 0 or v >= self.vocab_size), None)
        if bad is not None:
            raise error(f"Token id {bad} is out of vocabulary", "prompt")
        return ids
