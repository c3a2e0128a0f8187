"""vLLM's NixlConnector in pull mode, simulated: how a replica serves the two legs of a
disaggregated request (vllm/distributed/kv_transfer/kv_connector/v1/nixl/, vLLM 0.34).

- **Prefill leg** (``kv_transfer_params.do_remote_decode``): computed as any request (its own
  prefix cache counts), then its blocks stay pinned for ``kv_lease_s`` instead of being freed,
  and the answer carries the parameters the decode leg needs (``pull_scheduler.py``
  ``request_finished``: remote block ids, engine id, request id, side-channel host and port,
  ``remote_num_tokens``, ``remote_prefill_cached_tokens``). Only a request that finished (length
  or stop) pins its blocks; an aborted one frees them at once.
- **Decode leg** (``do_remote_prefill`` with the remote fields): its own prefix cache first,
  then it pulls only the blocks it lacks (``get_num_new_matched_tokens``), over one link per
  decode replica (a first contact with a prefill engine pays the handshake, then a time per
  block), computes the last prompt token itself and caches the pulled blocks (``BlockStored``
  events as for computed ones). It heartbeats the prefill side while it queues (the lease is
  extended), and reading the blocks frees them there. Its usage reports the prefill side's
  ``cached_tokens`` (vLLM 0.34's output processor).
- **Faults**: a prefill side that cannot be reached fails the pull (``kv_load_failure_policy``
  "fail": the request ends in an error; "recompute": the decode replica computes the prompt);
  a pull of blocks the prefill side no longer pins (the lease ran out, or the same parameters
  sent to a second decode replica) is what real NIXL does silently: it reads freed, maybe
  reused memory. The simulator answers as vLLM would and counts it (``kv_corrupt_reads``), so
  a test can insist on zero.

The side channel (vLLM: ZMQ on ``VLLM_NIXL_SIDE_CHANNEL_PORT``; the blocks then move by RDMA)
is the replica's own HTTP port here, ``POST /_sim/nixl``, so ``remote_port`` is that port.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp

from loadtest.sim.config import SimConfig
from loadtest.sim.engine import Engine, Seq
from router.core.errors import bad_request

log = logging.getLogger("loadtest.sim")

SIDE_CHANNEL_PATH = "/_sim/nixl"
# The fields a decode leg needs to pull (pull_scheduler.py update_state_after_alloc).
REMOTE_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


def transfer_params(body: dict[str, Any]) -> dict[str, Any] | None:
    """The request's ``kv_transfer_params`` (an object or null, as vLLM's protocol types it)."""
    params = body.get("kv_transfer_params")
    if params is None or isinstance(params, dict):
        return params
    raise bad_request("kv_transfer_params must be an object", "kv_transfer_params")


def is_prefill_leg(params: dict[str, Any] | None) -> bool:
    return bool(params and params.get("do_remote_decode"))


def is_decode_leg(params: dict[str, Any] | None) -> bool:
    """A decode leg vLLM pulls for: ``do_remote_prefill``, block ids and every remote field
    (without them vLLM warns and serves the request without a transfer)."""
    if not (params and params.get("do_remote_prefill")):
        return False
    if params.get("remote_block_ids") and all(f in params for f in REMOTE_FIELDS):
        return True
    log.warning("Got invalid KVTransferParams: %s. This request will not use KV transfer", params)
    return False


def reported_cached(params: dict[str, Any] | None) -> int | None:
    """What a request's usage reports as cached when it carries the prefill side's count
    (vLLM 0.34 takes it from any request with ``do_remote_prefill``, unchecked)."""
    if not (params and params.get("do_remote_prefill")):
        return None
    n = params.get("remote_prefill_cached_tokens")
    return n if isinstance(n, int) and not isinstance(n, bool) else None


class Link:
    """One decode replica's network link: its pulls take turns; the first pull from a
    prefill engine pays the handshake."""

    def __init__(self, config: SimConfig) -> None:
        self.handshake_s = 0.0 if config.instant else config.kv_handshake_s
        self.block_s = 0.0 if config.instant else config.kv_block_transfer_s
        self.free_at = 0.0
        self.known: set[str] = set()

    def pull(self, engine_id: str, num_blocks: int, now: float) -> float:
        start = max(now, self.free_at)
        if engine_id not in self.known:
            self.known.add(engine_id)
            start += self.handshake_s
        self.free_at = start + num_blocks * self.block_s
        return self.free_at


class NixlConnector:
    """Both sides of one replica: pins (prefill) and pulls (decode)."""

    def __init__(self, config: SimConfig, engine: Engine, port: Callable[[], int | None]) -> None:
        self.config = config
        self.engine = engine
        self.engine_id = uuid.uuid4().hex  # a new process, a new engine id
        self._port = port
        self._leases: dict[str, asyncio.TimerHandle] = {}
        self._session: aiohttp.ClientSession | None = None

    # -- the prefill side ---------------------------------------------------------------

    def pinned(self, seq: Seq) -> dict[str, Any]:
        """``seq`` (a prefill leg) finished with its blocks held: start its lease and return
        the ``kv_transfer_params`` its answer carries."""
        rid = seq.request_id
        self._renew(rid)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[b.block_id for b in seq.blocks]],
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "remote_host": self.config.nixl_side_channel_host,
            "remote_port": self._port(),
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": seq.num_prompt_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": seq.num_cached_tokens,
        }

    def _renew(self, rid: str) -> None:
        old = self._leases.pop(rid, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        self._leases[rid] = loop.call_later(self.config.kv_lease_s, self._expire, rid)

    def _expire(self, rid: str) -> None:
        self._leases.pop(rid, None)
        if self.engine.release_held(rid):
            self.engine.stats["kv_leases_expired"] += 1
            log.warning("prefill request %s: lease expired, its KV blocks are freed", rid)

    def _free(self, rid: str) -> bool:
        lease = self._leases.pop(rid, None)
        if lease is not None:
            lease.cancel()
        return self.engine.release_held(rid)

    def side_channel(self, msg: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """A decode replica's message: ``read`` (it pulled the blocks: they are freed here),
        ``heartbeat`` (it still queues the request: the lease is extended) or ``free`` (it
        refused the request)."""
        op, rid = msg.get("op"), msg.get("remote_request_id")
        if msg.get("remote_engine_id") != self.engine_id or not isinstance(rid, str):
            return 404, {"ok": False, "why": "unknown engine"}  # e.g. a restarted process
        held = self.engine.held.get(rid)
        if op == "heartbeat":
            if held is None:
                return 410, {"ok": False, "why": "not pinned"}
            self._renew(rid)
            return 200, {"ok": True}
        if op == "free":
            return 200, {"ok": self._free(rid)}
        if op == "read":
            want = msg.get("block_ids")
            if held is None or want != [[b.block_id for b in held.blocks]]:
                return 410, {"ok": False, "why": "blocks not pinned for this request"}
            self._free(rid)
            return 200, {"ok": True}
        return 400, {"ok": False, "why": f"unknown op {op!r}"}

    # -- the decode side ----------------------------------------------------------------

    async def _send(self, params: dict[str, Any], op: str) -> int | None:
        """Send ``op`` to the prefill side named by ``params``; its status, None when it
        could not be reached."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        host = str(params["remote_host"])
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{params['remote_port']}{SIDE_CHANNEL_PATH}"
        msg = {
            "op": op,
            "remote_engine_id": params["remote_engine_id"],
            "remote_request_id": params["remote_request_id"],
            "block_ids": params.get("remote_block_ids"),
        }
        try:
            async with self._session.post(url, json=msg) as resp:
                await resp.read()
                return resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None

    async def wait_admitted(self, seq: Seq, params: dict[str, Any]) -> None:
        """Wait until the engine admits ``seq`` (a decode leg), heartbeating the prefill side
        meanwhile so its lease outlasts the queue."""
        assert seq.admitted is not None
        every = max(0.05, self.config.kv_lease_s / 3)
        while not seq.admitted.done():
            done, _ = await asyncio.wait({seq.admitted}, timeout=every)
            if not done:
                await self._send(params, "heartbeat")

    async def pull(self, seq: Seq, params: dict[str, Any]) -> bool:
        """``seq`` was admitted: read the blocks it lacks from the prefill side (a full local
        hit only tells it to free them). False when the prefill side could not be reached
        (a load failure)."""
        stats = self.engine.stats
        if not seq.pulled_blocks:
            await self._send(params, "free")
            return True
        status = await self._send(params, "read")
        if status is None or status == 404:
            stats["kv_load_failures"] += 1
            log.warning("request %s: KV load from %s failed", seq.request_id, params["remote_host"])
            return False
        if status != 200:
            stats["kv_corrupt_reads"] += 1
            log.warning(
                "request %s: read KV blocks prefill request %s no longer pins (silent "
                "corruption on a real NIXL transfer)",
                seq.request_id,
                params["remote_request_id"],
            )
        return True

    async def notify_rejected(self, params: dict[str, Any] | None) -> None:
        """A decode leg refused before it reached the engine frees the prefill side's blocks
        (vLLM's serving layer, ``_with_kv_transfer_rejection_cleanup``)."""
        if is_decode_leg(params):
            assert params is not None
            await self._send(params, "free")

    async def close(self) -> None:
        for lease in self._leases.values():
            lease.cancel()
        self._leases.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None
