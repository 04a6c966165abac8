"""From a decoded Open Inference Protocol call to the daemon's queue and back.

There is no second scheduler: each image of a call is admitted by the acceptor exactly as a
Unix-socket frame is (``Acceptor.admit``: part classes, priorities, deadlines, the door while
draining, a full queue), queued, served by the same workers and answered by the dispatcher,
the one exit for replies, which also accounts it (metrics, drift).

The dispatcher answers a ``Peer``; here each image gets its own :class:`PendingReply`, a peer
whose ``send`` resolves a future (its id comes from the acceptor's connection ids, so the
queue never mixes it up with a socket client). A call that goes away before its replies
(an HTTP client that disconnects, a gRPC call cancelled or past its deadline) abandons
its images the way a closed connection does: queued ones are freed, claimed ones when their
worker finishes, and a late reply finds nobody to answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from scratchd.daemon.frontend.acceptor import Acceptor
from scratchd.ipc.queue import Handle
from scratchd.protocol import wire


class PendingReply:
    """One image's stand-in for a connection (``dispatch.Peer``): its reply, once."""

    def __init__(self, peer_id: int, loop: asyncio.AbstractEventLoop) -> None:
        self.id = peer_id
        self.closed = False
        self.in_queue: set[Handle] = set()
        self.converting = 0
        self.reply: asyncio.Future[wire.Reply] = loop.create_future()

    def send(self, message: wire.Reply) -> None:
        if not self.closed and not self.reply.done():
            self.reply.set_result(message)

    def in_flight(self) -> int:
        return len(self.in_queue) + self.converting

    def converted(self, _task: asyncio.Task[None]) -> None:
        self.converting -= 1


class Bridge:
    """Submits a call's images through the acceptor and waits for all their replies."""

    def __init__(self, acceptor: Acceptor) -> None:
        self.acceptor = acceptor

    @property
    def draining(self) -> bool:
        return self.acceptor.draining

    async def infer(self, frames: Sequence[wire.InferFrame]) -> list[wire.Reply]:
        """Each frame's reply, in order (statuses as the Unix socket's replies have them)."""
        loop = asyncio.get_running_loop()
        received_ns = time.monotonic_ns()
        peers = [PendingReply(self.acceptor.new_peer_id(), loop) for _ in frames]
        try:
            for peer, frame in zip(peers, frames, strict=True):
                self.acceptor.admit(peer, frame, received_ns)
            return [await peer.reply for peer in peers]
        finally:
            for peer in peers:
                if not peer.reply.done() or peer.reply.cancelled():
                    self.abandon(peer)

    def abandon(self, peer: PendingReply) -> None:
        """The caller left: drop the image's request as a closed connection's."""
        peer.closed = True
        self.acceptor.closed(peer)
