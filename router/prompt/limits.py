"""vLLM's TokenizeParams: the checks and truncation between a prompt and its token ids
(context length, ``truncate_prompt_tokens`` / ``truncation_side``, the character budget)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from router.core.errors import APIError
from router.prompt.fields import TokenIds, as_token_id, error, prompt_too_long

DEFAULT_MAX_PROMPT_CHARS = 4_000_000
"""Largest rendered prompt (characters) accepted; longer ones are a 400, not minutes of CPU."""


class Truncation:
    """vLLM's TokenizeParams, restricted to what changes or rejects prompt ids."""

    __slots__ = ("max_output_tokens", "side", "tokens")

    def __init__(self, body: Mapping[str, Any], *, chat: bool) -> None:
        tokens = body.get("truncate_prompt_tokens")
        if tokens is not None and (as_token_id(tokens) is None or tokens < -1):
            raise error(
                "'truncate_prompt_tokens' must be an integer >= -1", "truncate_prompt_tokens"
            )
        side = body.get("truncation_side")
        if side not in (None, "left", "right"):
            raise error("`truncation_side` must be either 'left' or 'right'.", "truncation_side")
        self.tokens: int | None = None if tokens is None else int(tokens)
        self.side: str | None = side
        if chat:
            mct = body.get("max_completion_tokens")
            self.max_output_tokens: int | None = mct if mct is not None else body.get("max_tokens")
        else:
            self.max_output_tokens = body.get("max_tokens", 16) or 0


class PromptLimits:
    """Text -> checked, truncated token ids, for one model (``encode`` is the tokenizer's,
    through the segment cache)."""

    def __init__(
        self,
        tokenizer: Any,
        encode: Callable[[str, bool], TokenIds],
        *,
        max_prompt_chars: int,
        max_model_len: int | None,
        truncation_side: str,
    ) -> None:
        self.tokenizer = tokenizer
        self._encode = encode
        self.max_prompt_chars = max_prompt_chars
        self.max_model_len = max_model_len
        self.truncation_side = truncation_side
        self._max_chars: int | None = None  # longest token string, computed on first use

    def too_long(self, n: int | None = None) -> APIError:
        return prompt_too_long(self.max_prompt_chars, n)

    def tokenize_text(
        self,
        text: str,
        add_special_tokens: bool,
        trunc: Truncation,
        param: str,
        encode: Callable[[str, bool], TokenIds] | None = None,
    ) -> TokenIds:
        """``text``'s ids, checked and truncated; ``encode``: instead of the tokenizer's
        (a chat prompt's prefix-state path)."""
        max_len = self.max_model_len
        if (
            max_len is not None
            and trunc.tokens is None
            and len(text) > max_len * self._max_chars_per_token()
        ):
            raise error(
                f"This model's maximum context length is {max_len} tokens. However, "
                f"your prompt contains {len(text)} characters.",
                "input_text",
            )
        if len(text) > self.max_prompt_chars:
            raise self.too_long(len(text))
        ids = (encode or self._encode)(text, add_special_tokens)
        if add_special_tokens and trunc.tokens is not None:
            ids = self._truncate_text_only(text, ids, trunc)
        return self.post_tokenize(ids, trunc, param)

    def _truncate_text_only(self, text: str, ids: TokenIds, trunc: Truncation) -> TokenIds:
        """Hugging Face truncates the text's tokens and then adds the special ones (a BOS
        stays when the left is cut): what vLLM's ``truncation=True, max_length=`` gives."""
        keep = self._keep(trunc)
        if keep is None or keep >= len(ids):
            return ids
        plain = list(self._encode(text, False))
        n, specials = len(plain), len(ids) - len(plain)
        at = next((i for i in range(specials + 1) if list(ids[i : i + n]) == plain), None)
        if at is None or specials <= 0:
            return ids
        room = max(0, keep - specials)
        side = trunc.side or self.truncation_side
        body = [] if room == 0 else (plain[-room:] if side == "left" else plain[:room])
        return [*ids[:at], *body, *ids[at + n :]]

    def _keep(self, trunc: Truncation) -> int | None:
        """``truncate_prompt_tokens`` resolved (-1: the context less one output token)."""
        keep, max_len = trunc.tokens, self.max_model_len
        if keep is not None and keep < 0:
            return (
                None
                if max_len is None
                else (max_len if trunc.max_output_tokens == 0 else max(0, max_len - 1))
            )
        return keep

    def _max_chars_per_token(self) -> int:
        """vLLM's ``max_chars_per_token``: the longest token string in the vocabulary."""
        if self._max_chars is None:
            vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
            self._max_chars = max((len(t) for t in vocab), default=1)
        return self._max_chars

    def post_tokenize(self, ids: TokenIds, trunc: Truncation, param: str) -> TokenIds:
        max_len = self.max_model_len
        keep = trunc.tokens
        out_tokens = trunc.max_output_tokens
        if max_len is not None and isinstance(out_tokens, int) and out_tokens > max_len:
            raise error(
                f"max_tokens={out_tokens} cannot be greater than max_model_len={max_len}. "
                "Please request fewer output tokens.",
                "max_tokens",
            )
        if max_len is not None and keep is not None and keep > max_len:
            raise error(
                f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = "
                f"{max_len}. Please request a smaller truncation size.",
                "truncate_prompt_tokens",
            )
        keep = self._keep(trunc)
        if keep is not None and keep < len(ids):
            side = trunc.side or self.truncation_side
            ids = [] if keep == 0 else (ids[-keep:] if side == "left" else ids[:keep])
        if max_len is not None and len(ids) > max_len:
            raise error(
                f"This model's maximum context length is {max_len} tokens. However, "
                f"your prompt contains {len(ids)} input tokens.",
                "input_tokens",
            )
        if not ids:
            raise error("No token_ids rendered", param)
        return ids
