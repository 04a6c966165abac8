"""Who holds the daemon's connection places: caps per process, per user and in total, and
which silent connection gives up its place when one is needed.

Three caps, each checked when a connection opens (the peer's pid and uid are the kernel's,
``SO_PEERCRED``): ``server.max_connections_per_pid``, ``server.max_connections_per_uid``,
``server.max_connections``. A connection is *silent* until its first complete frame
arrives (the Python client sends a ``ping`` as it connects, so it speaks at once).

Silent connections are never closed for being silent alone: a gateway may connect at start-up
and wait for its first part for hours. Only when a newcomer finds a cap full does a silent
connection make room, if one has been silent for ``server.first_frame_timeout_ms``: within the
cap's scope (the same process, the same user, or anyone), the oldest silent connection of the
process that holds the most silent ones. So a flood of silent connections evicts itself, not
the one idle gateway of another process, and a connection that has spoken is never evicted.
When no silent connection can make room, the newcomer is refused, told which cap is full.

Run on the event loop's thread only; the acceptor answers and closes what :meth:`open`
decides.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

from scratchd.daemon.config import ServerConfig

C = TypeVar("C", bound=Hashable)

UNKNOWN: Final = -1
"""The pid and uid of a peer whose credentials cannot be read (they share one place count)."""


@dataclass(frozen=True, slots=True)
class Caps:
    total: int
    per_uid: int
    per_pid: int
    silent_s: float  # silent this long, a connection may be evicted to make room

    @classmethod
    def of(cls, server: ServerConfig) -> Caps:
        return cls(
            total=server.max_connections,
            per_uid=server.max_connections_per_uid,
            per_pid=server.max_connections_per_pid,
            silent_s=server.first_frame_timeout_ms / 1000.0,
        )


@dataclass(slots=True)
class Place(Generic[C]):
    conn: C
    uid: int
    pid: int
    opened: float


@dataclass(frozen=True, slots=True)
class Decision(Generic[C]):
    """``refusal`` None: the newcomer has its place once ``evict`` are closed."""

    refusal: str | None
    evict: list[C] = field(default_factory=list)
    limit: int = 0  # the full cap, with a refusal


class Places(Generic[C]):
    """The open connections by peer, and the silent ones oldest first."""

    def __init__(self, caps: Caps) -> None:
        self.caps = caps
        self._places: dict[C, Place[C]] = {}
        self._silent: dict[C, Place[C]] = {}  # insertion order: oldest first
        self._by_uid: collections.Counter[int] = collections.Counter()
        self._by_pid: collections.Counter[int] = collections.Counter()

    def __len__(self) -> int:
        return len(self._places)

    def is_silent(self, conn: C) -> bool:
        return conn in self._silent

    def open(self, conn: C, uid: int, pid: int, now: float) -> Decision[C]:
        """Whether ``conn`` (from ``uid``/``pid``) gets a place, and whom it evicts; on a
        place, ``conn`` is counted (silent) and the evicted ones are not any more."""
        evict: list[C] = []
        scopes: list[tuple[str, int, Callable[[Place[C]], bool], int]] = [
            (f"from pid {pid}", self.caps.per_pid, lambda p: p.pid == pid, self._by_pid[pid]),
            (f"from uid {uid}", self.caps.per_uid, lambda p: p.uid == uid, self._by_uid[uid]),
            ("", self.caps.total, lambda p: True, len(self._places)),
        ]
        for who, cap, within, count in scopes:
            count -= sum(1 for c in evict if within(self._places[c]))
            while count >= cap:
                victim = self._victim(within, evict, now)
                if victim is None:
                    unit = "per process" if "pid" in who else ""
                    return Decision(_refusal(who, cap, unit), limit=cap)
                evict.append(victim)
                count -= 1
        for victim in evict:
            self.close(victim)
        place = Place(conn, uid, pid, now)
        self._places[conn] = self._silent[conn] = place
        self._by_uid[uid] += 1
        self._by_pid[pid] += 1
        return Decision(None, evict)

    def spoke(self, conn: C) -> None:
        """``conn``'s first complete frame arrived: it is never evicted."""
        self._silent.pop(conn, None)

    def close(self, conn: C) -> None:
        place = self._places.pop(conn, None)
        if place is None:
            return
        self._silent.pop(conn, None)
        for counter, key in ((self._by_uid, place.uid), (self._by_pid, place.pid)):
            counter[key] -= 1
            if counter[key] <= 0:
                del counter[key]

    def _victim(
        self, within: Callable[[Place[C]], bool], taken: Iterable[C], now: float
    ) -> C | None:
        """The oldest silent-long-enough connection in scope, of the pid with the most."""
        taken = set(taken)
        old = [
            p
            for p in self._silent.values()
            if now - p.opened >= self.caps.silent_s and within(p) and p.conn not in taken
        ]
        if not old:
            return None
        most = collections.Counter(p.pid for p in old).most_common(1)[0][0]
        return next(p.conn for p in old if p.pid == most)  # oldest first: insertion order


def _refusal(who: str, cap: int, unit: str) -> str:
    if not who:
        return f"too many connections (limit {cap}); retry later"
    per = unit or "per user"
    return f"too many connections {who} (limit {cap} {per}); retry later"
