"""Reloading a running daemon: SIGHUP (``systemctl reload scratchd``) or ``scratchd reload``.

What a reload does, in order (:meth:`Reloader.reload_once`)::

    SIGHUP ─▶ handler records + wakes (nothing else in signal context)
           ─▶ RELOADING=1 to systemd, event=reload_start
           ─▶ re-read the config file (same path and flags as at start)   ── error ─┐
           ─▶ load the configured model once here, to refuse a broken file ── error ─┤
              before any worker is touched                                          │
           ─▶ a changed key that needs a restart (LIVE_KEYS says which can  ── error ─┤
              change live) refuses the whole reload, named in                       │
              event=reload_needs_restart: nothing is applied, no worker replaced    │
           ─▶ apply the new configuration                                           │
           ─▶ supervisor.rolling_restart(): for each worker, start its              │
              replacement, wait for its READY (new model loaded and warmed up),     │
              then retire the old one, which finishes its batch; anything it still  │
              holds goes back to the queue. The queue keeps flowing throughout: at  │
              no point are fewer workers READY than before.                         │
           ─▶ READY=1 + STATUS=, event=reload_done ◀────────────────────────────────┘
                                   (on error: event=reload_failed, the daemon keeps
                                    serving with what it had; `scratchd reload` exits 1)

A reload is all or nothing: half a file applied (the new model, the old worker count) is a
configuration nobody wrote, and a refused reload must not cost a rolling restart. The
operator restarts instead (``systemctl restart scratchd``), which applies everything.

SIGHUPs that arrive during a reload are folded into one more reload after it: the file may
have changed again. ``scratchd reload`` finds the daemon's pid in its status reply, sends
SIGHUP (so only the daemon's user or root may reload — a gateway that may connect may not),
waits for the status's reload counter to move and exits non-zero when the reload failed
(``reload_error``, and ``reload_needs_restart`` for the keys that only a restart applies).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from scratchd.daemon.config import Config, ConfigError
from scratchd.daemon.ops.notify import Notifier
from scratchd.daemon.pool.supervisor import PoolHalted
from scratchd.model.cascade import resolve as resolve_cascade
from scratchd.model.scratchnet import load_model
from scratchd.protocol.log import log_event

LIVE_KEYS: Final = frozenset(
    {
        "server.allowed_uids",
        "server.allowed_gids",
        "server.drain_timeout_ms",
        "server.max_in_flight_per_connection",
        "server.max_connections",
        "server.max_connections_per_uid",
        "server.max_connections_per_pid",
        "server.first_frame_timeout_ms",
        "server.frame_timeout_ms",
        "server.max_regions_per_connection",
        "server.max_region_bytes",
        "queue.max_queue_delay_ms",
        "queue.max_batch",
        "queue.reserved_priority",
        "queue.reserved_share",
        "workers.cpu_max_batch",
        "workers.heartbeat_ms",
        "workers.hang_timeout_ms",
        "workers.kill_grace_ms",
        "workers.boot_timeout_ms",
        "workers.max_kills",
        "classes",
        "model",
        "drift",
    }
)
"""Dotted keys (or whole sections) a reload applies. Everything else — the socket, ports,
queue geometry, backend and worker count — is fixed for the life of the process: the shared
memory and the listeners were built from it. Those need ``systemctl restart``."""


def _flatten(config: Config) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for section, table in msgspec.structs.asdict(config).items():
        if section in LIVE_KEYS or not isinstance(table, msgspec.Struct):
            flat[section] = msgspec.to_builtins(table)
            continue
        for key, value in msgspec.structs.asdict(table).items():
            flat[f"{section}.{key}"] = msgspec.to_builtins(value)
    return flat


def config_changes(old: Config, new: Config) -> tuple[list[str], list[str]]:
    """``(live, restart_only)``: the dotted keys whose value differs, split by whether a
    reload can apply them."""
    before, after = _flatten(old), _flatten(new)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    live = [k for k in changed if k in LIVE_KEYS]
    return live, [k for k in changed if k not in LIVE_KEYS]


def model_version(config: Config) -> str:
    """Load the configured model with the configured views and cascade switch, as the
    workers will (a broken file, or a cascade it cannot run, raises naming it), and return
    its version."""
    net = load_model(config.model.path or None, views=config.model.views or None)
    resolve_cascade(net, config.model.cascade)
    return net.version


class ReloadState(enum.Enum):
    IDLE = "idle"
    RELOADING = "reloading"


@dataclass(frozen=True)
class ReloadOutcome:
    ok: bool
    message: str
    needs_restart: tuple[str, ...] = ()
    """The changed keys only a restart applies (then ``ok`` is false and nothing was applied)."""


class Reloader:
    """Runs reloads one at a time on the daemon's loop; :meth:`request` is signal-safe.

    The daemon supplies what differs between daemons: how to read the config again,
    how to apply it to acceptor, supervisor and access policy, and the rolling restart.
    """

    def __init__(
        self,
        *,
        read_config: Callable[[], Config],
        current: Callable[[], Config],
        apply: Callable[[Config], None],
        rolling_restart: Callable[[], Awaitable[None]],
        notifier: Notifier,
        summary: Callable[[], str],
        check_model: Callable[[Config], str] = model_version,
    ) -> None:
        self._read_config = read_config
        self._current = current
        self._apply = apply
        self._rolling_restart = rolling_restart
        self._notifier = notifier
        self._summary = summary
        self._check_model = check_model
        self._wake = asyncio.Event()
        self.state = ReloadState.IDLE
        self.count = 0
        self.last_error = ""
        self.needs_restart: tuple[str, ...] = ()

    def request(self) -> None:
        """Record a reload request and wake the loop (the SIGHUP handler)."""
        self._wake.set()

    async def run(self) -> None:
        """Serve reload requests until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.reload_once()

    async def reload_once(self) -> ReloadOutcome:
        self.state = ReloadState.RELOADING
        started = time.monotonic()
        self._notifier.reloading("reloading configuration and model")
        log_event("reload_start")
        try:
            outcome = await self._reload()
        finally:
            self.state = ReloadState.IDLE
        self.count += 1
        self.last_error = "" if outcome.ok else outcome.message
        self.needs_restart = outcome.needs_restart
        level = logging.INFO if outcome.ok else logging.ERROR
        name = "reload_done" if outcome.ok else "reload_failed"
        log_event(name, level, reason=outcome.message, seconds=time.monotonic() - started)
        self._notifier.ready(self._summary())
        return outcome

    async def _reload(self) -> ReloadOutcome:
        old = self._current()
        try:
            new = self._read_config()
            version = await asyncio.to_thread(self._check_model, new)
        except (ConfigError, ValueError, OSError) as exc:
            return ReloadOutcome(False, f"kept the running configuration: {exc}")
        live, fixed = config_changes(old, new)
        if fixed:
            keys = ",".join(fixed)
            log_event("reload_needs_restart", logging.WARNING, keys=keys)
            reason = f"kept the running configuration: {keys} need a restart (systemctl restart)"
            return ReloadOutcome(False, reason, needs_restart=tuple(fixed))
        self._apply(new)
        try:
            await self._rolling_restart()
        except PoolHalted as exc:
            return ReloadOutcome(False, f"a replacement worker did not boot: {exc}")
        changed = ",".join(live) or "nothing"
        return ReloadOutcome(True, f"model {version}; applied {changed}")
