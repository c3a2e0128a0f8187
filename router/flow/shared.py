"""Fleet mode: gateways share per-tenant usage through Redis, so a tenant flooding one gateway
waits its turn on the others too.

Each gateway adds the work it released per tenant to one Redis hash per model, ``{ns}:{fleet}
:flow:usage:<model>`` (field: tenant, value: cumulative tokens), once every ``interval_s``, in
one pipelined round trip that also reads the hashes back (all on the fleet's hash tag, so one
Redis Cluster slot): writes are bounded by the tenants that
had traffic in the interval, reads by the tenants of the model. The others' share is the
hash's total minus what this gateway added itself; its growth since the last read is charged
to the tenant's flow here (``FlowController.charge_remote``). Approximate by design (an
interval late, and a gateway that restarts forgets what it wrote: the difference counts as
the others'). Without Redis, or while it is down, each gateway is fair on its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

from router.core.tasks import cancel_and_wait
from router.fleet.shared_state import FLEET_SCOPE
from router.flow.controller import FlowController
from router.index.redis import key_prefix

log = logging.getLogger("prefix_router.flow")

TTL_MS = 3_600_000  # an hour without any gateway writing: the hash goes


class UsageShare:
    def __init__(
        self,
        controller: FlowController,
        redis: Callable[[], Any],
        namespace: str,
        served: Callable[[], Iterable[str]],
        interval_s: float = 0.5,
        timeout_s: float = 0.5,
    ) -> None:
        self.controller = controller
        self.redis = redis
        self.namespace = namespace
        self.served = served  # the models the fleet serves: their usage is read
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.own: dict[tuple[str, str], float] = {}  # what this gateway added, cumulative
        self.seen_remote: dict[tuple[str, str], float] = {}  # the others' total, last read
        self.models: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def key(self, model: str) -> str:
        return f"{key_prefix(self.namespace, FLEET_SCOPE)}flow:usage:{model}"

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.tick()

    async def tick(self) -> bool:
        """One write-and-read round trip; never raises. True when it went through."""
        client = self.redis()
        pending = self.controller.usage
        self.models.update(m for m, _ in pending)
        self.models.update(self.served())
        if client is None or not self.models:
            return False
        self.controller.usage = {}
        models = sorted(self.models)
        try:
            pipe = client.pipeline(transaction=False)
            for (model, tenant), cost in pending.items():
                pipe.hincrbyfloat(self.key(model), tenant, cost)
            for model in models:
                pipe.pexpire(self.key(model), TTL_MS)
                pipe.hgetall(self.key(model))
            res = await asyncio.wait_for(pipe.execute(), self.timeout_s)
        except Exception as e:  # Redis down or slow: fair on our own until it is back
            for key, cost in pending.items():  # written next time (HINCRBYFLOAT may have run)
                self.controller.usage[key] = self.controller.usage.get(key, 0.0) + cost
            if not self._failing:
                log.warning("flow usage sharing: Redis unavailable (%s)", type(e).__name__)
                self._failing = True
            return False
        if self._failing:
            log.info("flow usage sharing: Redis back")
            self._failing = False
        for key, cost in pending.items():
            self.own[key] = self.own.get(key, 0.0) + cost
        for i, model in enumerate(models):
            totals = res[len(pending) + 2 * i + 1] or {}
            for raw_tenant, raw_total in totals.items():
                tenant = raw_tenant.decode() if isinstance(raw_tenant, bytes) else str(raw_tenant)
                try:
                    total = float(raw_total)
                except (TypeError, ValueError):
                    continue
                key = (model, tenant)
                remote = total - self.own.get(key, 0.0)
                if remote < self.seen_remote.get(key, 0.0) - 1e-6:  # the hash was reset
                    self.own[key] = 0.0
                    self.seen_remote[key] = total
                    continue
                delta = remote - self.seen_remote.get(key, 0.0)
                self.seen_remote[key] = remote
                if delta > 0.5:
                    self.controller.charge_remote(model, tenant, delta)
        return True
