"""Who may talk to the daemon: peer credentials of a Unix socket and the allow-list.

Two layers, both needed on a plant network:

1. the filesystem: the socket is created with ``server.socket_mode`` (0660 by default) in
   ``/run/scratchd`` (mode 0750, group ``scratchd``), so only the owner and the group can
   even ``connect()``;
2. this module: the kernel's record of the connecting process (``SO_PEERCRED``: pid, uid,
   gid at ``connect()`` time, unforgeable by the peer) plus its supplementary groups
   (``SO_PEERGROUPS``), checked against ``server.allowed_uids`` / ``server.allowed_gids``.

The decision, made once per connection before any frame is read:

    both lists empty           → allow (anyone who can open the socket)
    uid in allowed_uids        → allow
    any of the peer's groups   → allow          (primary gid or a supplementary one)
      in allowed_gids
    otherwise                  → refuse, with a reason naming uid, gid and pid

root is not special: a line controller running as root must be listed like anyone else.
The refused peer gets one ``error`` reply and the connection is closed (the acceptor does
that); the reason goes to the log and a counter.

Note for the unit file: ``PrivateUsers=`` must stay off. Inside a private user namespace
every peer outside it reads as the overflow uid 65534 and the allow-list would be useless.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from scratchd.protocol.log import Throttle

# Linux <asm-generic/socket.h>; the socket module does not export SO_PEERGROUPS.
SO_PEERGROUPS = 59
_UCRED = struct.Struct("=iII")  # pid_t pid; uid_t uid; gid_t gid
_MAX_GROUPS = 65536  # NGROUPS_MAX on Linux
_INVALID_ID = 0xFFFFFFFF  # (uid_t)-1
LINGER_S = 1.0
LINGER_BYTES = 256 * 1024


class SupportsGetsockopt(Protocol):
    """A socket, or asyncio's ``TransportSocket`` from ``get_extra_info("socket")``."""

    def getsockopt(self, level: int, optname: int, buflen: int, /) -> bytes: ...


@dataclass(frozen=True)
class PeerCredentials:
    """What the kernel recorded about the peer when it connected."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    def describe(self) -> str:
        return f"uid={self.uid} gid={self.gid} pid={self.pid}"


def peer_credentials(sock: SupportsGetsockopt) -> PeerCredentials:
    """SO_PEERCRED (and SO_PEERGROUPS where the kernel has it) of a connected Unix socket.

    Raises OSError when the socket is not a connected ``AF_UNIX`` socket.
    """
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    if uid == _INVALID_ID or gid == _INVALID_ID:
        # What the kernel reports for a socket with no peer (unconnected, or not AF_UNIX).
        raise OSError(errno.ENOTCONN, "socket has no peer credentials")
    return PeerCredentials(pid=pid, uid=uid, gid=gid, groups=_peer_groups(sock))


def peer_ids(sock: SupportsGetsockopt | None) -> tuple[int, int] | None:
    """(uid, pid) of a connected Unix socket's peer (``SO_PEERCRED`` alone), None if unknown."""
    if sock is None:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None
    pid, uid, _gid = _UCRED.unpack(raw)
    return None if uid == _INVALID_ID else (uid, pid)


def _peer_groups(sock: SupportsGetsockopt) -> tuple[int, ...]:
    # SO_PEERGROUPS (Linux 4.13) fails with ERANGE when the buffer is too small; grow once
    # to the kernel's maximum rather than loop on a size it does not report through Python.
    for count in (64, _MAX_GROUPS):
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * count)
        except OSError as exc:
            if exc.errno == errno.ERANGE and count != _MAX_GROUPS:
                continue
            return ()
        return struct.unpack(f"={len(raw) // 4}I", raw)
    return ()


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str


@dataclass(frozen=True)
class AccessPolicy:
    """The allow-list from ``[server] allowed_uids`` / ``allowed_gids``."""

    allowed_uids: frozenset[int] = frozenset()
    allowed_gids: frozenset[int] = frozenset()

    @classmethod
    def from_lists(cls, uids: Iterable[int] = (), gids: Iterable[int] = ()) -> AccessPolicy:
        return cls(frozenset(uids), frozenset(gids))

    @property
    def open(self) -> bool:
        """True when no list is configured: the socket's mode is the only gate."""
        return not self.allowed_uids and not self.allowed_gids

    def decide(self, peer: PeerCredentials) -> Decision:
        if self.open:
            return Decision(True, "no allow-list configured")
        if peer.uid in self.allowed_uids:
            return Decision(True, f"uid {peer.uid} in allowed_uids")
        matched = sorted(self.allowed_gids.intersection((peer.gid, *peer.groups)))
        if matched:
            return Decision(True, f"gid {matched[0]} in allowed_gids")
        return Decision(
            False,
            f"peer {peer.describe()} is not in allowed_uids {sorted(self.allowed_uids)} "
            f"and none of its groups {sorted({peer.gid, *peer.groups})} "
            f"is in allowed_gids {sorted(self.allowed_gids)}",
        )

    def check(self, sock: SupportsGetsockopt) -> tuple[Decision, PeerCredentials | None]:
        """Decide for a freshly accepted connection. Credentials that cannot be read refuse."""
        if self.open:
            return Decision(True, "no allow-list configured"), None
        try:
            peer = peer_credentials(sock)
        except OSError as exc:
            return Decision(False, f"peer credentials unreadable: {exc.strerror or exc}"), None
        return self.decide(peer), peer


class AccessGate:
    """The acceptor's door: decides each new connection, logs and counts refusals.

    ``admit`` returns None for a peer that may talk, else the one ``error`` reason the
    refused peer is told. The peer learns its own ids and nothing of the allow-list; the
    log line (throttled: a misconfigured gateway reconnecting in a loop must not flood the
    journal) carries the full reason.
    """

    def __init__(self, policy: AccessPolicy) -> None:
        self.policy = policy
        self.refused = 0
        self.over_limit = 0  # refused for a full connection cap (the acceptor counts them)
        self._log = Throttle("access_refused", burst=20, window=60.0)
        self._lingering: set[asyncio.Task[None]] = set()

    @classmethod
    def from_config(cls, uids: Iterable[int], gids: Iterable[int]) -> AccessGate:
        return cls(AccessPolicy.from_lists(uids, gids))

    def admit(self, sock: SupportsGetsockopt | None) -> str | None:
        if self.policy.open:
            return None
        if sock is None:
            decision, peer = Decision(False, "no socket to read credentials from"), None
        else:
            decision, peer = self.policy.check(sock)
        if decision.allowed:
            return None
        self.refused += 1
        ids = {"uid": peer.uid, "gid": peer.gid, "pid": peer.pid} if peer else {}
        self._log.log(logging.WARNING, **ids, reason=decision.reason)
        who = f" for uid={peer.uid} gid={peer.gid}" if peer else ""
        return f"access denied{who}: not on this daemon's allow-list"

    def close_after_linger(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, close: Callable[[], None]
    ) -> None:
        """After the refusal reply: :meth:`linger` in a task of its own, then ``close``."""

        async def run() -> None:
            try:
                await self.linger(reader, writer)
            finally:
                close()

        task = asyncio.get_running_loop().create_task(run())
        self._lingering.add(task)
        task.add_done_callback(self._lingering.discard)

    @staticmethod
    async def linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """After the refusal reply: half-close, then read and discard what the peer still
        sends (a second at most, 256 KiB at most) before the connection is closed.

        A gateway sends its first request as soon as it connects; closing at once would
        fail that send with EPIPE before the gateway reads why it was refused.
        """
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()
        with contextlib.suppress(TimeoutError, OSError):
            async with asyncio.timeout(LINGER_S):
                seen = 0
                while seen < LINGER_BYTES:
                    chunk = await reader.read(64 * 1024)
                    if not chunk:
                        return
                    seen += len(chunk)
