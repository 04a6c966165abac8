"""Admission: the part class, priority and deadline a request gets, or why it gets none.

A request names one of the configured part classes (``[classes.<name>]``, see
``daemon/config.py``) and may set its own priority and deadline, which then override the
class's. What cannot be served as sent is
:class:`~scratchd.daemon.frontend.images.Invalid`, which the
acceptor turns into ``Refused("invalid", message)`` (the message goes back to the client in
an ``invalid`` reply); its other refusals at the door (draining, the per-connection limit)
are :class:`Refused` with status ``overloaded``. The load is not one of them: the
acceptor weighs that when it takes a slot (``daemon/frontend/overload.py``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from scratchd.daemon.config import MAX_DEADLINE_MS, Config
from scratchd.daemon.frontend.images import AnyInferRequest, Invalid
from scratchd.protocol import wire


@dataclass(frozen=True)
class Admission:
    """A validated request: where it goes in the queue."""

    class_name: str
    class_index: int
    priority: int
    deadline_ms: int


class Refused(Exception):
    """A request answered at the door, before a slot is reserved: its status and why
    (``invalid`` for an :class:`Invalid` request; ``overloaded`` when draining or at the
    per-connection limit)."""

    def __init__(self, status: wire.ReplyStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class PartClasses:
    """The configured part classes (rebuilt from the configuration on a reload)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._index = {name: i for i, name in enumerate(config.class_names())}
        # A request that overrides neither priority nor deadline (the usual one) gets its
        # class's Admission as is: built and checked once here, shared (it is frozen).
        self._plain: dict[str, Admission] = {}
        for name, cls in config.classes.items():
            with contextlib.suppress(Invalid):  # a class whose own values are refused
                self._plain[name] = self._admission(name, cls.priority, cls.deadline_ms)

    def classify(self, request: AnyInferRequest) -> Admission:
        """The request's class, priority and deadline (its own values override the class's)."""
        if request.priority is None and request.deadline_ms is None:
            plain = self._plain.get(request.part_class)
            if plain is not None:
                return plain
        cls = self.config.classes.get(request.part_class)
        if cls is None:
            known = ", ".join(self.config.class_names())
            raise Invalid(f"unknown part class {request.part_class!r}; configured: {known}")
        priority = cls.priority if request.priority is None else request.priority
        deadline_ms = cls.deadline_ms if request.deadline_ms is None else request.deadline_ms
        return self._admission(request.part_class, priority, deadline_ms)

    def _admission(self, name: str, priority: int, deadline_ms: int) -> Admission:
        """Class ``name``'s Admission with these values; :class:`Invalid` if one is refused."""
        if not 0 <= priority <= 7:
            raise Invalid(f"priority {priority} outside 0..7")
        if deadline_ms <= 0:
            raise Invalid(f"deadline_ms must be positive, got {deadline_ms}")
        if deadline_ms > MAX_DEADLINE_MS:
            raise Invalid(
                f"deadline_ms {deadline_ms} exceeds the maximum {MAX_DEADLINE_MS} (1 day)"
            )
        return Admission(name, self._index[name], priority, deadline_ms)
