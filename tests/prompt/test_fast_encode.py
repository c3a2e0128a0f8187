"""The optional fast BPE (router/prompt/fast_encode.py) against Hugging Face ``tokenizers``,
the reference: exactly equal ids on a varied corpus, and a start-up self-check that refuses a
tokenizer that differs. Skipped when ``fastokens`` is not installed (the
``fast-tokenizer`` extra); the default suite needs only the reference."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from router.core.bundled import tokenizer_dir
from router.prompt import fast_encode
from router.prompt.fast_encode import (
    FAST,
    REFERENCE,
    agrees,
    fastokens_encoder,
    plain_encoder,
    reference_encoder,
    self_check_corpus,
)
from tests.prompt.common import renderer

pytest.importorskip("fastokens")
from tokenizers import Tokenizer  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data"
TOKENIZER_JSON = tokenizer_dir() / "tokenizer.json"


def _reference() -> Any:
    return Tokenizer.from_file(str(TOKENIZER_JSON))


def _strings(node: Any, out: list[str]) -> None:
    if isinstance(node, str):
        out.append(node)
    elif isinstance(node, dict):
        for v in node.values():
            _strings(v, out)
    elif isinstance(node, list):
        for v in node:
            _strings(v, out)


def corpus() -> list[str]:
    """Every string of the oracle cases, the seed documents whole and by paragraph, and a
    different seeded random mix than the start-up self-check's."""
    out: list[str] = []
    for name in ("oracle_cases.jsonl", "api_oracle_cases.jsonl"):
        for line in (DATA / name).read_text().splitlines():
            _strings(json.loads(line).get("body"), out)
    for path in sorted(DATA.glob("0*.txt")):
        text = path.read_text()
        out += [text, *text.split("\n\n")]
    out += self_check_corpus(n_random=1500, seed=1234)
    rng = random.Random(5)
    out += ["".join(chr(rng.randint(0x20, 0x2FFF)) for _ in range(200)) for _ in range(300)]
    return [s for s in out if s]


def test_fastokens_equals_tokenizers_on_the_corpus() -> None:
    reference = _reference()
    # The segment path never hands an added token (<|im_start|>, <think>, ...) to the BPE.
    added = [t.content for t in reference.get_added_tokens_decoder().values()]
    texts = [t for t in corpus() if not any(a in t for a in added)]
    assert len(texts) > 1500
    fast = fastokens_encoder(reference.to_str())(texts)
    want = reference_encoder(reference)(texts)
    differing = [t for t, a, b in zip(texts, fast, want, strict=True) if list(a) != list(b)]
    assert differing == []
    # and the reference path (encode_batch_fast) is the tokenizer's own encode
    whole = [reference.encode(t, add_special_tokens=False).ids for t in texts]
    assert [list(x) for x in want] == whole


def test_the_renderer_uses_fastokens_and_still_gives_the_oracle_ids() -> None:
    r = renderer(True)
    assert r._segments.encoder == FAST
    for line in (DATA / "oracle_cases.jsonl").read_text().splitlines():
        case = json.loads(line)
        body, want = case["body"], case["expected"].get("token_ids")
        if want is not None and "messages" in body:
            assert list(r.chat_ids(body)) == want, case["id"]


def test_a_tokenizer_that_differs_fails_the_self_check() -> None:
    # The same tokenizer.json without its NFC normalizer: a real tokenizer that differs on
    # decomposed text (e + U+0301), which the self-check corpus holds.
    spec = json.loads(TOKENIZER_JSON.read_text())
    assert spec["normalizer"] == {"type": "NFC"}
    spec["normalizer"] = None
    changed = fastokens_encoder(json.dumps(spec))
    reference = reference_encoder(_reference())
    assert not agrees(changed, reference, self_check_corpus())
    assert agrees(fastokens_encoder(TOKENIZER_JSON.read_text()), reference, self_check_corpus())


def test_turned_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fast_encode.ENV, "0")
    _, name = plain_encoder(_reference())
    assert name == REFERENCE
    monkeypatch.setenv(fast_encode.ENV, "1")
    _, name = plain_encoder(_reference())
    assert name == FAST


def test_segments_over_the_fast_limit_are_cut_exactly_into_fast_pieces() -> None:
    """A new segment longer than FAST_MAX_CHARS is encoded by fastokens in pieces cut where
    whole-text BPE has a boundary too: the same ids as the reference's whole-text encode.
    Where no cut is near the limit, the piece runs to the next cut (the reference's then)."""
    from router.prompt.chunks import fast_pieces

    r = renderer(True)
    hook, reference = r._segments._encode_plain, _reference()
    assert hook is not None and hook.__qualname__.startswith("cut_long")  # the cutting hook
    rng = random.Random(5)
    corp = self_check_corpus(200, seed=9)
    texts = [
        " ".join(rng.choice(corp) for _ in range(900)),  # every script, whitespace runs
        " ".join(rng.choice(["refund", "policy", "it's", "café"]) for _ in range(9000)),
        "人工智能正在改变世界。" * 3000,  # cut before CJK punctuation
        "x" * 20_000 + " tail end",  # no cut near the limit: one long piece
        ("word " * 600 + "\n\n") * 12,
    ]
    for text in texts:
        pieces = fast_pieces(text)
        assert "".join(pieces) == text and len(pieces) > 1
        assert list(hook([text])[0]) == reference.encode(text, add_special_tokens=False).ids
    prose = fast_pieces(texts[1])
    assert len(prose) >= 4 and all(len(p) <= fast_encode.FAST_MAX_CHARS for p in prose)
