"""Which replicas prefill and which decode, from the configuration (``--replica`` serves
both, as before; ``--prefill-replica`` / ``--decode-replica``, or YAML ``disaggregation:
{prefill: [...], decode: [...]}``). With no prefill replica there is no disaggregation."""

from __future__ import annotations

from collections.abc import Iterable

from router.config import Config
from router.fleet.replicas import Replica, Role

# The replicas a leg of each role may go to. An aggregated request in a P/D fleet (a short
# prompt, a prompt the decode replica holds, no prefill replica left) goes to a decode one.
POOLS: dict[Role, frozenset[Role]] = {
    "both": frozenset({"both"}),
    "prefill": frozenset({"prefill"}),
    "decode": frozenset({"decode", "both"}),
}


def configured(config: Config) -> list[tuple[str, Role]]:
    """Every listed replica with its role (a URL listed twice keeps its first role: the
    configuration check refuses two roles for one URL)."""
    out: dict[str, Role] = {}
    pd = config.disaggregation
    lists: tuple[tuple[list[str], Role], ...] = (
        (config.discovery.replicas, "both"),
        (pd.prefill_replicas, "prefill"),
        (pd.decode_replicas, "decode"),
    )
    for urls, role in lists:
        for url in urls:
            out.setdefault(url.rstrip("/"), role)
    return list(out.items())


def dns_names(config: Config) -> list[tuple[Role, str]]:
    """The DNS names discovering one role each (``disaggregation: {prefill_dns, decode_dns}``;
    port, interval and nameserver are discovery's)."""
    pd = config.disaggregation
    found: list[tuple[Role, str | None]] = [
        ("prefill", pd.pd_prefill_dns),
        ("decode", pd.pd_decode_dns),
    ]
    return [(role, name) for role, name in found if name]


def disaggregating(config: Config) -> bool:
    """The configuration names prefill replicas (listed or by DNS): the gateway splits."""
    pd = config.disaggregation
    return bool(pd.prefill_replicas or pd.pd_prefill_dns)


def disaggregated(replicas: Iterable[Replica]) -> bool:
    """A fleet with a prefill replica (healthy or not) disaggregates."""
    return any(r.role == "prefill" for r in replicas)


def in_pool(replica: Replica, role: Role) -> bool:
    return replica.role in POOLS[role]
