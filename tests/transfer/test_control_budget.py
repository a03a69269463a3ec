"""What one colocated update costs besides its bytes, counted rather than timed (the time depends on
the machine; the count does not): rank 0's store is a thread of the trainer's process, so every
request a receiver sends it waits for that process's interpreter lock, and rank 0's own writes
must not need that thread to answer; the backend registry reads every installed distribution's
metadata, so no step of an update may ask it again.  Each path has one control plane: the
acknowledgement, go and done of the IPC path and of the Unix-stream path (the collective path on
one machine, whose stream socket comes over the IPC connection) travel on the receiver's IPC
connection.

A sender and a receiver on two threads of this process (real store, real memfd and Unix sockets),
each update's steps counted once both sides are connected."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import pytest
import torch

from unisleep.transfer import TransferGroup, WeightReceiver, WeightSender
from unisleep.transfer import store as S

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from faults import FaultySender  # noqa: E402

#: store requests per update from a receiver connected to the IPC socket, by path — none: the
#: header comes on the IPC connection too, with the acknowledgement, go and done (there were 5:
#: the header fetched twice, the acknowledgement, go, done; then 1: a WATCH answered with the header)
STORE_REQUESTS = {"ipc": 0, "collective": 0}
#: and from the sender — writing the header (there were 5: the header, and dropping the last
#: update's go, abort, acknowledgement and done, which such an update never writes)
SENDER_STORE_REQUESTS = {"ipc": 1, "collective": 1}
#: sealed control messages per update on a receiver's IPC connection (besides the buckets' own:
#: bucket, free, buf, stream, end): acknowledgement, go, done — and the header the sender sends
CONTROL_MESSAGES = {"ipc": 3, "collective": 3}
HEADER_MESSAGES = 1
UPDATES = 4


def _pair():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    out = {}
    ts = [threading.Thread(target=lambda r=r: out.__setitem__(r, TransferGroup.create(addr, r, 2, platform="host",
                                                                                        timeout_s=20)))
          for r in (0, 1)]
    [t.start() for t in ts]
    [t.join(30) for t in ts]
    return out[0], out[1]


def _key(payload: bytes) -> str:
    op = payload[0]
    if op == S.SET or op == S.CAS:
        return payload[3: 3 + S.U16.unpack_from(payload, 1)[0]].decode()
    if op == S.ADD:
        return payload[9:].decode()
    if op == S.WATCH:
        return payload[1 + S.W.size:].decode()
    if op == S.GET or op == S.AGE:
        return payload[5:].decode()
    if op == S.CHECK:
        return payload[3:].decode(errors="replace")
    return payload[1:].decode(errors="replace")


class _Spy:
    """Counts the requests of a member's store connection: every request except the liveness
    checks a long wait makes (a WATCH that ran out unanswered, asking how long ago a heartbeat beat, the
    sender looking for an answer in the store that is not there, which a slow machine may do while
    a receiver works)."""

    def __init__(self, store):
        self.requests: list[tuple[int, str]] = []
        self._call = store._call

        def call(payload: bytes) -> bytes:
            answer = self._call(payload)
            op, key = payload[0], _key(payload)
            if not ((op == S.WATCH and answer[0] == S.MISSING) or (op == S.AGE and key.startswith("hb/"))
                    or (op == S.CHECK and answer[1:2] == b"\0")):
                self.requests.append((op, key))
            return answer

        store._call = call


class _Messages:
    """Counts the sealed messages sent on the IPC connections, by operation."""

    def __init__(self, monkeypatch):
        import collections

        from unisleep.transfer import ipc

        self.ops: collections.Counter = collections.Counter()
        real = ipc.send_sealed

        def send_sealed(sock, key, ctx, op, *a, **k):
            self.ops[op] += 1
            return real(sock, key, ctx, op, *a, **k)

        monkeypatch.setattr(ipc, "send_sealed", send_sealed)


class _Wakes:
    """Counts how often another thread had to wake rank 0's store thread."""

    def __init__(self, server):
        self.n = 0
        real = server._wake_w

        class W:
            def send(_self, data):
                self.n += 1
                return real.send(data)

            def __getattr__(_self, name):
                return getattr(real, name)

        server._wake_w = W()


@pytest.mark.parametrize("path", ["ipc", "collective"])
def test_a_colocated_update_costs_one_store_request_and_no_registry_lookup(path, monkeypatch):
    import unisleep.registry as reg

    g0, g1 = _pair()
    try:
        got = {}
        rx = WeightReceiver(g1, apply=lambda pairs: got.update((n, t.clone()) for n, t in pairs))
        tx = WeightSender(g0, bucket_bytes=1 << 16, path=path)  # collective on one machine: the Unix socket
        weights = {f"layer.{i}": torch.full((3000 + i,), float(i)) for i in range(6)}  # several buckets

        def update(v):
            errs = []
            t = threading.Thread(target=lambda: errs.append(rx.receive()))
            t.start()
            deadline = time.monotonic() + 5
            # the receiver waits for the header: in the store, or (connected) on its IPC connection,
            # where the header waits for it if it comes late
            while not (g0._server._waiters or rx._ready) and time.monotonic() < deadline:
                time.sleep(0.001)
            tx.send(weights, v)
            t.join(30)
            assert errs and not isinstance(errs[0], Exception), errs

        update(1)  # connects
        assert tx.resolve()[1] in ("ipc", "socket")
        update(2)
        reads = []
        real = reg._entry_points
        monkeypatch.setattr(reg, "_entry_points", lambda: reads.append(1) or real())
        spy, spy0, wakes, msgs = _Spy(g1.store), _Spy(g0.store), _Wakes(g0._server), _Messages(monkeypatch)
        for v in range(3, 3 + UPDATES):
            update(v)
        assert not reads, f"the backend registry read the installed distributions {len(reads)} times in {UPDATES} updates"
        assert len(spy.requests) <= STORE_REQUESTS[path] * UPDATES, (
            f"{len(spy.requests)} store requests in {UPDATES} updates (budget {STORE_REQUESTS[path]} each): "
            f"{spy.requests}")
        assert len(spy0.requests) <= SENDER_STORE_REQUESTS[path] * UPDATES, (
            f"the sender made {len(spy0.requests)} store requests in {UPDATES} updates (budget "
            f"{SENDER_STORE_REQUESTS[path]} each): {spy0.requests}")
        control = sum(n for op, n in msgs.ops.items() if op in ("ack", "go", "done", "error"))
        assert control == CONTROL_MESSAGES[path] * UPDATES, f"{control} control messages in {UPDATES} updates: {msgs.ops}"
        assert msgs.ops["hdr"] == HEADER_MESSAGES * UPDATES, f"headers on the IPC connection: {msgs.ops}"
        assert wakes.n == 0, f"rank 0's own writes woke its store thread {wakes.n} times in {UPDATES} updates"
        assert all(torch.equal(got[k], t) for k, t in weights.items()) and rx.version == 2 + UPDATES
    finally:
        g0.close(), g1.close()


@pytest.mark.parametrize("path", ["ipc", "collective"])
def test_refusals_call_offs_and_rejections_leave_the_control_plane_in_step(path):
    """A receiver's refusal, the sender's call-off (or abort) and a rejected update travel on the
    path's control plane — the IPC connection, for the IPC path and the Unix stream alike (no
    acknowledgement or go goes through the store) — each side raises the named error, and the next
    update lands."""
    from unisleep.errors import InvalidTransitionError, TransferError

    g0, g1 = _pair()
    try:
        awake = {"on": True}
        got = {}
        rx = WeightReceiver(g1, apply=lambda pairs: got.update((n, t.clone()) for n, t in pairs),
                            guard=lambda: awake["on"])
        tx = FaultySender(g0, bucket_bytes=1 << 16, path=path)
        weights = {f"layer.{i}": torch.full((3000 + i,), float(i)) for i in range(6)}
        specs = [(k, tuple(t.shape), "float32") for k, t in weights.items()]

        def both(send):
            out = {}
            t = threading.Thread(target=lambda: out.__setitem__("r", _catch(rx.receive)))
            t.start()
            out["s"] = _catch(send)
            t.join(30)
            return out["s"], out["r"]

        def failing():
            yield "layer.0", weights["layer.0"]
            raise RuntimeError("the trainer's generator failed")

        s, r = both(lambda: tx.send(weights, 1))
        assert not isinstance(r, Exception), r
        spy = _Spy(g1.store)
        awake["on"] = False
        s, r = both(lambda: tx.send(weights, 2))  # refused by the receiver's guard
        assert isinstance(s, InvalidTransitionError) and "nothing was sent" in str(s), s
        assert isinstance(r, InvalidTransitionError), r
        awake["on"] = True
        s, r = both(lambda: tx.send(failing(), 3, specs=specs))  # called off (ipc: first bucket) or aborted
        assert isinstance(s, TransferError) and "generator failed" in str(s), s
        assert isinstance(r, TransferError) and "generator failed" in str(r), r
        tx.corrupt = {1}
        s, r = both(lambda: tx.send(weights, 4))  # rejected: a bucket altered on the way
        tx.corrupt = set()
        assert isinstance(s, TransferError) and "rejected" in str(s) and "corrupt" in str(s), s
        assert isinstance(r, TransferError) and rx.version == 1, r
        in_store = [k for op, k in spy.requests if "/ack/" in k or k.endswith("/go")]
        assert not in_store, spy.requests  # the control plane is the IPC connection
        s, r = both(lambda: tx.send(weights, 5))
        assert not isinstance(s, Exception) and not isinstance(r, Exception), (s, r)
        assert rx.version == 5 and all(torch.equal(got[k], t) for k, t in weights.items())
    finally:
        g0.close(), g1.close()


def _catch(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return e


def test_a_new_receiver_object_or_an_out_of_step_connection_costs_one_update_at_most():
    """A second receiver object of the same rank (no connection of its own) connects and answers
    there; the sender, waiting on the first object's connection, admits the new one in its place
    and reads the answer from it (the store carries no answer of the IPC path).  A word out of step on a connection closes it and fails that update at
    once on both sides, named (not after the group's timeout); the next one lands."""
    from unisleep.errors import TransferError

    g0, g1 = _pair()
    try:
        got = {}
        rx = WeightReceiver(g1, apply=lambda pairs: got.update((n, t.clone()) for n, t in pairs))
        tx = WeightSender(g0, bucket_bytes=1 << 16, path="ipc")
        weights = {f"layer.{i}": torch.full((3000 + i,), float(i)) for i in range(6)}

        def both(rx_, v):
            out = {}
            t = threading.Thread(target=lambda: out.__setitem__("r", _catch(rx_.receive)))
            t.start()
            deadline = time.monotonic() + 5
            # the receiver waits for the header: in the store, or (connected) on its IPC connection,
            # where the header waits for it if it comes late
            while not (g0._server._waiters or rx._ready) and time.monotonic() < deadline:
                time.sleep(0.001)
            t0 = time.monotonic()
            out["s"] = _catch(lambda: tx.send(weights, v))
            dt = time.monotonic() - t0
            t.join(30)
            return out["s"], out["r"], dt

        s, r, _ = both(rx, 1)
        assert not isinstance(r, Exception) and not isinstance(s, Exception), (s, r)
        rx2 = WeightReceiver(g1, apply=lambda pairs: got.update((n, t.clone()) for n, t in pairs))
        rx2.version = rx.version
        s, r, dt = both(rx2, 2)  # the first object's connection stays open, silent
        assert isinstance(s, TransferError) and "metadata" in str(s), s  # it never had the specs: resend them
        assert dt < 5, f"the sender took {dt:.1f} s to hear the refusal"
        s, r, _ = both(rx2, 3)
        assert not isinstance(r, Exception) and not isinstance(s, Exception), (s, r)
        assert rx2.version == 3
        rx2._conn.send("done", u=99, ok=True)  # a word no update expects
        s, r, dt = both(rx2, 4)
        assert isinstance(s, TransferError) and "sent 'done' (update 99)" in str(s), s
        assert isinstance(r, TransferError) and rx2.version == 3, r
        assert dt < 5, f"the sender took {dt:.1f} s to notice"
        s, r, _ = both(rx2, 5)
        assert not isinstance(r, Exception) and not isinstance(s, Exception), (s, r)
        assert rx2.version == 5
        # the same word read before the receiver even took the header: the receiver keeps a
        # connection the sender has closed, and must see that and connect again
        rx2._conn.send("done", u=99, ok=True)
        s = _catch(lambda: tx.send(weights, 6))
        assert isinstance(s, TransferError) and "sent 'done' (update 99)" in str(s), s
        s, r, _ = both(rx2, 7)
        assert not isinstance(r, Exception) and not isinstance(s, Exception), (s, r)
        assert rx2.version == 7 and all(torch.equal(got[k], t) for k, t in weights.items())
    finally:
        g0.close(), g1.close()


def test_a_header_too_long_for_an_ipc_message_is_read_from_the_store(monkeypatch):
    """A connected receiver takes the header from its IPC connection; one whose specs do not fit a
    message (a long list of names) is announced there as "read the store", and the receiver reads
    it there: every update lands, the long one with one store request."""
    g0, g1 = _pair()
    try:
        got = {}
        rx = WeightReceiver(g1, apply=lambda pairs: got.update((n, t.clone()) for n, t in pairs))
        tx = WeightSender(g0, bucket_bytes=1 << 16, path="ipc")
        short = {f"layer.{i}": torch.full((300,), float(i)) for i in range(3)}
        long = {f"model.layers.{i}.self_attn.q_proj.weight.{'x' * 40}": torch.full((4,), float(i)) for i in range(80)}

        def update(weights, v):
            errs = []
            t = threading.Thread(target=lambda: errs.append(rx.receive()))
            t.start()
            deadline = time.monotonic() + 5
            while not (g0._server._waiters or rx._ready) and time.monotonic() < deadline:
                time.sleep(0.001)
            tx.send(weights, v)
            t.join(30)
            assert errs and not isinstance(errs[0], Exception), errs

        update(short, 1)  # connects
        spy, msgs = _Spy(g1.store), _Messages(monkeypatch)
        update(short, 2)
        assert not spy.requests and msgs.ops["hdr"] == 1, (spy.requests, msgs.ops)
        update(long, 3)
        assert [k for _, k in spy.requests] == ["hdr"] and msgs.ops["hdr"] == 2, (spy.requests, msgs.ops)
        update(short, 4)
        assert [k for _, k in spy.requests] == ["hdr"], spy.requests
        assert rx.version == 4 and all(torch.equal(got[k], t) for k, t in {**short, **long}.items())
    finally:
        g0.close(), g1.close()
