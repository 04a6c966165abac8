"""``_native.recv_into_exact`` on socketpairs: the buffer is filled exactly, whatever way the
bytes arrive; it stops at EOF, at its timeout, when cancelled and on a socket error, saying
which and how much arrived; signals do not cut it short; it runs without the GIL."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchd.ipc._native import (
    RECV_CANCELLED,
    RECV_EOF,
    RECV_FULL,
    RECV_TIMEOUT,
    recv_into_exact,
)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.setblocking(False)  # as the event loop leaves the daemon's sockets
    yield a, b
    a.close()
    b.close()


def send_later(sock: socket.socket, chunks: list[bytes], pause_s: float, close: bool) -> None:
    def run() -> None:
        for chunk in chunks:
            time.sleep(pause_s)
            sock.sendall(chunk)
        if close:
            sock.shutdown(socket.SHUT_WR)

    threading.Thread(target=run, daemon=True).start()


@settings(max_examples=25, deadline=None)
@given(
    size=st.integers(1, 600_000),
    split=st.integers(0, 600_000),
    cuts=st.lists(st.integers(0, 600_000), max_size=6),
    extra=st.integers(0, 100),
)
def test_the_buffers_are_filled_exactly_and_nothing_past_them_is_read(
    size: int, split: int, cuts: list[int], extra: int
) -> None:
    a, b = socket.socketpair()
    try:
        data = os.urandom(size + extra)
        edges = [0, *sorted({c % size for c in cuts}), size + extra]
        send_later(b, [data[lo:hi] for lo, hi in itertools.pairwise(edges)], 0.001, False)
        first = split % (size + 1)  # buf, then the rest into after (either may be empty)
        buf, after = bytearray(first + 8), bytearray(size - first + 8)
        got, why = recv_into_exact(
            a.fileno(), memoryview(buf)[:first], 5000, bytearray(1), memoryview(after)[:-8]
        )
        assert (got, why) == (size, RECV_FULL)
        assert buf[:first] + after[: size - first] == data[:size]
        assert buf[first:] == after[size - first :] == bytes(8)
        rest = b""
        while len(rest) < extra:  # the bytes after them are still the socket's, in order
            rest += a.recv(extra)
        assert rest == data[size:]
    finally:
        a.close()
        b.close()


def test_a_peer_that_closes_early_gives_what_it_sent_and_eof(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    send_later(b, [b"x" * 70_000, b"y" * 30_000], 0.01, close=True)
    buf = bytearray(1 << 20)
    after = bytearray(10)
    assert recv_into_exact(a.fileno(), buf, 5000, bytearray(1), after) == (100_000, RECV_EOF)
    assert buf[:100_000] == b"x" * 70_000 + b"y" * 30_000 and after == bytes(10)


def test_a_silent_peer_times_out_with_what_it_sent(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """Bytes that come while the timeout runs are taken (it does not give up while the peer
    is quiet), then it returns what came; with a timeout of 0, only what the socket holds."""
    a, b = pair
    b.sendall(b"z" * 10)
    send_later(b, [b"y" * 5], 0.01, close=False)  # well within the timeout
    buf = bytearray(100)
    assert recv_into_exact(a.fileno(), buf, 500, bytearray(1)) == (15, RECV_TIMEOUT)
    assert buf[:15] == b"z" * 10 + b"y" * 5
    b.sendall(b"x" * 3)
    assert recv_into_exact(a.fileno(), bytearray(100), 0, bytearray(1)) == (3, RECV_TIMEOUT)
    assert recv_into_exact(a.fileno(), bytearray(100), 0, bytearray(1)) == (0, RECV_TIMEOUT)


def test_a_cancel_from_another_thread_stops_it_and_the_gil_is_free_meanwhile(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """A cancel set while it waits ends the wait with what came and RECV_CANCELLED, not at the
    10 s timeout (RECV_TIMEOUT); the canceller is Python, so it ran while the GIL was free."""
    a, b = pair
    b.sendall(b"q" * 1000)
    cancel = bytearray(1)

    def canceller() -> None:  # runs only if the receiving thread has let go of the GIL
        time.sleep(0.05)  # the receiver is waiting for more by then
        cancel[0] = 1

    thread = threading.Thread(target=canceller)
    thread.start()
    assert recv_into_exact(a.fileno(), bytearray(4096), 10_000, cancel) == (1000, RECV_CANCELLED)
    thread.join()
    # Cancelled before it starts: nothing is read, the bytes stay in the socket.
    b.sendall(b"w")
    assert recv_into_exact(a.fileno(), bytearray(1), 1000, bytearray(b"\x01")) == (
        0,
        RECV_CANCELLED,
    )
    assert a.recv(1) == b"w"


def test_signals_do_not_cut_it_short(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    hits: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda signum, frame: hits.append(signum))
    result: list[tuple[int, int]] = []
    buf = bytearray(300_000)
    try:
        receiver = threading.Thread(
            target=lambda: result.append(recv_into_exact(a.fileno(), buf, 10_000, bytearray(1)))
        )
        receiver.start()
        data = os.urandom(len(buf))
        for k in range(10):  # the receiver waits in poll between chunks: interrupt it there
            time.sleep(0.01)
            assert receiver.ident is not None
            signal.pthread_kill(receiver.ident, signal.SIGUSR1)
            b.sendall(data[k * 30_000 : (k + 1) * 30_000])
        receiver.join(10)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert result == [(len(buf), RECV_FULL)] and buf == data
    assert hits  # the signals were delivered (the handler ran in the main thread)


def test_a_socket_error_is_returned_as_its_errno() -> None:
    with tempfile.TemporaryFile() as f:  # not a socket
        got, why = recv_into_exact(f.fileno(), bytearray(8), 100, bytearray(1))
    assert (got, why) == (0, 88)  # ENOTSOCK
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    assert recv_into_exact(r, bytearray(8), 100, bytearray(1)) == (0, 9)  # EBADF


def test_a_read_only_buffer_and_bad_arguments_are_refused(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, _ = pair
    with pytest.raises(TypeError):
        recv_into_exact(a.fileno(), b"read only", 10, bytearray(1))
    with pytest.raises(TypeError):
        recv_into_exact(a.fileno(), memoryview(bytearray(4)).toreadonly(), 10, bytearray(1))
    with pytest.raises(TypeError):
        recv_into_exact(a.fileno(), bytearray(4), 10, b"\x00")
    with pytest.raises(ValueError, match="timeout_ms"):
        recv_into_exact(a.fileno(), bytearray(4), -1, bytearray(1))
    with pytest.raises(ValueError, match="cancel"):
        recv_into_exact(a.fileno(), bytearray(4), 10, bytearray(0))
    with pytest.raises(BufferError):
        recv_into_exact(a.fileno(), bytearray(4), 10, bytearray(1), b"read only")
