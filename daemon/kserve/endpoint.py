"""The Open Inference Protocol endpoint as the daemon runs it: the HTTP and the gRPC listener
(each on when its ``[kserve]`` port is not 0, bound to ``[server] bind``), started and closed
together, both on the daemon's loop and both answering through one :class:`Bridge`.

They open once the daemon serves and close after the drain, so a call that arrives while
draining is answered ``overloaded`` (503 / UNAVAILABLE) like a Unix-socket frame, and the
calls accepted before it are answered before the listeners go.
"""

from __future__ import annotations

from typing import Any

from scratchd.daemon.config import Config
from scratchd.daemon.frontend.acceptor import Acceptor
from scratchd.daemon.kserve.bridge import Bridge
from scratchd.daemon.kserve.grpc_endpoint import GrpcEndpoint
from scratchd.daemon.kserve.http_endpoint import HttpEndpoint
from scratchd.daemon.kserve.model_info import Served
from scratchd.protocol.log import log_event


class KServeEndpoint:
    def __init__(self, config: Config, acceptor: Acceptor, served: Served) -> None:
        self.bind = config.server.bind
        self.ports = config.kserve
        bridge = Bridge(acceptor)
        slot_bytes = config.queue.slot_bytes
        self.http = HttpEndpoint(bridge, served, slot_bytes) if self.ports.http_port else None
        self.grpc = GrpcEndpoint(bridge, served, slot_bytes) if self.ports.grpc_port else None

    async def start(self) -> None:
        """Bind the listeners that are on; raise ``OSError`` if one cannot bind."""
        try:
            if self.http is not None:
                await self.http.start(self.bind, self.ports.http_port)
            if self.grpc is not None:
                await self.grpc.start(self.bind, self.ports.grpc_port)
        except BaseException:
            await self.close()
            raise
        if self.http is not None or self.grpc is not None:
            log_event("kserve_listening", bind=self.bind, **self.status_fields())

    async def close(self) -> None:
        if self.grpc is not None:
            await self.grpc.close()
        if self.http is not None:
            await self.http.close()

    def status_fields(self) -> dict[str, Any]:
        return {
            "kserve_http_port": self.http.port if self.http is not None else 0,
            "kserve_grpc_port": self.grpc.port if self.grpc is not None else 0,
        }
