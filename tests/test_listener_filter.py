"""The socket filters of unisleep/transfer/listener_guard.py on real loopback sockets: the
narrowing filter lets through exactly the sources it lists (IPv4 and IPv6), and the drop-all one
nothing, while a connection made before either is attached keeps working."""

from __future__ import annotations

import socket

import pytest

from unisleep.transfer.listener_guard import MAX_ADMITTED, _attach, admit_only, drop_all


def _bound(fam, host):
    s = socket.socket(fam)
    s.bind((host, 0))
    s.settimeout(1.3)  # a dropped SYN is retried after about 1 s: one try is enough to see it
    return s


def _reaches(s, addr) -> bool:
    try:
        s.connect(addr)
        return True
    except OSError:
        return False
    finally:
        s.close()


@pytest.mark.parametrize("fam,host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_admit_only_lets_through_the_listed_sources_only(fam, host):
    try:
        lst = socket.socket(fam)
        lst.bind((host, 0))
    except OSError as e:
        pytest.skip(f"no {host} on this machine: {e}")
    lst.listen(8)
    addr = lst.getsockname()[:2]
    before = socket.create_connection(addr[:2])  # made before the filter: untouched
    member, stranger = _bound(fam, host), _bound(fam, host)
    others = [("10.1.2.3", 80), ("::2", member.getsockname()[1]), ("127.0.0.2", member.getsockname()[1])]
    _attach(lst, admit_only(others + [(host, member.getsockname()[1])]))
    assert not _reaches(stranger, addr)
    assert _reaches(member, addr)
    drop_all(lst)
    assert not _reaches(_bound(fam, host), addr)
    peer, _ = lst.accept()
    before.sendall(b"x")
    assert peer.recv(1) == b"x"
    lst.close()


def test_admit_only_refuses_more_sources_than_its_jumps_reach():
    admit_only([("::1", p) for p in range(1, MAX_ADMITTED + 1)])  # the longest: IPv6, 10 instructions each
    with pytest.raises(ValueError, match=f"at most {MAX_ADMITTED} sources"):
        admit_only([("127.0.0.1", p) for p in range(1, MAX_ADMITTED + 2)])
