"""The client protocol: msgpack frames over the daemon's Unix socket.

Framing (both directions)::

    +----------------------+-----------------------------------+
    | length: u32 big-end. | body: msgpack, `length` bytes     |
    +----------------------+-----------------------------------+

The receiver checks `length` against its frame cap *before* reading the body. Bodies are
tagged unions (the ``type`` key): a client sends :class:`InferRequest`,
:class:`StatusRequest` or :class:`Ping`; the daemon answers each with exactly one
:class:`Reply`, :class:`StatusReply` or :class:`Pong` carrying the same ``id``. A
:class:`Reply` with ``id`` 0 is addressed to the connection itself: ``error`` refuses it
(allow-list, a full connection cap), ``invalid`` ends a stream that cannot be trusted; the
daemon then closes it. Connections are pipelined: a client may have
many requests in flight and replies come back in completion order, matched by ``id``
(ids are the client's business; the daemon never interprets them beyond echoing).

Images travel either raw (``pixels``: row-major uint8, ``height`` x ``width`` x ``channels``
with channels 1 = grey or 3 = RGB) or encoded (``encoded``: PNG, BMP or JPEG bytes). The
daemon converts everything to 8-bit greyscale.

A requested mask comes back **bit-packed**: ``numpy.packbits(mask != 0)`` over the row-major
``(height, width)`` of the request image, shape in ``mask_shape``; :func:`unpack_mask` turns
it back into a 0/255 uint8 array. (Bit-packing is what the queue stores, so the daemon's loop
never spends time PNG-encoding.)

The daemon decodes a request with :func:`decode_client_frame` into :class:`InferFrame`: the
same schema, but raw ``pixels`` stay a view of the received frame (copied once, into the
request's payload slot, instead of once more by the decoder). A large raw frame is not even
received into a frame buffer: ``daemon/frontend/raw_frames.py`` finds where its pixels lie in the
body, so that they go from the socket straight into their slot.

Schema evolution: fields are only ever appended, with defaults, so an old client can talk to a
new daemon and vice versa (append to :class:`InferFrame` too). Structs are plain maps (not
``array_like``) so a PLC gateway in another language can build them by name; the image bytes
dominate the cost anyway.
"""

from __future__ import annotations

import fcntl
import struct
from collections.abc import Iterable
from typing import Annotated, Any, Final, Literal

import msgspec
import numpy as np

LENGTH_PREFIX: Final = struct.Struct(">I")
PREFIX_BYTES: Final = LENGTH_PREFIX.size
MAX_FRAME_OVERHEAD: Final = 64 * 1024
"""Bytes a frame may carry beyond the image itself (ids, class names, msgpack framing)."""

RequestId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
ReplyStatus = Literal["ok", "timeout", "overloaded", "invalid", "error"]
STATUSES: Final[tuple[ReplyStatus, ...]] = ("ok", "timeout", "overloaded", "invalid", "error")
PRIORITIES: Final = 8
"""A request's priority is 0 (normal) .. ``PRIORITIES - 1`` (most urgent)."""


RegionId = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
RegionOffset = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
REGION_SEALS: Final = fcntl.F_SEAL_SHRINK
"""Seals a registered memfd must carry: it cannot shrink, so the daemon never reads past its end."""
DESCRIPTOR_BYTE: Final = b"\x00"
"""The byte that carries a region's descriptor (``SCM_RIGHTS``) after :class:`SendDescriptor`."""


class InferRequest(msgspec.Struct, frozen=True, tag="infer", tag_field="type"):
    """One image to inspect. Exactly one of ``pixels`` / ``encoded`` is set.

    ``priority`` (0 normal .. 7 most urgent) and ``deadline_ms`` (from arrival) override the
    part class's configured values when given.
    """

    id: RequestId
    part_class: str = "normal"
    pixels: bytes | None = None
    height: int = 0
    width: int = 0
    channels: int = 1
    encoded: bytes | None = None
    priority: int | None = None
    deadline_ms: int | None = None
    want_mask: bool = False
    region: RegionId = 0
    """Non-zero: the pixels lie in this connection's registered region (:class:`RegisterRegion`)
    at ``offset``, ``height × width × channels`` bytes; ``pixels`` and ``encoded`` stay unset."""
    offset: RegionOffset = 0


class InferFrame(msgspec.Struct, frozen=True, tag="infer", tag_field="type"):
    """An :class:`InferRequest` as the daemon decodes it (:func:`decode_client_frame`).

    The same fields with the same defaults (``tests/protocol/test_wire.py`` keeps the two lists
    identical: append a field to both), but ``pixels`` is a zero-copy ``memoryview`` of the
    received frame rather than a copy of it. The view is valid only until the connection
    reads its next frame into the same buffer: the acceptor copies the pixels into their
    payload slot (or into ``bytes`` for the decode pool) before it reads on.
    """

    id: RequestId
    part_class: str = "normal"
    pixels: memoryview | None = None
    height: int = 0
    width: int = 0
    channels: int = 1
    encoded: bytes | None = None
    priority: int | None = None
    deadline_ms: int | None = None
    want_mask: bool = False
    region: RegionId = 0
    offset: RegionOffset = 0


class StatusRequest(msgspec.Struct, frozen=True, tag="status", tag_field="type"):
    """Ask for the daemon's status snapshot."""

    id: RequestId


class RegisterRegion(msgspec.Struct, frozen=True, tag="register_region", tag_field="type"):
    """Offer the daemon a shared-memory region of ``size`` bytes that requests on this
    connection may then name instead of carrying pixels (the zero-copy path).

    The handshake, because a descriptor can only travel with bytes the daemon reads itself:
    the client sends this frame and nothing more until the daemon answers. The daemon answers
    :class:`SendDescriptor` (it now reads the next byte itself), and the client sends one byte,
    :data:`DESCRIPTOR_BYTE`, carrying the descriptor as ``SCM_RIGHTS`` ancillary data; then
    :class:`RegionReply` says whether the region is registered, and under which ``region`` id.
    A refusal that needs no descriptor (a limit, a bad size) is a :class:`RegionReply` at once,
    and then no byte is sent. The descriptor must be a memfd of at least ``size`` bytes sealed
    with at least :data:`REGION_SEALS` (``F_SEAL_SHRINK``: it can never shrink under the
    daemon's mapping, so reading it can never fault).
    """

    id: RequestId
    size: Annotated[int, msgspec.Meta(ge=1, le=2**62)]


class SendDescriptor(msgspec.Struct, frozen=True, tag="send_descriptor", tag_field="type"):
    """The daemon waits for the descriptor of :class:`RegisterRegion` ``id`` (one byte)."""

    id: int


class Ping(msgspec.Struct, frozen=True, tag="ping", tag_field="type"):
    """The cheapest frame: answered with a :class:`Pong`. A client that sends one as it
    connects has spoken, so the daemon never closes it to make room for others (a silent
    connection may be, when the connection caps are full: ``daemon/frontend/places.py``)."""

    id: RequestId


class Pong(msgspec.Struct, frozen=True, tag="pong", tag_field="type"):
    """The answer to a :class:`Ping`, with its ``id``."""

    id: int


class RegionReply(msgspec.Struct, frozen=True, tag="region_reply", tag_field="type"):
    """The outcome of :class:`RegisterRegion` ``id``: ``status`` ``ok`` with the ``region`` id
    that requests name, or why not (``invalid``: the descriptor or size; ``overloaded``: a
    limit of ``[server]``; ``error``)."""

    id: int
    status: ReplyStatus
    region: int = 0
    error: str = ""


class Timings(msgspec.Struct, frozen=True):
    """Where a request's time went, in milliseconds (daemon clock)."""

    queue_ms: float = 0.0
    """Enqueue to claim by a worker."""
    compute_ms: float = 0.0
    """The worker's forward + post-processing time for the batch this request was in."""
    total_ms: float = 0.0
    """Frame received to reply written."""


Box = tuple[float, float, float, float, float]
"""``(x0, y0, x1, y1, score)`` in input pixels, x1/y1 exclusive."""


class Reply(msgspec.Struct, frozen=True, tag="reply", tag_field="type"):
    """The one answer to an :class:`InferRequest`.

    ``verdict`` is ``"defect"`` or ``"clean"`` when ``status == "ok"`` and empty otherwise;
    ``error`` says why for every other status. ``worker`` names the worker that computed it.
    """

    id: int
    status: ReplyStatus
    verdict: str = ""
    score: float = 0.0
    boxes: list[Box] = []
    mask: bytes | None = None
    mask_shape: tuple[int, int] | None = None
    timings: Timings = Timings()
    worker: str | None = None
    error: str = ""


class WorkerStatus(msgspec.Struct, frozen=True):
    """One worker as ``scratchd status`` shows it; ``state`` is ``ready`` while serving."""

    id: int
    name: str
    pid: int
    state: str
    device: str
    restarts: int
    slot: int = -1
    heartbeat_age_ms: float = 0.0
    batches: int = 0
    requests: int = 0
    model_version: str = ""
    """The model version this worker loaded (changes as a reload replaces workers)."""
    batch_size_mean: float | None = None
    """Mean size of this worker's recent batches (None before its first)."""
    compute_ms_p50: float | None = None
    """Median compute time of its recent batches (wall time on CPU, CUDA events on GPU)."""


class QueueStatus(msgspec.Struct, frozen=True):
    """Queue occupancy: ``depth`` is the number of queued requests per priority 0..7."""

    depth: list[int]
    slots: int
    in_use: int
    in_flight: int


class ClassLatency(msgspec.Struct, frozen=True):
    """One part class's latency over the daemon's sliding window (60 s)."""

    p50_ms: float
    p99_ms: float
    count: int
    deadline_ms: int = 0


class Throughput(msgspec.Struct, frozen=True):
    """Replies per second over the sliding window, in all and per status."""

    rps: float = 0.0
    by_status: dict[str, float] = {}


class DriftStatus(msgspec.Struct, frozen=True):
    """Input drift: KL divergence (nats) of the last ``window`` requests' intensities from
    the training histogram (``samples``: how many the estimate covers)."""

    score: float = 0.0
    threshold: float = 0.15
    over_threshold: bool = False  # never while warming up
    window: int = 0
    samples: int = 0
    warming_up: bool = False  # fewer than drift.min_samples requests in the window


class EntropyStatus(msgspec.Struct, frozen=True):
    """Mean binary entropy of the probability maps (bits) over the last ``window`` answers."""

    bits: float = 0.0
    window: int = 0
    samples: int = 0
    warming_up: bool = False  # fewer than drift.min_samples answers in the window


class StatusReply(msgspec.Struct, frozen=True, tag="status_reply", tag_field="type"):
    """The daemon's status snapshot (the observability work appends fields here)."""

    id: int
    state: str
    pid: int
    uptime_s: float
    backend: str
    workers: list[WorkerStatus]
    queue: QueueStatus
    requests: dict[str, int] = {}
    """Replies sent since start, by status."""
    classes: dict[str, tuple[int, int]] = {}
    """Configured part classes: name -> (priority, deadline_ms)."""
    reloads: int = 0
    """Reloads (SIGHUP / ``scratchd reload``) finished since start, failed ones included."""
    reload_error: str = ""
    """Why the last reload failed; empty when it succeeded (or none happened)."""
    refused_connections: int = 0
    """Connections refused by the ``allowed_uids`` / ``allowed_gids`` allow-list."""
    model_version: str = ""
    """The version of the model the daemon was started with (its metadata)."""
    latency: dict[str, ClassLatency] = {}
    """Per part class with requests in the sliding window."""
    throughput: Throughput = Throughput()
    drift: DriftStatus = DriftStatus()
    entropy: EntropyStatus = EntropyStatus()
    health_port: int = 0
    """The bound /livez /readyz port (the kernel's choice when configured as 0)."""
    metrics_port: int = 0
    """The bound /metrics port."""
    standby: WorkerStatus | None = None
    """The warm spare worker (``workers.standby``), not serving until a worker dies (a CUDA
    pool's first card's; ``standbys`` has every card's)."""
    standbys: list[WorkerStatus] = []
    """Every warm spare: one for a CPU pool, one per card for a CUDA pool."""
    model_views: list[str] = []
    """The test-time views the workers average (config ``model.views``, else the model's)."""
    reload_needs_restart: list[str] = []
    """The changed keys that refused the last reload: only a restart applies them (the
    reload applied nothing; ``reload_error`` says so)."""


ClientMessage = InferRequest | StatusRequest | RegisterRegion | Ping
ClientFrame = InferFrame | StatusRequest | RegisterRegion | Ping
DaemonMessage = Reply | StatusReply | SendDescriptor | RegionReply | Pong

_encoder: Final = msgspec.msgpack.Encoder()
_client_decoder: Final = msgspec.msgpack.Decoder(ClientMessage)
_frame_decoder: Final = msgspec.msgpack.Decoder(ClientFrame)
_daemon_decoder: Final = msgspec.msgpack.Decoder(DaemonMessage)
_loose_decoder: Final = msgspec.msgpack.Decoder()

DecodeError = msgspec.DecodeError
"""Raised for a body that is not valid msgpack or does not match the schema."""


def encode_frame(message: ClientMessage | DaemonMessage) -> bytearray:
    """The length-prefixed frame for ``message``, in a fresh ``bytearray`` that the sender
    writes as it is (no copy to ``bytes``). The buffer is sized for the image up front
    (``encode_into`` truncates it to the message), so a 1 MiB frame is encoded in one pass.
    """
    image = message.pixels or message.encoded if isinstance(message, InferRequest) else None
    return encode_frame_into(
        message, bytearray(PREFIX_BYTES + (len(image) if image else 0) + _SMALL_MESSAGE)
    )


def encode_frame_into(message: ClientMessage | DaemonMessage, buf: bytearray) -> bytearray:
    """Write ``message``'s length-prefixed frame into ``buf`` (its contents replaced: it is
    grown or truncated to the frame) and return ``buf``. ``buf`` must hold at least the
    prefix's bytes; encoding starts after them."""
    _encoder.encode_into(message, buf, PREFIX_BYTES)
    LENGTH_PREFIX.pack_into(buf, 0, len(buf) - PREFIX_BYTES)
    return buf


def encode_frames(messages: Iterable[ClientMessage | DaemonMessage]) -> bytearray:
    """The length-prefixed frames of ``messages``, back to back in one fresh ``bytearray``:
    what ``encode_frame`` gives for each, joined, without a buffer per message (a connection
    writes the replies of one turn of its loop this way, in one write)."""
    buf = bytearray()
    for message in messages:
        start = len(buf)
        _encoder.encode_into(message, buf, start + PREFIX_BYTES)  # pads the prefix's room
        LENGTH_PREFIX.pack_into(buf, start, len(buf) - start - PREFIX_BYTES)
    return buf


_SMALL_MESSAGE: Final = 512
"""Room for everything of a request but its image (the buffer grows if it is not enough)."""


def frame_length(prefix: bytes | bytearray | memoryview) -> int:
    """The body length announced by a 4-byte prefix."""
    (length,) = LENGTH_PREFIX.unpack(prefix)
    return int(length)


def decode_client_message(body: bytes | bytearray | memoryview) -> ClientMessage:
    """Decode a request body; raises :data:`DecodeError` with a readable reason."""
    return _client_decoder.decode(body)


def decode_client_frame(body: bytes | bytearray | memoryview) -> ClientFrame:
    """Decode a request body as the daemon does: like :func:`decode_client_message` (same
    schema), but raw ``pixels`` stay a view into ``body`` (:class:`InferFrame`).

    Whatever the body, the only exception is :data:`DecodeError`: a client controls every
    byte, and msgspec raises others for some (``RecursionError`` for a value nested
    thousands deep, even in a field the schema skips). msgspec has no knob for nesting depth
    or container sizes beyond the schema's own constraints (``RequestId``); every size it
    reads is checked against the body's, so the body's length (the receiver's frame cap)
    bounds the rest."""
    try:
        return _frame_decoder.decode(body)
    except msgspec.DecodeError:
        raise
    except Exception as exc:
        raise DecodeError(_undecodable(exc)) from None


def decode_daemon_message(body: bytes | bytearray | memoryview) -> DaemonMessage:
    """Decode a reply body (client side)."""
    return _daemon_decoder.decode(body)


def decode_loose(body: bytes | bytearray | memoryview) -> Any:
    """Decode any msgpack body without a schema (maps as ``dict``); raises :data:`DecodeError`."""
    return _loose_decoder.decode(body)


def salvage_request_id(body: bytes | memoryview) -> int:
    """The ``id`` of a body that failed typed decoding, if one can be read; else 0.

    Lets the daemon address its ``invalid`` reply to the request a client actually sent,
    so a pipelined client can match it.
    """
    try:
        loose = _loose_decoder.decode(body)
    except Exception:  # DecodeError, RecursionError, …: nothing to salvage
        return 0
    if isinstance(loose, dict):
        rid = loose.get("id")
        if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < 2**63:
            return rid
    return 0


decode_client_frame_raw: Final = _frame_decoder.decode
"""``decode_client_frame`` without its wrapper's Python frame (the daemon's per-request call):
for a malformed body it may raise any exception, which ``decode_failure`` explains."""


def decode_failure(exc: Exception) -> str:
    """Why ``decode_client_frame_raw`` refused a body: what ``decode_client_frame``'s
    :data:`DecodeError` would say for the same exception."""
    return str(exc) if isinstance(exc, DecodeError) else _undecodable(exc)


def _undecodable(exc: Exception) -> str:
    if isinstance(exc, RecursionError):
        return "malformed msgpack: nested too deeply"
    return f"malformed msgpack ({type(exc).__name__})"


def pack_mask(mask: np.ndarray) -> tuple[bytes, tuple[int, int]]:
    """Bit-pack a ``(H, W)`` mask (non-zero = defect) for a :class:`Reply`."""
    if mask.ndim != 2:
        raise ValueError(f"mask must be (H, W), got shape {mask.shape}")
    height, width = mask.shape
    return np.packbits(mask != 0).tobytes(), (int(height), int(width))


def unpack_mask(reply: Reply) -> np.ndarray | None:
    """The reply's mask as uint8 0/255 of the request image's shape, or None."""
    if reply.mask is None or reply.mask_shape is None:
        return None
    height, width = reply.mask_shape
    if len(reply.mask) != (height * width + 7) // 8:
        raise ValueError(
            f"mask of {len(reply.mask)} bytes does not match its shape {height}x{width}"
        )
    bits = np.unpackbits(np.frombuffer(reply.mask, dtype=np.uint8), count=height * width)
    return (bits.reshape(height, width) * np.uint8(255)).astype(np.uint8)
