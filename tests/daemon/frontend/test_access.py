"""SO_PEERCRED lookups on real sockets, and the allow-list decision."""

from __future__ import annotations

import io
import os
import socket
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scratchd.daemon.frontend.access import (
    AccessGate,
    AccessPolicy,
    PeerCredentials,
    peer_credentials,
)
from scratchd.protocol.log import configure, parse_line


def test_peer_credentials_of_a_connected_unix_socket() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        peer = peer_credentials(a)
    assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.getuid(), os.getgid())
    assert set(os.getgroups()) <= {*peer.groups, peer.gid}


def test_credentials_are_those_of_the_connecting_process(tmp_path: object) -> None:
    # A forked child connects after changing its uid: the kernel records the child's ids.
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as another uid")
    path = f"/tmp/scratchd-access-{os.getpid()}.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o666)
    server.listen()
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                    client.connect(path)
                    client.recv(1)
            finally:
                os._exit(0)
        conn, _ = server.accept()
        with conn:
            peer = peer_credentials(conn)
        os.waitpid(pid, 0)
    finally:
        server.close()
        os.unlink(path)
    assert (peer.pid, peer.uid, peer.gid) == (pid, 65534, 65534)
    policy = AccessPolicy.from_lists(uids=[0])
    decision = policy.decide(peer)
    assert not decision.allowed
    assert "uid=65534" in decision.reason and f"pid={pid}" in decision.reason


def test_a_socket_that_is_not_unix_is_refused_not_crashed() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
        decision, peer = AccessPolicy.from_lists(uids=[0]).check(tcp)
    assert not decision.allowed and peer is None
    assert "unreadable" in decision.reason


def test_open_policy_allows_everyone_without_reading_credentials() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
        decision, peer = AccessPolicy().check(tcp)
    assert decision.allowed and peer is None


def test_allowed_by_supplementary_group() -> None:
    peer = PeerCredentials(pid=10, uid=1001, gid=1001, groups=(1001, 44))
    assert AccessPolicy.from_lists(gids=[44]).decide(peer).allowed
    assert not AccessPolicy.from_lists(gids=[45]).decide(peer).allowed
    assert AccessPolicy.from_lists(uids=[1001], gids=[45]).decide(peer).allowed


ids = st.integers(min_value=0, max_value=2**32 - 2)


@given(
    uid=ids,
    gid=ids,
    groups=st.lists(ids, max_size=5),
    allowed_uids=st.frozensets(ids, max_size=4),
    allowed_gids=st.frozensets(ids, max_size=4),
)
def test_decision_matches_the_rule(
    uid: int,
    gid: int,
    groups: list[int],
    allowed_uids: frozenset[int],
    allowed_gids: frozenset[int],
) -> None:
    peer = PeerCredentials(pid=1, uid=uid, gid=gid, groups=tuple(groups))
    decision = AccessPolicy(allowed_uids, allowed_gids).decide(peer)
    expected = (
        (not allowed_uids and not allowed_gids)
        or uid in allowed_uids
        or bool(allowed_gids & {gid, *groups})
    )
    assert decision.allowed == expected
    if not decision.allowed:
        assert f"uid={uid}" in decision.reason


def test_gate_counts_logs_and_tells_the_peer_only_its_own_ids() -> None:
    out = io.StringIO()
    configure(stream=out, journald=False)
    gate = AccessGate.from_config(uids=[os.getuid() + 1], gids=[])
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with a, b:
            refusal = gate.admit(a)
    finally:
        configure(stream=sys.stderr)
    assert refusal is not None and f"uid={os.getuid()}" in refusal
    assert str(os.getuid() + 1) not in refusal, "the allow-list is not the peer's business"
    assert gate.refused == 1
    (line,) = out.getvalue().splitlines()
    fields = parse_line(line)
    assert fields["event"] == "access_refused" and fields["pid"] == str(os.getpid())
    assert AccessGate.from_config(uids=[], gids=[]).admit(None) is None


def test_gate_lets_listed_peers_in() -> None:
    gate = AccessGate.from_config(uids=[], gids=[os.getgid()])
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert gate.admit(a) is None
    assert gate.refused == 0
