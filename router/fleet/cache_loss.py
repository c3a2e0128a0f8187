"""When to believe that a replica lost its prefix cache behind the gateway's back (a restart,
a cache reset) and forget everything the index says it holds.

One request reporting no cached tokens where the index predicted some is not enough: a
tenant could send those at will (vLLM skips the cache read for prompt logprobs, and whatever
else makes a replica miss) and wipe what every other tenant's routing knew about that
replica. A reset needs consistent evidence: misses of ``REPORTS`` different prompts within
``WINDOW_S``; with auth on, from at least two tenants, or from one over at least ``SPAN_S``
seconds. (With auth off every client is trusted and tenants name themselves.) A replica that
truly lost its cache misses on every prompt it held, so this comes quickly under real
traffic; until it does, a stale prefix costs one misrouted request and is recorded again
where it went.
"""

from __future__ import annotations

from dataclasses import dataclass, field

REPORTS = 3  # misses of different prompts before a reset
SPAN_S = 10.0  # ... from one tenant, at least this far apart (first to last)
WINDOW_S = 120.0  # misses older than this are forgotten


@dataclass
class LostCache:
    """One replica's recent misses where the index predicted a hit. ``tenants_apart``: one
    tenant's misses count only over ``SPAN_S`` (auth on)."""

    tenants_apart: bool = True
    misses: list[tuple[float, str, int]] = field(default_factory=list)  # (when, tenant, prompt)

    def miss(self, now: float, tenant: str, prompt: int) -> bool:
        """A miss where a hit was predicted (``prompt``: the prompt's last block hash); True
        when the evidence now says the cache is gone (and it starts over)."""
        self.misses = [m for m in self.misses if now - m[0] <= WINDOW_S and m[2] != prompt]
        self.misses.append((now, tenant, prompt))
        if len(self.misses) < REPORTS:
            return False
        tenants = {m[1] for m in self.misses}
        if self.tenants_apart and len(tenants) < 2 and now - self.misses[0][0] < SPAN_S:
            return False
        self.misses.clear()
        return True
