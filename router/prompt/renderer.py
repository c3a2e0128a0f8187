"""``Renderer``: prompt -> token ids for one model, as vLLM 0.34.0 renders and tokenizes them.

A facade over the stages, each in its own module: ``normalize`` (the chat body -> the
template's inputs), ``template`` (rendering them), ``limits`` (truncation and length checks),
``segments`` (the segment-cache tokenizer) and ``completion`` (completions prompts).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import router.prompt.lazy as lazy
import router.prompt.scope as scope
from router.prompt.completion import CompletionPrompts, reused_prompt_token_ids
from router.prompt.fast_encode import FAST, FAST_MAX_CHARS
from router.prompt.fields import TokenIds, as_list, plain, text_size
from router.prompt.jinja import ContentFormat
from router.prompt.limits import DEFAULT_MAX_PROMPT_CHARS, PromptLimits, Truncation
from router.prompt.normalize import ChatNormalizer
from router.prompt.prefix_state import (
    DEFAULT_PREFIX_STATE_TOKENS,
    PrefixState,
    PrefixStates,
    PromptIds,
    message_keys,
)
from router.prompt.segments import DEFAULT_SEGMENT_CACHE_TOKENS, SegmentTokenizer
from router.prompt.template import ChatTemplate


class Renderer:
    """Renders and tokenizes requests for one model's tokenizer, as vLLM 0.34.0 does.

    ``tokenize_chat(body)`` and ``tokenize_completion_request(body)`` are the live path;
    ``segment_cache=False`` gives the plain whole-prompt path (what the simulated replica uses).

    Options:
      segment_cache_tokens: token budget of the segment LRU.
      max_prompt_chars: the ``token_budget`` guard; a rendered prompt (or completions string)
        longer than this is a 400.
      max_model_len: when set, enforce vLLM's context-length checks and resolve
        ``truncate_prompt_tokens=-1`` (vLLM: the replica's ``--max-model-len``). None: do not
        enforce (the replica will) and treat -1 as no truncation.
      vocab_size: token ids given in a completions prompt must be < this (default: the
        tokenizer's length; vLLM accepts up to the model's vocab size, 151936 for Qwen3).
      chat_template: a server-side ``--chat-template`` override (template text).
      content_format: "string" / "openai" / None (detect from the template, as vLLM does;
        Qwen3 is "string", the only format checked against the oracle).
      truncation_side: default side of ``truncate_prompt_tokens`` (vLLM: "left").
      default_chat_template_kwargs: the replicas' ``--default-chat-template-kwargs``.
      trust_request_mm_kwargs: the replicas' ``--trust-request-mm-kwargs``.

    ``self.segment_cache`` is True when the fast path is in use (requested and safe for this
    tokenizer); ``cache_info()`` has its counters. The options are fixed at construction (the
    stages hold them), so their attributes here are read-only.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        segment_cache: bool = True,
        segment_cache_tokens: int = DEFAULT_SEGMENT_CACHE_TOKENS,
        max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
        max_model_len: int | None = None,
        vocab_size: int | None = None,
        chat_template: str | None = None,
        content_format: ContentFormat | None = None,
        truncation_side: str = "left",
        default_chat_template_kwargs: Mapping[str, Any] | None = None,
        trust_request_mm_kwargs: bool = False,
        prefix_state: bool = True,
        prefix_state_tokens: int = DEFAULT_PREFIX_STATE_TOKENS,
    ) -> None:
        self.tokenizer = tokenizer
        special_map = getattr(tokenizer, "special_tokens_map", None) or {}
        self._template = ChatTemplate(
            chat_template
            if chat_template is not None
            else getattr(tokenizer, "chat_template", None),
            content_format,
        )
        self._normalizer = ChatNormalizer(
            self._template,
            max_prompt_chars=int(max_prompt_chars),
            default_chat_template_kwargs=plain(dict(default_chat_template_kwargs or {})),
            special_tokens_map={k: plain(v) for k, v in dict(special_map).items() if v is not None},
            trust_request_mm_kwargs=trust_request_mm_kwargs,
        )
        self._segments = SegmentTokenizer(
            tokenizer, segment_cache=segment_cache, max_tokens=segment_cache_tokens
        )
        # vLLM loads generation tokenizers with truncation_side="left"
        # (vllm/tokenizers/registry.py); it is the default side for truncate_prompt_tokens.
        self._limits = PromptLimits(
            tokenizer,
            self._segments.encode,
            max_prompt_chars=int(max_prompt_chars),
            max_model_len=max_model_len,
            truncation_side=truncation_side,
        )
        # A chat prompt that extends one seen before tokenizes only its new part
        # (router/prompt/prefix_state.py): only on the segment path, whose cuts at added
        # tokens make it exact, and only if no added token holds another one.
        self._prefix: PrefixStates | None = None
        if prefix_state and self._segments.enabled and not self._segments.contained_added():
            self._prefix = PrefixStates(prefix_state_tokens)
        self._lazy_reason: str | None = None  # why lazy heads are off ("" = on); on first use
        self._completions = CompletionPrompts(
            self._limits,
            vocab_size=int(vocab_size) if vocab_size is not None else len(tokenizer),
            trust_request_mm_kwargs=trust_request_mm_kwargs,
        )

    @classmethod
    def from_pretrained(cls, name_or_path: str, **kwargs: Any) -> Renderer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(name_or_path), **kwargs)

    # ------------------------------------------------ configuration (read-only after init)
    @property
    def default_chat_template_kwargs(self) -> Mapping[str, Any]:
        return self._normalizer.default_chat_template_kwargs

    @property
    def trust_request_mm_kwargs(self) -> bool:
        return self._normalizer.trust_request_mm_kwargs

    @property
    def max_prompt_chars(self) -> int:
        return self._limits.max_prompt_chars

    def max_chars_per_token(self) -> int:
        """The longest token string in the vocabulary (vLLM's ``max_chars_per_token``): a
        text of n characters is at least n / this many tokens. Scans the vocabulary once."""
        return self._limits._max_chars_per_token()

    @property
    def max_model_len(self) -> int | None:
        return self._limits.max_model_len

    @property
    def truncation_side(self) -> str:
        return self._limits.truncation_side

    @property
    def vocab_size(self) -> int:
        return self._completions.vocab_size

    # ------------------------------------------------------------------------------ chat
    def normalize_chat(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The inputs vLLM hands the chat template for this body: ``{"conversation",
        "tools", "template_kwargs", "add_generation_prompt", "continue_final_message",
        "add_special_tokens"}``. Raises APIError(400) on what vLLM rejects."""
        return self._normalizer.normalize(body)

    def render_chat(self, body: dict[str, Any]) -> str:
        """The prompt string vLLM renders for an OpenAI chat request body."""
        return self._render(self.normalize_chat(body))

    def _render(self, norm: dict[str, Any]) -> str:
        return self._template.render(norm, self.max_prompt_chars)

    def tokenize_chat(self, body: dict[str, Any]) -> list[int]:
        """vLLM's prompt token ids for an OpenAI chat request body."""
        return as_list(self.chat_ids(body))

    def chat_ids(self, body: dict[str, Any]) -> TokenIds:
        """``tokenize_chat`` as the gateway wants it: an ``array('I')`` on the segment-cache
        path (a list of 4,000 Python ints costs ~0.1 ms to build and as much to pack)."""
        norm = self.normalize_chat(body)
        reused = reused_prompt_token_ids(body, self.vocab_size)
        if reused is not None:
            return reused
        text = self._render(norm)
        trunc = Truncation(body, chat=True)
        return self._chat_tokens(norm, text, trunc, self._prefix_lookup(norm, text))

    def _chat_tokens(
        self,
        norm: dict[str, Any],
        text: str,
        trunc: Truncation,
        found: tuple[list[int], PrefixState | None] | None,
    ) -> TokenIds:
        add_special = norm["add_special_tokens"]
        if found is None:
            return self._limits.tokenize_text(text, add_special, trunc, "messages")
        keys, state = found

        def encode(text: str, _add_special: bool) -> TokenIds:
            return self._prefix_ids(norm, text, keys, state)

        return self._limits.tokenize_text(text, add_special, trunc, "messages", encode)

    def _prefix_lookup(
        self, norm: dict[str, Any], text: str
    ) -> tuple[list[int], PrefixState | None] | None:
        """The prompt's message keys and the prefix state it extends (None: none held), or
        None when the prefix-state path does not apply (off, or not the segment path)."""
        states = self._prefix
        if states is None or not self._segments.split_path(norm["add_special_tokens"]):
            return None
        keys = message_keys(norm, scope.current_scope())
        return keys, states.find(keys, text)

    def _prefix_ids(
        self, norm: dict[str, Any], text: str, keys: list[int], state: PrefixState | None
    ) -> PromptIds:
        """``text``'s ids: ``state``'s, then the rest's through the segment path; stores the
        states later requests can extend (see router/prompt/prefix_state.py)."""
        assert self._prefix is not None
        seg = self._segments
        cuts: list[tuple[int, int]] = []
        ids = PromptIds("I")
        base_chars = 0
        if state is not None:
            ids.extend(state.ids)
            base_chars = state.chars
        base_tokens = len(ids)
        seg.encode_cuts(text, cuts, ids, base_chars)
        ids.prefix = state
        stored: list[PrefixState] = []
        if cuts:  # the whole prompt up to its last added token: the next turn extends it
            chars, tokens = cuts[-1]
            new = self._prefix.store(keys[-1], text, base_chars + chars, ids, base_tokens + tokens)
            if new is not None:
                stored.append(new)
        last = norm["conversation"][-1].get("content")
        if cuts and len(keys) > 2 and isinstance(last, str) and last:
            # Up to the last message: another last message after the same ones extends it.
            # Where its text first appears (at or before where it is rendered) is early
            # enough: any cut after an added token is exact, this one only has to precede
            # what depends on the last message. A short needle: rfind of the whole text
            # cost ~100k instructions.
            at = text.find(last[:64], base_chars) - base_chars
            before = [c for c in cuts if c[0] <= at]
            if at >= 0 and before:
                chars, tokens = before[-1]
                new = self._prefix.store(
                    keys[-2], text, base_chars + chars, ids, base_tokens + tokens
                )
                if new is not None:
                    stored.append(new)
        ids.stored = tuple(stored)
        return ids

    def chat_head(
        self, body: dict[str, Any], block_size: int, min_rest_chars: int = 0
    ) -> TokenIds | lazy.Head:
        """``chat_ids(body)``, or when that would BPE-encode new text and can be done in two
        steps exactly, a ``lazy.Head``: the ids up to a few blocks into the first new
        segment now, the rest from ``Head.finish()``. Same checks and errors as ``chat_ids``.
        Not lazy where the whole count matters before routing: truncation, a context length
        to enforce, token ids given in the request, or a tokenizer ``lazy`` cannot cut."""
        norm = self.normalize_chat(body)
        reused = reused_prompt_token_ids(body, self.vocab_size)
        if reused is not None:
            return reused
        text = self._render(norm)
        trunc = Truncation(body, chat=True)
        found = self._prefix_lookup(norm, text)
        # A head is worth taking only past ``min_rest_chars`` of text no cache holds.
        known = found[1].chars if found is not None and found[1] is not None else 0
        if (
            len(text) - known > min_rest_chars
            and self._lazy_ok()
            and trunc.tokens is None
            and self.max_model_len is None
            and len(text) <= self.max_prompt_chars
            and self._segments.split_path(norm["add_special_tokens"])
        ):
            got = lazy.head(self._segments, text, block_size, min_rest_chars)
            if got is not None and got.ids:
                return got
        return self._chat_tokens(norm, text, trunc, found)

    def _lazy_ok(self) -> bool:
        if self._lazy_reason is None:
            backend = self._segments.backend
            self._lazy_reason = "" if backend is None else (lazy.cut_rule(backend) or "")
            if backend is None:
                self._lazy_reason = "not a fast tokenizer"
        return self._lazy_reason == ""

    async def tokenize_chat_async(
        self, body: dict[str, Any], *, inline_below_chars: int = 16384
    ) -> list[int]:
        """``tokenize_chat`` off the event loop when the body's text is long (a thread hop
        costs more than tokenizing a short prompt)."""
        if text_size(body.get("messages"), inline_below_chars) < inline_below_chars:
            return self.tokenize_chat(body)
        return await asyncio.to_thread(self.tokenize_chat, body)

    # ----------------------------------------------------------------------- completions
    def tokenize_completion_batch(
        self, prompt: Any, *, add_special_tokens: bool = True, body: Mapping[str, Any] | None = None
    ) -> list[list[int]]:
        """Token ids of each prompt of a completions request, as vLLM's prompt_to_seq sees it:
        a string or a list of ints is one prompt; a list of strings / of int lists is several.
        ``body`` supplies truncate_prompt_tokens / truncation_side / max_tokens."""
        return [
            as_list(ids) for ids in self._completions.batch_ids(prompt, add_special_tokens, body)
        ]

    def tokenize_completion(self, prompt: str | Sequence[int] | Sequence[Any]) -> list[int]:
        """Token ids of a completions prompt. With several prompts (a list of strings or of
        id lists) this is the FIRST one's ids - what the router routes on; use
        ``tokenize_completion_batch`` for all of them."""
        return self.tokenize_completion_batch(
            list(prompt) if isinstance(prompt, tuple) else prompt
        )[0]

    def tokenize_completion_request(self, body: Mapping[str, Any]) -> list[list[int]]:
        """All prompts of a completions request body, honouring add_special_tokens,
        truncate_prompt_tokens, truncation_side and cache_salt validation."""
        return [as_list(ids) for ids in self.completion_request_ids(body)]

    def completion_request_ids(self, body: Mapping[str, Any]) -> list[TokenIds]:
        """``tokenize_completion_request`` with arrays where they are cheaper (``chat_ids``)."""
        return self._completions.request_ids(body)

    # ------------------------------------------------------------------------ tokenizing
    @property
    def fast_encoder(self) -> bool:
        """Whether new text is BPE-encoded by fastokens (router/prompt/fast_encode.py)."""
        return self._segments.encoder == FAST

    def loop_encode_chars(self, reference_chars: int) -> int:
        """How much new text an event loop may BPE-encode in place: ``reference_chars`` with
        Hugging Face's encoder, which releases the GIL, so a worker thread lets the loop run
        meanwhile; FAST_MAX_CHARS with fastokens, which holds it, so below its cutoff a
        thread stalls the loop as long and only adds the hand-off."""
        if self.fast_encoder:
            return max(reference_chars, FAST_MAX_CHARS)
        return reference_chars

    def inline(self, max_uncached_chars: int) -> contextlib.AbstractContextManager[None]:
        """Within this block, tokenizing raises ``NeedsThread`` instead of BPE-encoding more
        than ``max_uncached_chars`` of uncached text, so an event loop can tokenize a cached
        prompt in place (microseconds) and hand only real work to a thread."""
        return scope.inline(max_uncached_chars)

    def cache_scope(self, cache_salt: str | None) -> contextlib.AbstractContextManager[None]:
        """Within this block, segment-cache entries are those of the ``cache_salt`` scope:
        text cached under another salt is a miss here, exactly as on a replica."""
        return scope.cache_scope(cache_salt)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """``tokenizer.encode(text, add_special_tokens=...)``, through the segment cache when
        it is on and provably equivalent."""
        return as_list(self._segments.encode(text, add_special_tokens))

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids)))

    # --------------------------------------------------------------------- segment cache
    @property
    def segment_cache(self) -> bool:
        """True when the fast path is in use (requested and safe for this tokenizer)."""
        return self._segments.enabled

    @property
    def segment_cache_requested(self) -> bool:
        return self._segments.requested

    @property
    def segment_cache_tokens(self) -> int:
        return self._segments.max_tokens

    @property
    def cache_hits(self) -> int:
        return self._segments.hits

    @property
    def cache_misses(self) -> int:
        return self._segments.misses

    @property
    def _cache(self) -> Mapping[int, Sequence[int]]:
        return self._segments.cache

    def cache_info(self) -> dict[str, int]:
        """Segment-cache counters (entries, cached tokens, budget, hits, misses)."""
        return self._segments.info()

    def clear_cache(self) -> None:
        self._segments.clear()
        if self._prefix is not None:
            self._prefix.clear()

    # ---------------------------------------------------------------------- prefix states
    @property
    def prefix_state(self) -> bool:
        """True when chat prompts go through the prefix-state cache."""
        return self._prefix is not None

    def prefix_info(self) -> dict[str, int]:
        """Prefix-state counters (entries, tokens, hits, misses, rejected); {} when off."""
        return self._prefix.info() if self._prefix is not None else {}
