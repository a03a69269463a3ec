"""The group's store (unisleep/transfer/store.py) on 127.0.0.1: who may use it and its limits."""

from __future__ import annotations

import socket
import time

import pytest

from unisleep.transfer import store as S
from unisleep.transfer.group import listen_socket

KEY = b"k" * 32


@pytest.fixture
def server():
    lis = listen_socket("127.0.0.1", 0)
    srv = S.StoreServer(lis, KEY, world_size=3, on_intrusion=seen.append)
    yield srv
    srv.close()


seen: list = []


def _connect(srv, key=KEY, rank=1):
    host, port = srv.address
    return S.RemoteStore.connect(host, port, key, rank, timeout_s=5)


def test_members_read_write_add_check_delete(server):
    a, b = _connect(server, rank=1), _connect(server, rank=2)
    a.set("x", b"1234")
    assert b.fetch("x") == b"1234" and b.get("x") == b"1234" and b.fetch("nope") is None
    assert a.add("n", 5) == 5 and b.add("n", -2) == 3 and b.fetch("n") == b"3"
    assert a.check(["x", "n"]) and not a.check(["x", "nope"])
    assert b.delete_key("x") and not b.delete_key("x") and a.num_keys() == 1
    assert a.compare_set("c", b"", b"v1") == b"v1" and a.compare_set("c", b"zz", b"v2") == b"v1"
    p = a.prefixed("pg0")
    p.set("0", b"addr")
    assert b.fetch("pg0/0") == b"addr" and p.get("0") == b"addr"
    local = S.LocalStore(server, 5)
    assert local.fetch("pg0/0") == b"addr"


@pytest.mark.slow
def test_limits(server):
    a = _connect(server)
    with pytest.raises(S.StoreLimitError, match="over the store's limit"):
        a.set("big", b"z" * (S.MAX_VALUE + 1))
    a.set("hdr", b"z" * (1 << 20))
    with pytest.raises(S.RecordTooLargeError) as e:  # its size, not its bytes
        a.fetch("hdr", limit=4096)
    assert e.value.size == 1 << 20
    with pytest.raises(S.StoreLimitError, match="not hold a counter"):
        a.add("hdr", 1)
    for i in range(S.MAX_TOTAL // S.MAX_VALUE):
        a.set(f"v{i}", b"z" * S.MAX_VALUE)
    with pytest.raises(S.StoreLimitError, match="over its limit"):
        a.set("one-more", b"z" * S.MAX_VALUE)
    with pytest.raises(S.StoreLimitError, match="longer than"):
        a.set("k" * (S.MAX_KEY + 1), b"")


@pytest.mark.slow
def test_strangers_are_refused_and_bounded(server):
    seen.clear()
    with pytest.raises(S.StoreAuthError, match="authentication"):
        _connect(server, key=b"other" * 8)
    _until(lambda: any("proof of the group secret is wrong" in m for m in seen))
    host, port = server.address
    held = [socket.create_connection((host, port)) for _ in range(3 * S.MAX_PENDING)]
    time.sleep(0.5)
    assert server.open_connections <= S.MAX_PENDING
    a = _connect(server)  # a member still gets in
    a.set("ok", b"1")
    _until(lambda: any(f"{S.MAX_PENDING} newer connections" in m for m in seen))
    for s in held:
        s.close()


def _until(cond, timeout_s: float = 5.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, seen
        time.sleep(0.01)


def test_a_member_rank_out_of_range_is_refused(server):
    with pytest.raises(S.StoreAuthError):
        _connect(server, rank=3)


@pytest.mark.slow
def test_watch_answers_when_the_key_changes(server):
    """A reader waiting for a key is answered as soon as another member (or rank 0 itself) sets
    it — no polling — and a value it has seen already does not answer again."""
    import threading

    a, b = _connect(server, rank=1), _connect(server, rank=2)
    local = S.LocalStore(server, 5)
    ver, v = a.watch("w", wait_s=0.05)
    assert v is None
    for writer in (b, local):
        t = threading.Timer(0.2, lambda w=writer: w.set("w", b"%d" % time.monotonic_ns()))
        t0 = time.monotonic()
        t.start()
        ver, v = a.watch("w", after=ver, wait_s=5)
        dt = time.monotonic() - t0
        assert v is not None and 0.15 < dt < 1.0, dt
        t.join()
    t0 = time.monotonic()
    same, v2 = a.watch("w", after=ver, wait_s=0.3)  # unchanged: answered when the wait is over
    assert v2 is None and same == ver and 0.25 < time.monotonic() - t0 < 1.5
    t = threading.Timer(0.2, lambda: a.set("w", b"again"))
    t.start()
    ver2, v3 = local.watch("w", after=ver, wait_s=5)  # rank 0 waits on the table itself
    assert v3 == b"again" and ver2 > ver
    t.join()


def test_age_is_the_time_since_the_key_last_changed_by_the_stores_clock(server):
    """AGE: how long ago a key changed, measured where it changed — a member's heartbeat silence
    does not depend on when another member last looked (the transfer group's liveness)."""
    a, local = _connect(server), S.LocalStore(server, 5)
    assert a.aged("hb/1") is None
    a.add("hb/1", 1)
    time.sleep(0.6)
    for st in (a, local):
        age, v = st.aged("hb/1")
        assert 0.55 < age < 5.0 and v == b"1", (age, v)
    a.add("hb/1", 1)
    age, v = a.prefixed("hb").aged("1")
    assert age < 0.5 and v == b"2", (age, v)  # the change set it back
    a.set("big", b"z" * 100)
    with pytest.raises(S.RecordTooLargeError) as e:  # its size, not its bytes
        a.aged("big", limit=10)
    assert e.value.size == 100


def test_the_previous_loopback_secret_is_refused_quietly_a_wrong_one_is_not():
    """A member holding the secret of the group this one replaced is refused without an intrusion
    report (it re-reads the loopback file); any other wrong proof is still reported."""
    got: list = []
    srv = S.StoreServer(listen_socket("127.0.0.1", 0), KEY, world_size=3, on_intrusion=got.append,
                        stale_key=b"s" * 32)
    try:
        with pytest.raises(S.StoreAuthError, match="authentication"):
            _connect(srv, key=b"s" * 32)
        time.sleep(0.5)
        assert not got, got
        with pytest.raises(S.StoreAuthError, match="authentication"):
            _connect(srv, key=b"other" * 8)
        _until(lambda: any("proof of the group secret is wrong" in m for m in got))
        _connect(srv).close()
    finally:
        srv.close()
