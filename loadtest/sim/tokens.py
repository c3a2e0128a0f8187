"""The simulator's tokenizers: one ``Renderer`` per tokenizer per process, shared by every
replica in it, and the vocabulary of words the replicas answer with."""

from __future__ import annotations

import random
import threading
from array import array
from collections.abc import Sequence
from pathlib import Path

import xxhash

from loadtest.sim.config import DEFAULT_TOKENIZER
from loadtest.sim.vllm_chat import VllmChat, load_chat_template, load_tokenizer
from router.prompt import Renderer

_RENDERERS: dict[tuple[str, str | None], Renderer] = {}
_CHATS: dict[tuple[str, str | None], VllmChat] = {}
_WORDS: dict[int, tuple[Renderer, Words]] = {}
_LOAD_LOCK = threading.Lock()


def _key(tokenizer: str, chat_template: str | None) -> tuple[str, str | None]:
    p = Path(tokenizer)
    return (str(p.resolve()) if p.exists() else tokenizer, chat_template)


def get_vllm_chat(tokenizer: str = DEFAULT_TOKENIZER, chat_template: str | None = None) -> VllmChat:
    """The replica's own chat rendering (loadtest/sim/vllm_chat.py): its tokenizer loaded as
    vLLM loads it, one per tokenizer and ``--chat-template`` per process."""
    key = _key(tokenizer, chat_template)
    c = _CHATS.get(key)
    if c is None:
        with _LOAD_LOCK:
            c = _CHATS.get(key)
            if c is None:
                c = VllmChat(load_tokenizer(key[0]), load_chat_template(chat_template))
                _CHATS[key] = c
    return c


def get_renderer(tokenizer: str = DEFAULT_TOKENIZER, chat_template: str | None = None) -> Renderer:
    """One ``Renderer`` per tokenizer per process (loading one costs seconds): what the
    simulator validates requests with, and renders the bodies ``VllmChat`` leaves to it."""
    key = _key(tokenizer, chat_template)
    r = _RENDERERS.get(key)
    if r is not None:
        return r
    with _LOAD_LOCK:
        r = _RENDERERS.get(key)
        if r is None:
            r = Renderer(
                load_tokenizer(key[0]),
                segment_cache=False,
                chat_template=load_chat_template(chat_template),
            )
            _RENDERERS[key] = r
    return r


class Words:
    """Output tokens: ordinary lower-case words (``" word"`` pieces) that round-trip through
    the tokenizer, so an answer sent back as the next turn's history re-tokenizes to the very
    ids that were generated and cached."""

    def __init__(self, renderer: Renderer) -> None:
        tok = renderer.tokenizer
        vocab: dict[str, int] = tok.get_vocab()
        self.max_token_id = max(max(vocab.values()), len(tok) - 1)
        ids: list[int] = []
        for marker in ("\u0120", "\u2581"):  # byte-level BPE "Ġ", sentencepiece "▁"
            cands = sorted(
                i
                for piece, i in vocab.items()
                if piece.startswith(marker)
                and 3 <= len(piece) - 1 <= 10
                and piece[1:].isascii()
                and piece[1:].isalpha()
                and piece[1:].islower()
            )
            ids = self._verified(renderer, cands[:3000])
            if len(ids) >= 64:
                break
        if len(ids) < 16:  # an unusual tokenizer: any ids that decode to something visible
            ids = [
                i
                for i in range(min(1000, self.max_token_id), min(3000, self.max_token_id))
                if renderer.decode([i]).strip()
            ][:1024] or [0]
        self.ids = ids[:1024]
        self.text = {i: renderer.decode([i]) for i in self.ids}

    @staticmethod
    def _verified(renderer: Renderer, cands: list[int]) -> list[int]:
        if not cands:
            return []
        tok = renderer.tokenizer
        texts = [renderer.decode([i]) for i in cands]
        encoded = tok(texts, add_special_tokens=False)["input_ids"]
        return [
            i
            for i, t, e in zip(cands, texts, encoded, strict=True)
            if list(e) == [i] and t.startswith(" ") and t[1:].isalpha()
        ]

    def sample(self, seed: int, prompt_ids: Sequence[int], n: int) -> list[int]:
        key = array("q", prompt_ids).tobytes()
        rng = random.Random(hash_seed(seed, key))
        return rng.choices(self.ids, k=n)


def hash_seed(seed: int, data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data, seed=seed & 0xFFFFFFFFFFFFFFFF)


def get_words(renderer: Renderer) -> Words:
    entry = _WORDS.get(id(renderer))
    if entry is not None and entry[0] is renderer:
        return entry[1]
    with _LOAD_LOCK:
        entry = _WORDS.get(id(renderer))
        if entry is None or entry[0] is not renderer:
            entry = (renderer, Words(renderer))
            _WORDS[id(renderer)] = entry
    return entry[1]
