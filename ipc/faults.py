"""Test-only fault injection: SIGKILL this process at a named point of the queue's code.

``SCRATCHD_IPC_FAULT=<point>[@<n>][:stop]`` (die on the n-th time the point is reached,
default 1; with ``:stop`` the process SIGSTOPs itself instead, to play a wedged holder) is
read once, when a :class:`~scratchd.ipc.queue.RequestQueue` is
created or attached, so a test can start a worker process with it in its environment. With
the variable unset every hook is one attribute comparison.

The points inside submit, claim and complete are reached from the C fast path
(``ipc/_native.c`` calls :meth:`FaultPoint.reach` there, lock held), so a test kills the
process inside the native critical section exactly where the table says.

Points (the lock column says whether the robust mutex is held when the process dies):

==========================  =====  ==================================================
point                       lock   where
==========================  =====  ==================================================
``claim.unlinked``          held   a descriptor unlinked from ready list and wheel,
                                   still QUEUED (ownership not yet written)
``claim.marked``            held   a descriptor just marked CLAIMED
``claim.returned``          free   claims made, before the caller computes anything
``complete.mid_result``     free   result fields written, mask not yet
``complete.flipped``        held   state flipped to DONE, doorbell not yet rung
``submit.linked``           held   (main) descriptor linked, state still WRITTEN
``expire.unlinked``         held   (main) due descriptors unlinked, not yet EXPIRED
``shed.unlinked``           held   (main) the shed descriptor unlinked, still QUEUED
==========================  =====  ==================================================
"""

from __future__ import annotations

import os
import signal

ENV = "SCRATCHD_IPC_FAULT"
POINTS = frozenset(
    {
        "claim.unlinked",
        "claim.marked",
        "claim.returned",
        "complete.mid_result",
        "complete.flipped",
        "submit.linked",
        "expire.unlinked",
        "shed.unlinked",
    }
)


class FaultPoint:
    """The armed point from the environment (if any) and how often it has been reached."""

    __slots__ = ("hits", "name", "on_hit", "signal")

    def __init__(self, spec: str | None) -> None:
        self.name: str | None = None
        self.on_hit = 1
        self.hits = 0
        self.signal = signal.SIGKILL
        if spec:
            spec, _, action = spec.partition(":")
            if action not in ("", "stop"):
                raise ValueError(f"{ENV}: unknown action {action!r} (only 'stop')")
            self.signal = signal.SIGSTOP if action == "stop" else signal.SIGKILL
            name, _, nth = spec.partition("@")
            if name not in POINTS:
                raise ValueError(f"{ENV}={spec!r}: unknown point {name!r}; known: {sorted(POINTS)}")
            self.name = name
            self.on_hit = int(nth) if nth else 1

    @classmethod
    def from_env(cls) -> FaultPoint:
        return cls(os.environ.get(ENV))

    def reach(self, point: str) -> None:
        """Die by SIGKILL (or stop) if ``point`` is armed and this is its n-th hit."""
        if point != self.name:
            return
        self.hits += 1
        if self.hits == self.on_hit:
            os.kill(os.getpid(), self.signal)
