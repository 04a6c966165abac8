"""The daemon's configuration: the TOML sections of docs/design.md as typed msgspec Structs.

Precedence, lowest to highest: the defaults below, the TOML file (``--config``), the
``SCRATCHD_SOCKET`` environment variable (socket only), command-line flags. Every key is
checked: an unknown key is an error that names it with its dotted path
(``unknown key 'queue.slotz'``), a wrong type or out-of-range value names the key too.

Part classes: ``[classes.<name>]`` tables are merged over the built-in ``safety`` and
``normal`` classes (a file may redefine either). ``normal`` is what a request without a
``part_class`` gets, so it always exists. A request naming a class that is not configured
is answered ``invalid`` (a typo in a gateway's class name must be seen, not silently served
with another class's deadline).
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import msgspec

from scratchd.ipc.layout import Geometry
from scratchd.kernels.views import VIEWS
from scratchd.protocol.defaults import DEFAULT_SOCKET, SOCKET_ENV
from scratchd.protocol.wire import PRIORITIES
from scratchd.workers.gpu_memory import ARENA_MB, RESERVE_MB, WARM_SIZES

MAX_DEADLINE_MS: Final = 86_400_000
"""A deadline, a class's or a request's, is at most a day: no part waits that long, and a
deadline must fit the queue's int64 nanoseconds."""


Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Priority = Annotated[int, msgspec.Meta(ge=0, le=PRIORITIES - 1)]


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the file and key."""


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    socket: str = DEFAULT_SOCKET
    bind: str = "127.0.0.1"
    health_port: Port = 8081
    metrics_port: Port = 9108
    socket_mode: Annotated[int, msgspec.Meta(ge=0, le=0o777)] = 0o660
    allowed_uids: list[NonNegative] = []
    allowed_gids: list[NonNegative] = []
    drain_timeout_ms: Positive = 10_000
    """SIGTERM: how long accepted requests may take to be answered before workers stop."""
    max_in_flight_per_connection: Positive = 128
    """Requests one connection may have accepted and unanswered; more get ``overloaded``.
    Half the default queue, so one gateway cannot take every slot from the others."""
    max_connections: Positive = 1024
    """Open client connections at most; one more gets an ``error`` reply and is closed
    (a peer opening connections in a loop must not exhaust the daemon's descriptors)."""
    max_connections_per_uid: Positive = 512
    """Open client connections of one user (the peer's uid) at most: one local user cannot
    take every place (``daemon/frontend/places.py``)."""
    max_connections_per_pid: Positive = 256
    """Open client connections of one process (the peer's pid) at most."""
    first_frame_timeout_ms: Positive = 1_000
    """A connection that has sent no complete frame for this long since connecting may be
    closed to make room, only when a newcomer finds a connection cap full (an idle gateway
    is never closed otherwise; one that has sent a frame never)."""
    frame_timeout_ms: Positive = 30_000
    """A frame's body must arrive within this time of its length prefix, or the connection
    is answered ``invalid`` and closed (a stalled sender must not hold memory and a slot)."""
    receive_budget_mb: Positive = 256
    """Memory (MiB) that frames still being received may hold, all connections together: a
    frame's buffer grows as its bytes arrive, and beyond this budget a connection stops
    reading until other frames finish (``daemon/frontend/buffers.py``). Read at start only."""
    http_max_connections: Positive = 64
    """Open connections at most on each of the health and metrics listeners; one more is
    answered 503 and closed (probes and scrapers need a few; a flood must not take the
    descriptors the Unix socket's clients need). Read at start only."""
    http_header_timeout_ms: Positive = 5_000
    """A request head on the health and metrics listeners must arrive within this time of
    its first byte (of the connection's opening, for its first request), or the connection
    is closed (a peer trickling a head must not hold a connection). Read at start only."""
    receive_threads: Annotated[int, msgspec.Meta(ge=0, le=64)] = 4
    """Threads that receive large raw frames' pixels off the event loop's thread (the kernel's
    socket copy, most of the main process's CPU for large frames; ``daemon/frontend/receiver.py``);
    0: the loop receives them.
    Read at start only (a reload does not resize the pool)."""
    max_regions_per_connection: NonNegative = 8
    """Shared-memory regions one connection may register for zero-copy requests (``wire``
    ``RegisterRegion``); one more is refused ``overloaded``. 0 turns the zero-copy path off."""
    max_region_bytes: NonNegative = 4 << 30
    """Bytes of registered regions, all connections together, that the daemon maps at most;
    a registration beyond it is refused ``overloaded`` (pages a client never wrote cost no
    memory, but a mapping is address space and page tables)."""


_GEOMETRY: Final = Geometry()  # the shared-memory queue's sizes default to its own


class QueueConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    slots: Positive = _GEOMETRY.slots
    slot_bytes: Annotated[int, msgspec.Meta(ge=64)] = _GEOMETRY.slot_bytes
    tick_ms: Positive = _GEOMETRY.tick_ms
    max_queue_delay_ms: NonNegative = 10
    """How long a worker may hold a partial batch for more requests to fill it. A GPU worker
    holds one only while its device is busy (the batch fills during the computation); an
    idle device takes what is ready at once (workers/main.py, ``PipelinedLoop``)."""
    max_batch: Positive = 16
    worker_spin_us: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 50
    """How long a worker that runs out of work spins (watching the queue's ready counts) before
    it sleeps on its eventfd: a request arriving within it skips a process wake-up (tens of
    µs). Costs at most this much CPU per idle transition; 0 turns spinning off."""
    reserved_priority: Priority = 4
    """Requests of this priority or higher may take the reserved slots (``reserved_share``),
    and a full queue sheds a queued request of lower priority to make room for one
    (``daemon/frontend/overload.py``)."""
    reserved_share: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.125
    """The share of ``slots`` (rounded up, at most all but one) that requests below
    ``reserved_priority`` cannot take: a normal-class flood leaves them free for the safety
    class. 0: no reservation (shedding still protects the higher priorities)."""


class WorkersConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    backend: Literal["auto", "cuda", "cpu"] = "auto"
    cpu_workers: Positive = 2
    gpus: Literal["all"] | list[NonNegative] = "all"
    cpu_max_batch: Positive = 2
    """The CPU backend's own batch limit (the GPU's comes from free memory). Small: numpy's
    time per image does not drop with the batch size, and small batches spread a burst
    over all CPU workers instead of queueing it behind one."""
    cpu_max_queue_delay_ms: NonNegative = 0
    """How long a CPU worker waits for a batch to fill (at most ``queue.max_queue_delay_ms``).
    0: a batch costs numpy as much per image as single images, so waiting only adds latency."""
    gpu_reserve_mb: Positive = RESERVE_MB
    """Device memory (MiB) a CUDA worker leaves free beside its arena (gpu_memory.py)."""
    gpu_arena_mb: Positive = ARENA_MB
    """The most device memory (MiB) one CUDA worker takes for its arena (gpu/arena.py);
    a warm standby takes as much again on the same card."""
    gpu_warm_sizes: list[tuple[Positive, Positive]] = msgspec.field(
        default_factory=lambda: list(WARM_SIZES)
    )
    """Frame sizes ``[height, width]`` whose graphs a CUDA worker captures before READY
    (other sizes are captured on first use)."""
    standby: bool = True
    """Keep warm spare workers (model loaded, warmed up): one for a CPU pool, one per card for
    a CUDA pool. A spare takes over a dead worker's slot (on its card) in milliseconds; its
    replacement spare then boots in the background."""
    heartbeat_ms: Positive = 250
    hang_timeout_ms: Positive = 30_000
    """A worker whose heartbeat is older than this is SIGTERMed (a batch on CPU can be slow)."""
    kill_grace_ms: Positive = 2_000
    """SIGTERM → SIGKILL escalation delay."""
    boot_timeout_ms: Positive = 120_000
    max_kills: Positive = 3
    """A request whose worker died this many times while holding it is answered ``error``."""


class ClassConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    priority: Priority = 0
    deadline_ms: Annotated[int, msgspec.Meta(ge=1, le=MAX_DEADLINE_MS)] = 3000


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    path: str = ""
    views: list[str] = []
    """Test-time views each frame is run through and averaged (``kernels.views.VIEWS``:
    identity, flip_h, flip_v, transpose), each one forward pass; empty: the model file's own.
    ``["identity"]`` serves about 4x the frames of the shipped four and gives up accuracy
    (README.md, "Choosing the test-time views": more clean tiles flagged)."""
    cascade: bool | None = None
    """The dynamic-resolution cascade (``model/cascade.py``): true runs the model file's
    calibrated cascade (a coarse pass, full resolution only where it is unsure), false every
    frame whole at full resolution; unset: the model file's own default. CPU backend only;
    one view (identity)."""


class DriftConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    window: Positive = 500
    threshold: Annotated[float, msgspec.Meta(ge=0.0)] = 0.15
    min_samples: Positive = 100
    """Drift and entropy are "warming up" (no alarm) until this many answers (at most
    ``window``) are in the window: a few single pictures are no product mix, and their
    score says nothing about the line."""


DEFAULT_CLASSES: Final[dict[str, ClassConfig]] = {
    "safety": ClassConfig(priority=7, deadline_ms=1000),
    "normal": ClassConfig(priority=0, deadline_ms=3000),
}


class KServeConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The Open Inference Protocol endpoint (``daemon/kserve/``), on ``server.bind``."""

    http_port: Port = 0
    """HTTP/REST (KServe v2); 0: off."""
    grpc_port: Port = 0
    """gRPC (``inference.GRPCInferenceService``); 0: off."""


class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    server: ServerConfig = ServerConfig()
    queue: QueueConfig = QueueConfig()
    workers: WorkersConfig = WorkersConfig()
    classes: dict[str, ClassConfig] = msgspec.field(default_factory=lambda: dict(DEFAULT_CLASSES))
    model: ModelConfig = ModelConfig()
    drift: DriftConfig = DriftConfig()
    kserve: KServeConfig = KServeConfig()

    def class_names(self) -> list[str]:
        """Class names in a fixed order; a class's index is its number in the queue."""
        return sorted(self.classes)


_UNKNOWN = re.compile(r"Object contains unknown field `(?P<key>[^`]+)`(?: - at `\$(?P<at>[^`]*)`)?")
_AT = re.compile(r"(?P<msg>.*?) - at `\$(?P<at>[^`]*)`$")


def _dotted(*parts: str) -> str:
    return ".".join(p.strip(".") for p in parts if p.strip("."))


def _explain(exc: msgspec.ValidationError, prefix: str = "") -> str:
    text = str(exc)
    unknown = _UNKNOWN.match(text)
    if unknown:
        return f"unknown key '{_dotted(prefix, unknown['at'] or '', unknown['key'])}'"
    located = _AT.match(text)
    if located:
        return f"invalid value for '{_dotted(prefix, located['at'])}': {located['msg']}"
    return f"invalid value in '{prefix or 'config'}': {text}"


def _convert(raw: Mapping[str, Any]) -> Config:
    raw = dict(raw)
    raw_classes = raw.pop("classes", {})
    if not isinstance(raw_classes, dict):
        raise ConfigError("invalid value for 'classes': expected a table of [classes.<name>]")
    classes = dict(DEFAULT_CLASSES)
    for name, table in raw_classes.items():
        try:
            classes[name] = msgspec.convert(table, ClassConfig)
        except msgspec.ValidationError as exc:
            raise ConfigError(_explain(exc, f"classes.{name}")) from None
    try:
        config = msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(exc)) from None
    check_views(config.model.views)
    if config.model.cascade and config.model.views not in ([], ["identity"]):
        raise ConfigError("model.cascade: the cascade runs one view (identity), not "
                          f"{config.model.views}")  # fmt: skip
    return msgspec.structs.replace(config, classes=classes)


def check_views(views: list[str]) -> None:
    """``model.views``: names the kernels know, each at most once (the model averages its
    views in the listed order; a view twice would weigh it twice and the GPU layout refuses
    it)."""
    for i, view in enumerate(views):
        if view not in VIEWS:
            raise ConfigError(f"model.views: unknown view {view!r} (known: {', '.join(VIEWS)})")
        if view in views[:i]:
            raise ConfigError(f"model.views: view {view!r} is listed twice")


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    section, _, name = key.partition(".")
    table = raw.setdefault(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"invalid value for '{section}': expected a table")
    table[name] = value


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Defaults ← TOML file ← ``SCRATCHD_SOCKET`` ← ``overrides`` (dotted keys, e.g.
    ``{"workers.backend": "cpu"}``; None values are ignored so click flags pass through)."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    env = os.environ if environ is None else environ
    if env.get(SOCKET_ENV):
        _set_dotted(raw, "server.socket", env[SOCKET_ENV])
    for key, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(raw, key, value)
    try:
        return _convert(raw)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}" if path is not None else str(exc)) from None
