"""The transport of a prefill leg: the answer is read whole and kept, never relayed (the
client gets the decode leg's). Same ``Transport`` contract as ``Relay`` (router/upstream/transport.py):
``UpstreamUnavailable`` when the replica could not take the leg, here also for any 5xx, since
a prefill replica failing is retried elsewhere (another prefill replica, or the decode
replica serving the request aggregated) and nothing reached the client yet."""

from __future__ import annotations

import time

from router.upstream.client import UpstreamError, UpstreamPool
from router.upstream.proxy import HEAD_BYTES, Outcome, UpstreamUnavailable, usage_of
from router.upstream.transport import Report, Wire


class Collect:
    """Sends a leg over the gateway's own pool and returns its body."""

    __slots__ = ("pool",)

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool

    async def send(self, wire: Wire, report: Report) -> tuple[bytes, Outcome]:
        start = time.perf_counter()
        try:
            upstream = await self.pool.post(
                wire.url,
                wire.body,
                wire.headers,
                report.sent,
                timeout=wire.headers_timeout,
                method=wire.method,
            )
        except UpstreamError as e:
            raise UpstreamUnavailable(e.why) from e
        try:
            if upstream.status >= 500:
                raise UpstreamUnavailable(f"HTTP {upstream.status}")
            try:
                data = await upstream.read()
            except UpstreamError as e:
                raise UpstreamUnavailable(e.why) from e
            report.first_byte()
            first = time.perf_counter() - start
            cached, completion = usage_of(data) if upstream.status == 200 else (None, None)
            return data, Outcome(
                upstream.status, first, cached, completion, True, data[:HEAD_BYTES]
            )
        except BaseException:
            upstream.close()  # failed or cancelled: never reuse a half-read socket
            raise
        finally:
            upstream.release()
