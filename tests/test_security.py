"""Attacks on a weight-transfer group, by a process running as another user (uid 65534 through
``setpriv``), while a real update goes on: a forged record planted in the store (a pickle that
would create a marker file, random bytes, a well-formed record under a wrong key), a race to
connect first to the colocated IPC socket claiming a rank, and garbage on that socket.  Each time
the update lands byte-exact, the intruder gets no descriptor, the marker file stays absent, and
the group names the intrusion.  Also: a loopback group listens on loopback addresses only, a
non-loopback group without a secret is refused, and records are fixed-schema and authenticated.

The attacks need root (to switch to uid 65534) and ``setpriv`` (util-linux); without them they
skip, saying which is missing.  All traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import threading
import time

import pytest
import torch

from unisleep.errors import InvalidArgumentError, TransferError
from unisleep.transfer import TransferGroup, WeightReceiver, WeightSender
from unisleep.transfer import records as R

from nobody import NOBODY, ROOT
from nobody import as_nobody as _as_nobody
from nobody import nobody_env as _nobody_env
from nobody import skip_without_nobody as _skip_without_nobody


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pair(name: str = "default", timeout_s: float = 30):
    addr = f"tcp://127.0.0.1:{_port()}"
    out: dict = {}

    def mk(r):
        try:
            out[r] = TransferGroup.create(addr, r, 2, platform="host", timeout_s=timeout_s, name=name)
        except Exception as e:  # noqa: BLE001
            out[r] = e

    ts = [threading.Thread(target=mk, args=(r,)) for r in (0, 1)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    for r in (0, 1):
        if isinstance(out.get(r), Exception):
            raise out[r]
    return out[0], out[1]


class _Bg(threading.Thread):
    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None
        self.start()

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001
            self.error = e


def _weights(v: int) -> dict:
    g = torch.Generator().manual_seed(v)
    return {"w": torch.randn(256, 1024, generator=g), "b": torch.randn(33, generator=g).to(torch.bfloat16),
            "steps": torch.arange(5) * v}


def _exact(tgt: dict, want: dict) -> bool:
    return all(torch.equal(tgt[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)) for k in want)


def _rest(p: subprocess.Popen, timeout_s: float = 60) -> tuple[str, str]:
    """The rest of a child's stdout (after lines read with ``readline``, which may have buffered
    more than one line: ``communicate`` would miss those) and its stderr, once it exits."""
    err: list = []
    t = threading.Thread(target=lambda: err.append(p.stderr.read()), daemon=True)
    t.start()
    out = p.stdout.read()
    p.wait(timeout_s)
    t.join(timeout_s)
    return out, err[0] if err else ""


def _wait(cond, timeout_s: float, what: str):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


# ---------------------------------------------------------------------------- the store
STORE_INTRUDER = r"""
import datetime, os, pickle, socket, sys, time, json
import torch.distributed as dist
from unisleep.transfer import records as R
host, port, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]

class Boom:
    def __reduce__(self):
        return (os.system, ("touch " + marker,))

body = {"version": 999, "previous_version": None, "meta_id": "ab", "specs": [["w", [1], "float32"]],
        "bucket_bytes": 64, "path": "collective", "buckets": 1, "bytes": 4, "ipc": None, "verify": False}
planted = {
    "pickle": pickle.dumps(Boom()),
    "garbage": os.urandom(300),
    "forged": R.seal(os.urandom(32), "default/00", "hdr", 5, 0, body),
}
out = {"uid": os.getuid(), "planted": [], "refused": []}
try:  # torch's store protocol
    st = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=5))
    for what, raw in planted.items():
        st.set("hdr", raw)
        st.set("u0/ack/1", raw)
        out["planted"].append(what)
except Exception as e:
    out["refused"].append(f"TCPStore: {type(e).__name__}")
for what, raw in planted.items():  # the raw bytes, as the answer to the store's greeting
    try:
        s = socket.create_connection((host, port), timeout=5)
        s.sendall(raw)
        left = s.recv(1 << 16)
        while left:
            left = s.recv(1 << 16)
        out["refused"].append(what)
    except OSError as e:
        out["refused"].append(f"{what}: {e}")
print(json.dumps(out), flush=True)
"""


@pytest.mark.slow
def test_forged_store_records_are_refused_and_the_update_lands(tmp_path):
    """A process of another user cannot use the group's store at all (its connections are refused
    and named); the same values planted through a connection that can write there (what an
    ``insecure=True`` group, whose key is public, would allow) are refused by the record layer.
    The update lands byte-exact and no pickle runs."""
    _skip_without_nobody()
    g0, g1 = _pair()
    marker = tmp_path / "intruder-ran-code"
    try:
        tgt = {k: torch.zeros_like(v) for k, v in _weights(0).items()}
        rx = _Bg(lambda: WeightReceiver(g1, target=tgt).receive(timeout_s=60))
        intruder = subprocess.run(_as_nobody(["-c", STORE_INTRUDER, "127.0.0.1", str(g0.port), str(marker)]),
                                  env=_nobody_env(), capture_output=True, text=True, timeout=120)
        assert intruder.returncode == 0, intruder.stderr[-2000:]
        got = json.loads(intruder.stdout.strip().splitlines()[-1])
        assert got["uid"] == NOBODY and not got["planted"], got
        assert any(f"uid {NOBODY}" in m for m in g0.intrusions), g0.intrusions
        for raw in (pickle.dumps(_Boom(str(marker))), os.urandom(300),
                    R.seal(os.urandom(32), "default/00", "hdr", 5, 0, {"version": 999})):
            g0.store.set("hdr", raw)
            g0.store.set("u0/ack/1", raw)
            time.sleep(0.3)
        _wait(lambda: len([m for m in g1.intrusions if "'hdr'" in m]) >= 1, 10,
              "the receiver to notice the planted records")
        tx = WeightSender(g0, bucket_bytes=64 << 10, path="collective")
        rep = tx.send(_weights(1), 1)
        rx.join(60)
        assert rx.error is None, rx.error
        assert rep.version == 1 and rx.result.version == 1
        assert _exact(tgt, _weights(1)), "the update did not land byte-exact"
        assert not marker.exists(), "a pickle planted in the store ran code in the receiver"
        named = " | ".join(g1.intrusions)
        assert "fails authentication" in named or "no valid record header" in named, named
        assert any("'hdr'" in m for m in g1.intrusions), g1.intrusions
    finally:
        g0.close(), g1.close()


class _Boom:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, ("touch " + self.marker,))


# ---------------------------------------------------------------------------- the IPC socket
IPC_INTRUDER = r"""
import json, os, socket, sys, time, pickle
name = sys.argv[1]
out = {"uid": os.getuid(), "connected": False, "fds": 0, "data": 0}
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.settimeout(20)
try:
    s.connect("\0" + name)
    out["connected"] = True
    print(json.dumps({"connected": True}), flush=True)
    for msg in (json.dumps({"op": "proof", "rank": 1}).encode(), pickle.dumps({"rank": 1}), os.urandom(512)):
        try:
            s.send(msg)
        except OSError as e:
            out["send_error"] = str(e)
    while True:
        data, fds, _f, _a = socket.recv_fds(s, 1 << 16, 8)
        out["fds"] += len(fds)
        if not data:
            break
        out["data"] += 1
except OSError as e:
    out["error"] = str(e)
print(json.dumps(out), flush=True)
"""


def _abstract_names(prefix: str) -> set:
    names = set()
    with open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            if len(parts) >= 8 and parts[-1].startswith("@" + prefix):
                names.add(parts[-1][1:])
    return names


@pytest.mark.slow
@pytest.mark.parametrize("staged", [True, False])
def test_ipc_socket_admits_only_the_receiver(staged):
    _skip_without_nobody()
    g0, g1 = _pair()
    try:
        prefix = f"unisleep-transfer-{os.getpid()}-"
        before = _abstract_names(prefix)
        tx = WeightSender(g0, bucket_bytes=64 << 10, path="ipc")
        send = _Bg(lambda: tx.send(_weights(2), 2))
        _wait(lambda: _abstract_names(prefix) - before, 10, "the sender's IPC socket")
        name = sorted(_abstract_names(prefix) - before)[0]
        intruder = subprocess.Popen(_as_nobody(["-c", IPC_INTRUDER, name]), env=_nobody_env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
        first = intruder.stdout.readline()
        assert json.loads(first).get("connected"), first + intruder.stderr.read()[-2000:]
        # the intruder is first in the queue; now the real receiver comes
        tgt = {k: torch.zeros_like(v) for k, v in _weights(0).items()}
        rx = WeightReceiver(g1, target=tgt, staged=staged)
        rep = rx.receive(timeout_s=60)
        send.join(60)
        assert send.error is None, send.error
        out_, err = _rest(intruder)
        assert out_.strip(), err[-2000:]
        got = json.loads(out_.strip().splitlines()[-1])
        assert got["uid"] == NOBODY and got["connected"]
        assert got["fds"] == 0, "the intruder received a file descriptor"
        assert got["data"] == 0, "the intruder received a message"
        assert rep.path == "ipc" and rep.version == 2 and _exact(tgt, _weights(2))
        assert any(f"uid {NOBODY}" in m for m in send.result.intrusions), send.result.intrusions
        assert any(f"uid {NOBODY}" in m for m in g0.intrusions)
        # and the next update over the same (authenticated) connection works too
        nxt = _Bg(lambda: rx.receive(timeout_s=60))
        tx.send(_weights(3), 3)
        nxt.join(60)
        assert nxt.error is None and _exact(tgt, _weights(3))
        tx.close()
    finally:
        g0.close(), g1.close()


def test_same_user_without_the_secret_fails_the_handshake():
    """A process of the receiver's own user that connects first and claims rank 1 cannot answer
    the challenge: refused and named; the real receiver gets the update."""
    g0, g1 = _pair()
    try:
        prefix = f"unisleep-transfer-{os.getpid()}-"
        before = _abstract_names(prefix)
        tx = WeightSender(g0, bucket_bytes=64 << 10, path="ipc")
        send = _Bg(lambda: tx.send(_weights(4), 4))
        _wait(lambda: _abstract_names(prefix) - before, 10, "the sender's IPC socket")
        name = sorted(_abstract_names(prefix) - before)[0]
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect("\0" + name)
        s.send(R.seal(os.urandom(32), "x", "ipc", 0, 0, {"op": "proof", "rank": 1}))
        tgt = {k: torch.zeros_like(v) for k, v in _weights(0).items()}
        rep = WeightReceiver(g1, target=tgt).receive(timeout_s=60)
        send.join(60)
        assert send.error is None, send.error
        assert rep.version == 4 and _exact(tgt, _weights(4))
        s.settimeout(5)
        fds_seen = 0
        while True:
            data, fds, _f, _a = socket.recv_fds(s, 1 << 16, 8)
            fds_seen += len(fds)
            for fd in fds:
                os.close(fd)
            if not data:
                break
        assert fds_seen == 0
        assert any("refused an IPC connection" in m for m in g0.intrusions), g0.intrusions
        s.close()
        tx.close()
    finally:
        g0.close(), g1.close()


# ---------------------------------------------------------------------------- what listens
def _hex_addr(h: str) -> str:
    raw = bytes.fromhex(h)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i: i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket of process ``pid`` (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            p = line.split()
            if p[3] == "0A" and p[9] in inodes:  # LISTEN
                addr, port = p[1].split(":")
                out.append((_hex_addr(addr), int(port, 16)))
    return out


def test_hex_address_decoding():
    assert _hex_addr("0100007F") == "127.0.0.1"
    assert _hex_addr("00000000") == "0.0.0.0"
    assert _hex_addr("00000000000000000000000001000000") == "::1"
    assert _hex_addr("00000000000000000000000000000000") == "::"


def test_loopback_group_listens_on_loopback_only():
    before = set(listening_sockets(os.getpid()))
    g0, g1 = _pair()
    try:
        # both paths up: the store, the collective's sockets and an IPC socket
        tx = WeightSender(g0, bucket_bytes=64 << 10, path="collective")
        tgt = {k: torch.zeros_like(v) for k, v in _weights(0).items()}
        rx = _Bg(lambda: WeightReceiver(g1, target=tgt).receive(timeout_s=60))
        tx.send(_weights(5), 5)
        rx.join(60)
        assert rx.error is None, rx.error
        now = [s for s in listening_sockets(os.getpid()) if s not in before]
        assert any(port == g0.port for _, port in now), f"the store's socket was not found: {now}"
        wild = [s for s in now if s[0] not in ("127.0.0.1", "::1")]
        assert not wild, f"a loopback group listens on other addresses: {wild}"
    finally:
        g0.close(), g1.close()


def test_non_loopback_group_without_a_secret_is_refused(monkeypatch):
    monkeypatch.delenv("UNISLEEP_TRANSFER_SECRET", raising=False)
    monkeypatch.delenv("UNISLEEP_TRANSFER_SECRET_FILE", raising=False)
    with pytest.raises(InvalidArgumentError, match="needs a shared secret"):
        TransferGroup.create("tcp://192.0.2.1:29555", 0, 2, platform="host", timeout_s=5)


def test_secret_file_must_be_private(tmp_path):
    from unisleep.transfer.secret import read_secret_file, write_secret_file

    p = tmp_path / "secret"
    sec = write_secret_file(str(p))
    assert oct(p.stat().st_mode & 0o777) == "0o600" and read_secret_file(str(p)) == sec
    p.chmod(0o644)
    with pytest.raises(InvalidArgumentError, match="chmod 600"):
        read_secret_file(str(p))


@pytest.mark.slow
def test_groups_with_different_secrets_do_not_talk():
    addr = f"tcp://127.0.0.1:{_port()}"
    out: dict = {}

    def mk(r, sec):
        try:
            out[r] = TransferGroup.create(addr, r, 2, platform="host", timeout_s=3, secret=sec)
        except Exception as e:  # noqa: BLE001
            out[r] = e

    ts = [threading.Thread(target=mk, args=(0, "11" * 32)), threading.Thread(target=mk, args=(1, "22" * 32))]
    [t.start() for t in ts]
    [t.join(30) for t in ts]
    assert isinstance(out[1], TransferError) and "authenticat" in str(out[1]), out[1]
    for g in out.values():
        if isinstance(g, TransferGroup):
            g.close()


# ---------------------------------------------------------------------------- records
KEY = b"k" * 32


def test_records_refuse_pickles_garbage_replays_and_other_keys():
    body = {"ok": True, "kind": "", "msg": "", "connected": False}
    raw = R.seal(KEY, "g/1", "u3/ack/1", 3, 0, body)
    assert R.open_record(KEY, "g/1", raw, name="u3/ack/1", peer="rank 1", schema=R.ACK, seq=3, epoch=0)[2] == body
    bad = {
        "pickle": pickle.dumps(body),
        "garbage": os.urandom(100),
        "other key": R.seal(b"x" * 32, "g/1", "u3/ack/1", 3, 0, body),
        "other group": R.seal(KEY, "g/2", "u3/ack/1", 3, 0, body),
        "one bit flipped": raw[:20] + bytes([raw[20] ^ 1]) + raw[21:],
    }
    for what, b in bad.items():
        with pytest.raises(R.ForgedRecordError):
            R.open_record(KEY, "g/1", b, name="u3/ack/1", peer="rank 1", schema=R.ACK, seq=3, epoch=0)
    with pytest.raises(R.ForgedRecordError, match="replayed"):  # an older update's record
        R.open_record(KEY, "g/1", R.seal(KEY, "g/1", "u2/ack/1", 2, 0, body), name="u2/ack/1", peer="rank 1",
                      schema=R.ACK, seq=3, epoch=0)
    with pytest.raises(R.ForgedRecordError, match="epoch"):
        R.open_record(KEY, "g/1", R.seal(KEY, "g/1", "u3/ack/1", 3, 1, body), name="u3/ack/1", peer="rank 1",
                      schema=R.ACK, seq=3, epoch=0)
    with pytest.raises(R.ForgedRecordError, match="written for key"):
        R.open_record(KEY, "g/1", raw, name="u3/done/1", peer="rank 1", schema=R.ACK)


def test_records_check_schema_size_and_protocol():
    with pytest.raises(TransferError, match="schema"):
        R.open_record(KEY, "g", R.seal(KEY, "g", "go", 0, 0, {"go": "yes", "why": ""}), name="go", peer="rank 0",
                      schema=R.GO)
    with pytest.raises(TransferError, match="schema"):
        R.open_record(KEY, "g", R.seal(KEY, "g", "go", 0, 0, {"go": True, "why": "", "x": 1}), name="go",
                      peer="rank 0", schema=R.GO)
    raw = R.seal(KEY, "g", "go", 0, 0, {"go": True, "why": ""})
    with pytest.raises(R.ForgedRecordError, match="limit"):
        R.open_record(KEY, "g", raw + b"x" * 100, name="go", peer="rank 0", schema=R.GO, limit=64)
    # another protocol version (authentic): both numbers named
    head = R.HEAD.pack(R.MAGIC, R.PROTOCOL + 1, 0, len(raw) - R.HEAD.size - R.TAG_BYTES)
    import hashlib
    import hmac

    payload = raw[R.HEAD.size: -R.TAG_BYTES]
    other = head + payload + hmac.new(KEY, b"g" + head + payload, hashlib.sha256).digest()
    with pytest.raises(TransferError, match=f"protocol {R.PROTOCOL + 1}, this side {R.PROTOCOL}"):
        R.open_record(KEY, "g", other, name="go", peer="rank 0", schema=R.GO)


def test_versions_must_increase_unless_allowed():
    assert R.check_version(5, 3, False, "x") is None
    assert "must increase" in R.check_version(3, 5, False, "x")
    assert "must increase" in R.check_version(3, 3, False, "x")
    assert R.check_version(3, 3, True, "x") is None
    assert R.check_version("step-10", "step-9", False, "x") is None
    assert R.check_version("step-9", "step-10", False, "x")
    assert R.check_version({"a": 1}, None, False, "x")  # not a plain version


def test_sender_and_receiver_refuse_old_versions():
    g0, g1 = _pair()
    try:
        tx = WeightSender(g0, bucket_bytes=64 << 10, path="collective")
        tgt = {k: torch.zeros_like(v) for k, v in _weights(0).items()}
        rx = WeightReceiver(g1, target=tgt, initial_version=5)
        with pytest.raises(InvalidArgumentError, match="must increase"):
            tx.version = 5
            tx.send(_weights(3), 3)
        tx.version = None
        r = _Bg(lambda: rx.receive(timeout_s=30))
        with pytest.raises(TransferError, match="must increase"):
            tx.send(_weights(3), 3)  # the receiver holds version 5
        r.join(30)
        assert isinstance(r.error, TransferError) and rx.version == 5
        r = _Bg(lambda: rx.receive(timeout_s=30))
        tx.send(_weights(6), 6)
        r.join(30)
        assert r.error is None and rx.version == 6 and _exact(tgt, _weights(6))
    finally:
        g0.close(), g1.close()


@pytest.mark.slow
def test_collective_bootstrap_records_are_authenticated():
    """The collective's own bootstrap values (addresses, unique ids) are sealed too: a planted one
    is named and waited past, so nobody redirects a member's connection to their own socket."""
    from unisleep.transfer.collective import _sealed_store_class

    g0, g1 = _pair()
    try:
        s0 = _sealed_store_class()(g0.store.prefixed("boot"), g0, "boot")
        s1 = _sealed_store_class()(g1.store.prefixed("boot"), g1, "boot")
        g1.store.prefixed("boot").set("rank_0", b"10.6.6.6:4242 (an intruder's address)")
        later = threading.Timer(0.5, lambda: s0.set("rank_0", b"127.0.0.1:5555"))
        later.start()
        assert s1.get("rank_0") == b"127.0.0.1:5555"
        assert any("bootstrap record boot/rank_0" in m for m in g1.intrusions), g1.intrusions
    finally:
        g0.close(), g1.close()


def test_nothing_in_the_transfer_path_unpickles():
    import re

    pat = re.compile(r"\bpickle\.loads?\b|\bimport pickle\b|\btorch\.load\(|\bcloudpickle\b|\bmarshal\.loads?\b")
    files = [os.path.join(ROOT, "unisleep", "transfer", f) for f in os.listdir(os.path.join(ROOT, "unisleep", "transfer"))
             if f.endswith(".py")]
    files += [os.path.join(ROOT, "unisleep", "engines", f)
              for f in ("vllm_trainer.py", "vllm_async.py", "vllm_async_weights.py")]
    files += [os.path.join(ROOT, "unisleep", "vllm_worker", f) for f in
              os.listdir(os.path.join(ROOT, "unisleep", "vllm_worker")) if f.endswith(".py")]
    files += [os.path.join(ROOT, "unisleep", "integrations", f) for f in ("verl.py", "openrlhf.py")]
    for f in files:
        for n, line in enumerate(open(f), 1):
            assert not pat.search(line), f"{f}:{n}: {line.strip()}"
