"""Large raw frames: where a request body's pixels lie, and the body without them.

The daemon receives a large raw image straight into the payload slot it is served from
(``daemon/frontend/connection.py``, state SLOT). For that it must know, from the body's first bytes,
where the pixels are (:func:`locate_pixels`), and it then decodes the body without them::

    body     │ map │ "type" "infer" │ "id" 7 │ … │ "pixels" │ c6 00 10 00 00 │ 1 MiB │ "height" … │
    decoded  │ map │ "type" "infer" │ "id" 7 │ … │ 00×6     │ c4 00          │ "height" … │
                                                  key no field has: skipped   (the pixels are
                                                  value: an empty bin          in their slot)

:func:`hide_pixels` makes the second from the first's bytes before the pixels (the bytes after
them are received behind it). Decoding that (:func:`decode_without_pixels`) gives the request
with ``pixels`` None and every other field as sent. Anything else (a decode error, whose
message names byte offsets; a status request; a second ``pixels`` key) and the daemon
rebuilds the body as sent (:func:`rebuild_body`) and decodes that the usual way
(``wire.decode_client_frame``), so every reply is the one the whole frame gets. Nothing here
changes the wire format: it reads msgpack as any client writes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, NamedTuple

from scratchd.ipc.queue import Handle
from scratchd.protocol import wire


@dataclass(frozen=True, slots=True)
class SlotLoan:
    """A payload slot lent for one frame's raw pixels: ``view`` is exactly their length."""

    handle: Handle
    view: memoryview


class PixelsAt(NamedTuple):
    """Where a request body's raw ``pixels`` lie, as offsets into the body."""

    key: int  # the key's text, ``pixels``
    header: int  # the value's bin header ...
    start: int  # ... and the first pixel byte after it
    length: int  # pixel bytes
    header_bytes: bytes  # the bin header as sent (for rebuild_body)

    @property
    def hidden_end(self) -> int:
        """Where, in the body ``hide_pixels`` makes, the bytes that followed the pixels go."""
        return self.header + len(_EMPTY_BIN)

    def hidden_length(self, length: int) -> int:
        """The length of the body ``hide_pixels`` makes of a body of ``length`` bytes."""
        return self.hidden_end + length - (self.start + self.length)


PIXELS_KEY: Final = b"pixels"
_STAND_IN_KEY: Final = bytes(len(PIXELS_KEY))  # no field is named so: the decoder skips it
_EMPTY_BIN: Final = b"\xc4\x00"


def _item_sizes() -> tuple[int, ...]:
    """Per msgpack type byte: the whole item's length for scalars (and fixstr), minus the
    number of size bytes for str8..32 and bin8..32, 0 for what locate_pixels does not read
    (containers, extensions)."""
    sizes = [0] * 256
    for t in [*range(0x00, 0x80), *range(0xE0, 0x100)]:  # positive, negative fixint
        sizes[t] = 1
    for t in range(0xA0, 0xC0):  # fixstr
        sizes[t] = 1 + (t & 0x1F)
    fixed = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
    fixed |= {0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}  # nil, bools, floats, uints, ints
    for t, n in fixed.items():
        sizes[t] = 1 + n
    for t, k in {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}.items():  # bin, str
        sizes[t] = -k
    return tuple(sizes)


_ITEM_SIZES: Final = _item_sizes()
_BINS: Final = frozenset({0xC4, 0xC5, 0xC6})
_STRS: Final = frozenset({*range(0xA0, 0xC0), 0xD9, 0xDA, 0xDB})


def _item(b: bytes, p: int) -> tuple[int, int] | None:
    """(first data byte, end) of the msgpack scalar, string or bin at ``p`` whose header
    lies within ``b`` (its data may not); None for anything else."""
    if p >= len(b):
        return None
    size = _ITEM_SIZES[b[p]]
    if size > 0:
        return p + 1, p + size
    start = p + 1 - size
    if size == 0 or start > len(b):
        return None
    return start, start + int.from_bytes(b[p + 1 : start], "big")


def locate_pixels(head: memoryview) -> PixelsAt | None:
    """Where the raw ``pixels`` of a request lie, read from the first bytes of its body
    (``head``): the top-level map's ``pixels`` entry, if it is a bin whose header lies within
    ``head`` and every entry before it has a string key and a scalar, string or bin value
    (a msgspec client writes ``type``, ``id``, ``part_class``, then ``pixels``). None
    otherwise: the caller then receives the frame whole and decodes it as usual."""
    b = bytes(head)
    if not b:
        return None
    if 0x80 <= b[0] <= 0x8F:  # fixmap, map16, map32
        entries, p = b[0] & 0x0F, 1
    elif b[0] in (0xDE, 0xDF) and len(b) >= (k := 3 if b[0] == 0xDE else 5):
        entries, p = int.from_bytes(b[1:k], "big"), k
    else:
        return None
    for _ in range(entries):
        if p >= len(b) or b[p] not in _STRS or (key := _item(b, p)) is None:
            return None
        value = _item(b, key[1])
        if value is None:
            return None
        if key[1] - key[0] == len(PIXELS_KEY) and b.startswith(PIXELS_KEY, key[0]):
            if b[key[1]] not in _BINS:
                return None
            at = key[1], value[0]  # the bin's header, its first byte of data
            return PixelsAt(key[0], at[0], at[1], value[1] - at[1], b[at[0] : at[1]])
        p = value[1]
    return None


def hide_pixels(body: memoryview, at: PixelsAt) -> None:
    """Make ``body[: at.header]`` (a body's bytes before its pixels) the start of a body without
    them: the key renamed to one no field has, its value an empty bin (written at
    ``at.header``); the bytes that followed the pixels go at ``at.hidden_end``. Decoded, the
    result is the request with ``pixels`` None, unless the map has a second ``pixels`` key."""
    body[at.key : at.key + len(PIXELS_KEY)] = _STAND_IN_KEY
    body[at.header : at.hidden_end] = _EMPTY_BIN


def decode_without_pixels(body: memoryview) -> wire.InferFrame | None:
    """Decode a body made by ``hide_pixels`` (its pixels kept elsewhere): the inference
    request, ``pixels`` None; None if it is not one or if its map holds a second ``pixels``
    key (whatever its value: a nil one decodes as None too). Raises ``wire.DecodeError``."""
    message = wire.decode_client_frame(body)
    if not isinstance(message, wire.InferFrame) or message.pixels is not None:
        return None
    if PIXELS_KEY in bytes(body) and "pixels" in wire.decode_loose(body):
        return None
    return message


def rebuild_body(out: memoryview, hidden: memoryview, pixels: memoryview, at: PixelsAt) -> int:
    """Write into ``out`` the body as it was sent, from the one ``hide_pixels`` made of it and
    its pixels; returns its length."""
    after = hidden[at.hidden_end :]
    end = at.start + at.length
    out[: at.header] = hidden[: at.header]
    out[at.key : at.key + len(PIXELS_KEY)] = PIXELS_KEY
    out[at.header : at.start] = at.header_bytes
    out[at.start : end] = pixels
    out[end : end + len(after)] = after
    return end + len(after)
