"""The daemon's lifecycle: one enum and its allowed transitions.

::

    STARTING ──workers READY, socket open──▶ SERVING ──SIGTERM/SIGINT──▶ DRAINING ──▶ STOPPED
        │                                      │                            │
        └──────── a worker cannot boot ────────┴──────────▶ HALTED ◀────────┘

It sits at the daemon's base layer because both the daemon (daemon/app.py, which makes the
transitions) and the parts that report it (daemon/ops/service.py) read it.
"""

from __future__ import annotations

import enum
from typing import Final


class Lifecycle(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"
    HALTED = "halted"


TRANSITIONS: Final[dict[Lifecycle, frozenset[Lifecycle]]] = {
    Lifecycle.STARTING: frozenset({Lifecycle.SERVING, Lifecycle.DRAINING, Lifecycle.HALTED}),
    Lifecycle.SERVING: frozenset({Lifecycle.DRAINING, Lifecycle.HALTED}),
    Lifecycle.DRAINING: frozenset({Lifecycle.STOPPED, Lifecycle.HALTED}),
    Lifecycle.HALTED: frozenset(),
    Lifecycle.STOPPED: frozenset(),
}


def check_transition(old: Lifecycle, new: Lifecycle) -> None:
    """Raise unless ``old → new`` is in the table."""
    if new not in TRANSITIONS[old]:
        raise RuntimeError(f"lifecycle: {old.name} → {new.name} is not allowed")
