"""Loose arguments are refused with unisleep errors that say what to write instead."""

from __future__ import annotations

import pytest
import torch

from unisleep import MemoryLifecycle
from unisleep.errors import (
    InvalidArgumentError,
    SpillDirError,
    UnisleepError,
)


@pytest.fixture
def lc(tmp_path):
    lc = MemoryLifecycle("host", spill_dir=str(tmp_path / "spill"))
    lc.empty((1024,), torch.uint8, tag="weights")
    lc.empty((1024,), torch.uint8, tag="kv")
    yield lc
    lc.close()


@pytest.mark.parametrize("level", [True, False, 1.0, "1", 0, 3, None])
def test_levels_are_the_ints_1_and_2(lc, level):
    with pytest.raises(InvalidArgumentError, match="int 1 or 2"):
        lc.sleep(level)
    assert lc.state() == {"weights": "awake", "kv": "awake"}


@pytest.mark.parametrize("call", ["sleep", "wake_up", "discard"])
def test_a_string_is_not_a_list_of_tags(lc, call):
    with pytest.raises(InvalidArgumentError, match=r"list of tags, not the string 'kv': write \['kv'\]"):
        if call == "sleep":
            lc.sleep(1, offload_tags="kv")
        else:
            getattr(lc, call)("kv")
    assert lc.state() == {"weights": "awake", "kv": "awake"}


@pytest.mark.parametrize("chunk", [0, -5, 1.5, True])
def test_chunk_bytes_must_be_positive(tmp_path, chunk):
    with pytest.raises(InvalidArgumentError, match="chunk_bytes"):
        MemoryLifecycle("host", spill_dir=str(tmp_path), chunk_bytes=chunk)


@pytest.mark.parametrize("shape", [(-1,), (4, -2), (2.5,), ("3",)])
def test_negative_or_non_int_shapes(lc, shape):
    with pytest.raises(InvalidArgumentError, match="shape"):
        lc.empty(shape, torch.uint8, tag="x")
    assert "x" not in lc.tags


def test_dtype_must_be_a_torch_dtype(lc):
    with pytest.raises(InvalidArgumentError, match="torch.dtype"):
        lc.empty((4,), "float32", tag="x")


def test_spill_dir_that_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(SpillDirError, match=str(f)) as ei:
        MemoryLifecycle("host", spill_dir=str(f))
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, UnisleepError)


def test_missing_spill_dir_is_created_said_and_removed(tmp_path, caplog):
    d = tmp_path / "new" / "spill"
    with caplog.at_level("WARNING", logger="unisleep.host"):
        lc = MemoryLifecycle("host", spill_dir=str(d))
    assert any("created the spill directory" in r.message and str(d) in r.message for r in caplog.records)
    assert d.is_dir()
    lc.close()
    assert not d.exists()  # it was ours and is empty again


def test_a_spill_dir_made_by_another_process_meanwhile_is_used_and_left_to_it(tmp_path, monkeypatch):
    """Two workers starting at once with the same new spill_dir: the one whose mkdir comes
    second uses the directory the other made (and does not remove it at close)."""
    import os

    d = tmp_path / "spill"
    real = os.mkdir

    def racing(path, *a, **k):  # the other process wins between the look and this mkdir
        if path == "spill":
            real(path, *a, **k)
        return real(path, *a, **k)

    monkeypatch.setattr(os, "mkdir", racing)
    lc = MemoryLifecycle("host", spill_dir=str(d))
    monkeypatch.setattr(os, "mkdir", real)
    assert d.is_dir()
    lc.close()
    assert d.is_dir()  # not this lifecycle's to remove


def test_ram_filesystem_warns_once(tmp_path):
    import warnings

    import os

    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm on this machine")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        lc = MemoryLifecycle("host", spill_dir="/dev/shm")
    lc.close()
    ram = [w for w in got if "lives in RAM" in str(w.message)]
    assert len(ram) == 1, [str(w.message) for w in got]


def test_sizes_in_messages_use_human_units(tmp_path):
    from unisleep.errors import HostBudgetError

    lc = MemoryLifecycle("host", spill_dir=str(tmp_path), host_budget_bytes=1)
    lc.empty((3000,), torch.uint8, tag="weights")
    with pytest.raises(HostBudgetError, match=r"backup of 4.00 KiB would exceed host_budget_bytes=1 B"):
        lc.sleep(1)
    lc.close()
