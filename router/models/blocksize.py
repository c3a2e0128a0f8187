"""A model's block size from what its replicas report, checked against what was configured.

vLLM reports its block size in ``vllm:cache_config_info``; the gateway must hash with the very
same one or every prediction is off by the ratio. A configured size that contradicts the
replicas is refused (one line naming both); replicas of one model that disagree among
themselves (block size or root) are split into groups: the largest is routed to, the others
are named in one warning and kept apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


class BlockSizeRefused(Exception):
    """A configured block size the replicas contradict (the message is the one line)."""


@dataclass(frozen=True)
class Groups:
    block_size: int | None  # the primary group's, None when no replica reported one
    root: str | None
    primary: tuple[str, ...]  # replica URLs routed to
    apart: tuple[str, ...]  # replicas kept apart (another block size or root)
    warning: str | None  # the one line naming the disagreement


def group(model: str, reported: Mapping[str, tuple[str | None, int | None]]) -> Groups:
    """Split ``model``'s replicas (url -> (root, block size)) by what they report. A replica
    that has not reported a block size yet joins the group of its root."""
    keyed: dict[tuple[str | None, int | None], list[str]] = {}
    for url, key in sorted(reported.items()):
        keyed.setdefault(key, []).append(url)
    known = {k: v for k, v in keyed.items() if k[1] is not None}
    if not known:
        roots = sorted(keyed, key=lambda k: (-len(keyed[k]), str(k[0])))
        root = roots[0][0] if roots else None
        same = tuple(u for k in keyed if k[0] == root for u in keyed[k])
        apart = tuple(u for k in keyed if k[0] != root for u in keyed[k])
        return Groups(None, root, same, apart, _warn(model, keyed) if apart else None)
    # The primary group: most replicas, then the smaller block size, then the root's name.
    best = min(known, key=lambda k: (-len(known[k]), k[1] or 0, str(k[0])))
    primary = list(known[best]) + [
        u for k, us in keyed.items() if k[1] is None and k[0] == best[0] for u in us
    ]
    apart = tuple(sorted(u for us in keyed.values() for u in us if u not in primary))
    return Groups(
        best[1], best[0], tuple(sorted(primary)), apart, _warn(model, keyed) if apart else None
    )


def _warn(model: str, keyed: Mapping[tuple[str | None, int | None], list[str]]) -> str:
    desc = "; ".join(
        f"root {root or '?'} block size {bs if bs is not None else '?'}: {', '.join(urls)}"
        for (root, bs), urls in sorted(keyed.items(), key=lambda kv: (-len(kv[1]), str(kv[0])))
    )
    return (
        f"model {model}: its replicas disagree ({desc}); routing to the first group only, "
        "the others are kept apart until they agree"
    )


def check_configured(
    model: str, configured: int | None, where: str, reported: Mapping[str, int | None]
) -> None:
    """Refuse a configured block size that a replica of ``model`` contradicts."""
    if configured is None:
        return
    wrong = {url: bs for url, bs in sorted(reported.items()) if bs is not None and bs != configured}
    if wrong:
        sizes = sorted(set(wrong.values()))
        raise BlockSizeRefused(
            f"{where} {configured} contradicts the replicas of model {model}, which report "
            f"block size {', '.join(map(str, sizes))} in vllm:cache_config_info "
            f"({', '.join(wrong)}); remove it or make it {sizes[0]}"
        )
