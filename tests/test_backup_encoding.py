"""The lossless backup encoding "planes": the format itself (round trips of every transform,
the per-frame fallback, malformed frames refused) and on the host backend (real memfd memory,
real spill files): bytes exact, encoded bytes in the accounting, the unchanged-weights skip,
progressive wake, read_backup, and every fault rule (a corrupt, truncated or removed file, a
fault mid-sleep in a child)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

from unisleep import MemoryLifecycle, backup_encoding as be
from unisleep.errors import BackupCorruptError, InvalidArgumentError, UnsupportedError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
CHUNK = 1 * MiB


def llm_like(n: int, dtype, seed=0) -> torch.Tensor:
    """``n`` weights drawn like trained LLM weights: normal, std 0.02, a few outliers."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * 0.02
    idx = torch.randint(0, n, (max(1, n // 100000),), generator=g)
    w[idx] *= 50
    return w.to(dtype)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


# ----------------------------------------------------------------------------- the format
@pytest.mark.parametrize("dtype,transform,most", [(torch.bfloat16, 1, 0.70), (torch.float32, 3, 0.88)])
def test_round_trip_and_ratio(dtype, transform, most):
    data = raw(llm_like(1 << 19, dtype))
    frame = be.encode(data)
    assert frame is not None and frame[:4] == be.MAGIC and frame[4] == transform
    assert len(frame) <= most * len(data)
    out = bytearray(len(data))
    be.decode(frame, memoryview(out))
    assert bytes(out) == data


@pytest.mark.parametrize("transform", [1, 2, 3])
def test_every_transform_is_exact_on_every_bit_pattern(transform):
    """Special values (NaN payloads, inf, -0, subnormals) and every 16-bit word, each transform
    forced: lossless whatever the data is."""
    words = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    data = raw(words) * 2  # every 16-bit pattern, twice (also read as 32-bit words)
    frame = be.encode(data, transform=transform)
    if frame is None:  # not smaller: stored plain, which is exact by definition
        return
    out = bytearray(len(data))
    be.decode(frame, memoryview(out))
    assert bytes(out) == data


def test_what_does_not_pay_is_stored_plain():
    g = torch.Generator().manual_seed(1)
    assert be.encode(raw(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g))) is None  # random
    q = torch.randint(-128, 128, (1 << 20,), dtype=torch.int8, generator=g)  # "quantised weights"
    assert be.encode(raw(q)) is None
    assert be.encode(b"\x00" * 100) is None  # too short to bother
    assert be.encode(bytes(range(256)) * 7 + b"\x01") is None  # no width divides an odd length


def test_header_is_as_documented():
    data = raw(llm_like(1 << 16, torch.bfloat16))
    frame = be.encode(data)
    magic, t, coder, res, n, blocks, block = be.HEADER.unpack_from(frame, 0)
    assert (magic, t, coder, res, n, block) == (b"USP1", 1, 1, 0, len(data), be.BLOCK)
    assert blocks == -(-len(data) // 2 // be.BLOCK)
    lens = struct.unpack_from(f"<{blocks}I", frame, be.HEADER.size)
    import zlib

    pos = be.HEADER.size + 4 * blocks
    e = b"".join(zlib.decompress(frame[pos + sum(lens[:i]):pos + sum(lens[:i + 1])], -15) for i in range(blocks))
    w = torch.frombuffer(bytearray(data), dtype=torch.int16).to(torch.int32) & 0xFFFF
    assert e == bytes(((w >> 7) & 0xFF).to(torch.uint8).tolist())  # plain RFC 1951 streams of the E plane


@pytest.mark.parametrize("cut", ["header", "planes", "length"])
def test_malformed_frames_are_refused(cut):
    data = raw(llm_like(1 << 16, torch.bfloat16))
    frame = bytearray(be.encode(data))
    out = bytearray(len(data))
    if cut == "header":
        frame[0] ^= 1
    elif cut == "planes":
        frame = frame[:-10]
    else:
        out = bytearray(len(data) - 2)
    with pytest.raises(be.FormatError):
        be.decode(bytes(frame), memoryview(out))


def test_a_damaged_block_never_decodes_to_the_same_bytes():
    """A flipped byte in a coded block either fails to inflate or inflates to other bytes: the
    store's checksum of the stored frame (and of the raw bytes after decoding) catches both."""
    data = raw(llm_like(1 << 16, torch.bfloat16))
    frame = bytearray(be.encode(data))
    frame[be.HEADER.size + 8 + 40] ^= 0xFF
    out = bytearray(len(data))
    try:
        be.decode(bytes(frame), memoryview(out))
    except be.FormatError:
        return
    assert bytes(out) != data


# ----------------------------------------------------------------------------- on the host backend
@pytest.fixture
def lc(spill_dir):
    lc = MemoryLifecycle("host", spill_dir=spill_dir, chunk_bytes=CHUNK, backup_encoding="planes")
    yield lc
    lc.close()


def files_bytes(lc) -> int:
    d = lc.backup_store.dir
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for f in os.listdir(d) if f != ".owner")


def model(lc, seed=0):
    w = lc.empty((4 * CHUNK // 2,), torch.bfloat16, tag="weights")
    w.copy_(llm_like(w.numel(), torch.bfloat16, seed))
    m = lc.empty((2 * CHUNK // 4,), torch.float32, tag="optimizer")
    m.copy_(llm_like(m.numel(), torch.float32, seed + 1))
    r = lc.empty((CHUNK,), torch.uint8, tag="optimizer")
    r.random_(0, 256, generator=torch.Generator().manual_seed(seed))
    return {"w": w, "m": m, "r": r}


def test_bytes_exact_and_the_accounting_shows_encoded_bytes(lc):
    ts = model(lc)
    ref = {k: v.clone() for k, v in ts.items()}
    rep = lc.sleep(1, offload_tags=["optimizer"])
    assert rep.bytes_copied == 7 * CHUNK
    enc = lc.backup_store.encoded_bytes()
    assert enc["raw"] == 7 * CHUNK and enc["stored"] < 0.85 * enc["raw"]
    held = lc.backup_bytes()
    assert held == enc["stored"] < 7 * CHUNK
    assert abs(lc.backup_resident_bytes()["disk"] - held) <= 3 * 4096  # the files' blocks, read from the kernel
    assert abs(files_bytes(lc) - held) <= 3 * 4096
    frames = {k: f for k, f in lc.backup_store._frames.items()}
    kinds = sorted({f.transform for fs in frames.values() for f in fs})
    assert kinds == [0, 1, 3]  # bf16 weights, fp32 moments, and the random bytes stored plain
    lc.wake_up()
    assert all(torch.equal(ts[k], ref[k]) for k in ts)
    assert lc.backup_bytes() == 0 and files_bytes(lc) == 0


def test_plain_and_encoded_backups_live_side_by_side(lc):
    ts = model(lc, seed=3)
    ref = {k: v.clone() for k, v in ts.items()}
    lc.backup_encoding = None
    lc.sleep(1, tags=["weights"])
    lc.backup_encoding = "planes"
    lc.sleep(1, tags=["optimizer"], offload_tags=["optimizer"])
    assert lc.backup_store.encoded_bytes()["raw"] == 3 * CHUNK  # only the optimizer's
    lc.wake_up()
    assert all(torch.equal(ts[k], ref[k]) for k in ts)
    with pytest.raises(InvalidArgumentError):
        lc.backup_encoding = "zstd"


def test_refusals(spill_dir):
    with pytest.raises(InvalidArgumentError):
        MemoryLifecycle("host", spill_dir=spill_dir, backup_encoding="zip")
    from unisleep.backends.host.staged_spill import StagedSpillStore
    from unisleep.lifecycle.memory import _set_encoding

    store = StagedSpillStore(None, spill_dir)
    try:
        with pytest.raises(UnsupportedError, match="leave backup_encoding unset"):
            _set_encoding(store, "planes")
        assert store.encoding is None
    finally:
        store.close()


def test_unchanged_weights_skip_and_a_change_is_copied(spill_dir):
    lc = MemoryLifecycle("host", spill_dir=spill_dir, chunk_bytes=CHUNK, backup_encoding="planes",
                         retain_backups=True)
    try:
        ts = model(lc, seed=5)
        lc.sleep(1, tags=["weights"])
        lc.wake_up()
        assert lc.sleep(1, tags=["weights"]).bytes_copied == 0  # proven unchanged: no copy, no encode
        lc.wake_up()
        ts["w"][7] = 1.5
        ref = ts["w"].clone()
        assert lc.sleep(1, tags=["weights"]).bytes_copied == 4 * CHUNK
        lc.wake_up()
        assert torch.equal(ts["w"], ref)
        out = torch.empty(100, dtype=torch.uint8)  # read_backup: a range inside one encoded frame
        assert lc.read_backup(ts["w"].data_ptr() + 3, out)
        assert torch.equal(out, ref.view(torch.uint8)[3:103])
    finally:
        lc.close()


def test_progressive_wake_of_encoded_backups(lc):
    ts = model(lc, seed=7)
    ref = {k: v.clone() for k, v in ts.items()}
    lc.sleep(1, offload_tags=["optimizer"])
    pw = lc.wake_up(progressive=True)
    lc.ready(ts["w"])
    assert torch.equal(ts["w"], ref["w"])
    lc.wait()
    assert len(pw.steps) == 7 and all(torch.equal(ts[k], ref[k]) for k in ts)


def test_level_two_preserved_ranges_are_encoded_too(lc):
    m = torch.nn.Linear(512, 512).to(torch.bfloat16)
    with torch.no_grad():
        m.weight.copy_(llm_like(512 * 512, torch.bfloat16).view(512, 512))
    lc.adopt(m)
    lc.preserve(["weight"])
    ref = m.weight.detach().clone()
    lc.sleep(2)
    assert lc.backup_store.encoded_bytes()["stored"] < 0.75 * ref.numel() * 2
    lc.wake_up()
    assert torch.equal(m.weight, ref) and int(m.bias.count_nonzero()) == 0


def test_budget_and_encoding_together(lc):
    ts = model(lc, seed=9)
    ref = {k: v.clone() for k, v in ts.items()}
    rep = lc.sleep(1, offload_tags=["optimizer"], free_at_least=CHUNK, free_order=["optimizer"])
    assert rep.budget["moved"][0]["tag"] == "optimizer" and rep.bytes_released == CHUNK  # the newest region: r
    assert lc.backup_bytes() == CHUNK  # random bytes: stored plain
    lc.wake_up()
    assert all(torch.equal(ts[k], ref[k]) for k in ts)


@pytest.mark.parametrize("how", ["flip", "truncate", "remove"])
def test_a_damaged_encoded_backup_exposes_nothing(lc, how):
    ts = model(lc, seed=11)
    lc.sleep(1, tags=["weights"])
    a = lc._state.of("weights")[0]
    path = lc.backup_store.path((a.id, 0))
    f = lc.backup_store._frames[(a.id, 0)][2]
    assert f.transform == 1
    if how == "flip":  # one byte inside the third frame's coded exponent plane
        with open(path, "r+b") as fh:
            fh.seek(f.file_offset + be.HEADER.size + 200)
            b = fh.read(1)
            fh.seek(f.file_offset + be.HEADER.size + 200)
            fh.write(bytes([b[0] ^ 0x10]))
    elif how == "truncate":
        os.truncate(path, f.file_offset + 10)
    else:
        os.unlink(path)
    with pytest.raises(BackupCorruptError):
        lc.wake_up(["weights"])
    assert lc.state()["weights"] == "offloaded" and lc.resident_bytes("weights") == 0
    lc.discard(["weights"])
    lc.wake_up(["weights"])
    assert int(ts["w"].view(torch.uint8).count_nonzero()) == 0


CHILD = textwrap.dedent("""
    import os, signal, sys, torch
    from unisleep import MemoryLifecycle
    from unisleep.errors import BackupError
    spill = sys.argv[1]
    lc = MemoryLifecycle("host", spill_dir=spill, chunk_bytes=1 << 20, backup_encoding="planes")
    g = torch.Generator().manual_seed(3)
    w = lc.empty((2 << 20,), torch.bfloat16, tag="weights")
    w.copy_((torch.randn(w.numel(), generator=g) * 0.02).to(torch.bfloat16))
    ref, ptr = w.clone(), w.data_ptr()
    writes = []
    def fault(va, end):
        writes.append(end)
        if len(writes) == 3:  # two encoded frames on disk, their chunks released
            raise OSError(28, "No space left on device (injected)")
    lc.driver.hooks.backup = fault
    try:
        lc.sleep(1)
    except BackupError as e:
        assert lc.state() == {"weights": "awake"}, lc.state()
        assert w.data_ptr() == ptr and torch.equal(w, ref)
        assert lc.backup_bytes() == 0 and [f for f in os.listdir(lc.backup_store.dir) if f != ".owner"] == []
        lc.driver.hooks.backup = None
        lc.sleep(1)
        lc.wake_up()
        assert torch.equal(w, ref)
        print("UNDONE", type(e).__name__, flush=True)
        sys.exit(0)
    sys.exit(1)
""")


@pytest.mark.slow
def test_a_fault_mid_encoded_sleep_is_undone_in_a_child(spill_dir):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", CHILD, spill_dir], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0 and "UNDONE BackupError" in p.stdout, p.stdout + p.stderr


def test_frames_stay_bounded_whatever_the_backup(lc, monkeypatch):
    """A range saved in one go (a level-2 preserved parameter) is still cut into frames of at most
    MAX_FRAME: the scratch of encoding and decoding one frame does not grow with the model."""
    monkeypatch.setattr(be, "MAX_FRAME", 256 << 10)
    m = torch.nn.Linear(1024, 1024, bias=False).to(torch.bfloat16)  # 2 MiB, one range
    with torch.no_grad():
        m.weight.copy_(llm_like(1024 * 1024, torch.bfloat16).view(1024, 1024))
    lc.adopt(m)
    lc.preserve(["weight"])
    ref = m.weight.detach().clone()
    lc.sleep(2)
    frames = [f for fs in lc.backup_store._frames.values() for f in fs]
    assert len(frames) == 8 and max(f.length for f in frames) == 256 << 10
    lc.wake_up()
    assert torch.equal(m.weight, ref)


def test_progressive_wake_of_a_damaged_encoded_backup_exposes_nothing(lc):
    ts = model(lc, seed=13)
    lc.sleep(1, tags=["weights"])
    a = lc._state.of("weights")[0]
    f = lc.backup_store._frames[(a.id, 0)][2]
    with open(lc.backup_store.path((a.id, 0)), "r+b") as fh:  # a byte of the third frame's sign plane
        fh.seek(f.file_offset + f.stored - 100)
        b = fh.read(1)
        fh.seek(f.file_offset + f.stored - 100)
        fh.write(bytes([b[0] ^ 1]))
    lc.wake_up(["weights"], progressive=True)
    with pytest.raises(BackupCorruptError):
        lc.wait()
    assert lc.state()["weights"] == "offloaded" and lc.resident_bytes("weights") == 0
    lc.discard(["weights"])
    lc.wake_up(["weights"])
    assert int(ts["w"].view(torch.uint8).count_nonzero()) == 0
