"""Deterministic filler text for the synthetic workloads: sentences, paragraphs, questions
and tool definitions drawn from small word lists with a seeded RNG (about 1.1-1.3 Qwen3 tokens
a word), shared by ``loadtest.workloads`` and ``loadtest.agentic``."""

from __future__ import annotations

import random
from typing import Any


def rng(seed: int, *parts: object) -> random.Random:
    return random.Random(":".join(str(p) for p in (seed, *parts)))


def wordlist(text: str) -> tuple[str, ...]:
    return tuple(text.split())


WORDS = wordlist(
    "account access action address agent alert answer api application archive audit backup "
    "balance batch billing branch budget buffer build cache calendar capacity card catalog "
    "change channel check claim client cluster code comment config contract cost credit "
    "customer dashboard data database date deadline delivery deploy device discount document "
    "domain draft email endpoint error event export feature feedback field file filter folder "
    "format gateway group guide history host import incident index invoice issue item job key "
    "label latency layer ledger license limit link list load log manager memory message "
    "metric migration model module monitor network node note notice order owner package page "
    "partner password payment period permission plan platform policy pool portal price "
    "priority process product profile project queue quota record refund region release "
    "replica report request resource response review role route rule schedule schema search "
    "secret section server service session setting shipment signal snapshot source status "
    "storage stream subscription summary support system table task team template tenant "
    "ticket token topic trace transfer update upgrade usage user value vendor version volume "
    "warehouse webhook window workflow zone"
)
VERBS = wordlist(
    "check update review explain compare list find cancel restore move verify create delete "
    "summarise export rename schedule approve reject escalate track refund merge"
)
ADJ = wordlist(
    "current previous pending active archived monthly weekly annual primary secondary shared "
    "private public recent overdue failed successful default custom regional"
)
NAMES = wordlist(
    "Alice Bruno Chen Dana Emeka Farah Goran Hana Ivan Jia Kofi Lena Mateo Nadia Omar Priya "
    "Quinn Rosa Sven Tariq Uma Viktor Wen Xavier Yara Zoe"
)
COMPANIES = wordlist(
    "Acme Globex Initech Umbrella Hooli Vandelay Stark Wayne Tyrell Cyberdyne Soylent "
    "Aperture Wonka Gringotts Oscorp Monarch"
)


def sentence(rng: random.Random, n_words: int) -> str:
    words = []
    for i in range(max(3, n_words)):
        pool = WORDS if i % 3 else (VERBS if i % 2 == 0 else ADJ)
        words.append(rng.choice(pool))
    return words[0].capitalize() + " " + " ".join(words[1:]) + "."


def paragraphs(rng: random.Random, n_words: int) -> str:
    """About ``n_words`` words of deterministic filler prose (roughly 1.1-1.3 Qwen3 tokens per
    word), in paragraphs of a few sentences."""
    out: list[str] = []
    para: list[str] = []
    total = 0
    while total < n_words:
        k = rng.randint(8, 18)
        para.append(sentence(rng, k))
        total += k
        if len(para) >= rng.randint(3, 6):
            out.append(" ".join(para))
            para = []
    if para:
        out.append(" ".join(para))
    return "\n\n".join(out)


def question(rng: random.Random, n_words: int) -> str:
    return f"Can you {rng.choice(VERBS)} the {rng.choice(ADJ)} {rng.choice(WORDS)}? " + (
        sentence(rng, n_words) if n_words > 6 else ""
    )


def tools(rng: random.Random, n_tools: int) -> list[dict[str, Any]]:
    tools = []
    for i in range(n_tools):
        verb, noun = VERBS[i % len(VERBS)], WORDS[(7 * i + 3) % len(WORDS)]
        props = {}
        for j in range(rng.randint(2, 5)):
            pname = f"{WORDS[(11 * i + 5 * j) % len(WORDS)]}_{j}"
            props[pname] = {
                "type": rng.choice(["string", "integer", "boolean"]),
                "description": sentence(rng, rng.randint(6, 14)),
            }
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": f"{verb}_{noun}",
                    "description": sentence(rng, rng.randint(12, 30)),
                    "parameters": {
                        "type": "object",
                        "properties": props,
                        "required": sorted(props)[:1],
                    },
                },
            }
        )
    return tools
