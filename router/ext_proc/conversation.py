"""One ext_proc stream as two calls: read Envoy's next message, write an answer."""

from __future__ import annotations

from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb


class Conversation:
    """The picker's side of one ``Process`` stream (grpc.aio's servicer context)."""

    __slots__ = ("context", "written")

    def __init__(self, context: Any) -> None:
        self.context = context
        self.written = 0  # answers sent: none yet means an immediate response may still go

    async def read(self) -> pb.ProcessingRequest | None:
        """Envoy's next message, None once it has closed its side."""
        msg = await self.context.read()
        return None if msg is grpc.aio.EOF else msg

    async def write(self, msg: pb.ProcessingResponse) -> None:
        self.written += 1
        await self.context.write(msg)
