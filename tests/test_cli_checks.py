"""The command line's checks as functions (no process): output paths checked without creating
anything, values that look negative reach their option's own check."""

from __future__ import annotations

import argparse
import os

import pytest

from unisleep.cli import check_out_dir, check_out_file, parse_args
from unisleep.errors import InvalidArgumentError


def test_out_dir_checks_create_nothing(tmp_path):
    assert check_out_dir(str(tmp_path / "a" / "b")) == str(tmp_path / "a" / "b")
    assert check_out_dir(str(tmp_path)) == str(tmp_path)
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(InvalidArgumentError, match="it exists and is not a folder"):
        check_out_dir(str(f))
    with pytest.raises(InvalidArgumentError, match=f"{f} is a file, so no folder can be made under it"):
        check_out_dir(str(f / "sub" / "deeper"))
    with pytest.raises(InvalidArgumentError, match="cannot write in /proc"):
        check_out_dir("/proc/nope")
    assert sorted(os.listdir(tmp_path)) == ["f"]


def test_out_file_checks_change_nothing(tmp_path):
    f = tmp_path / "f.json"
    f.write_text("old")
    before = os.stat(f)
    assert check_out_file(str(f)) == str(f)
    assert f.read_text() == "old" and os.stat(f).st_mtime_ns == before.st_mtime_ns
    assert check_out_file(str(tmp_path / "new" / "b.json"))
    with pytest.raises(InvalidArgumentError, match="it is a folder"):
        check_out_file(str(tmp_path))
    with pytest.raises(InvalidArgumentError, match=f"--json {f}/x.json: {f} exists and is not a folder"):
        check_out_file(str(f / "x.json"))
    assert sorted(os.listdir(tmp_path)) == ["f.json"]


def test_a_negative_looking_value_reaches_its_option():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=float)
    ap.add_argument("--name")
    ap.add_argument("--flag", action="store_true")
    assert parse_args(ap, ["--size", "-1.5", "--flag"]).size == -1.5
    assert parse_args(ap, ["--name", "-1G"]).name == "-1G"  # argparse alone: "expected one argument"
    with pytest.raises(SystemExit):
        parse_args(ap, ["--name", "--flag"])  # a missing value stays an error


def test_the_embedded_model_shape_is_one_class():
    """The demo checks its options against TinyLMConfig without importing torch; the engine uses
    the same class."""
    from unisleep.engines.tiny_lm_config import TinyLMConfig
    from unisleep.engines.torch_generator import TinyLMConfig as Same

    assert TinyLMConfig is Same


def test_torch_version_read_without_importing_torch_agrees():
    """Platform detection reads torch.version's fields from the installed torch's version.py
    (importing torch takes a second or more); what it reads is what torch says."""
    import torch

    from unisleep.backend import _UNKNOWN, _torch_version_file

    for attr in ("cuda", "hip", "__version__"):
        assert _torch_version_file(attr) == getattr(torch.version, attr)
    assert _torch_version_file("no_such_field") is _UNKNOWN
