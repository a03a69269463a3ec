"""``unisleep bench --backend host --encoding``: runs on real host memory and spill files, every
wake checked byte for byte; refuses what it cannot measure before anything starts."""

from __future__ import annotations

import json

import pytest

from unisleep.bench import cli


def test_side_by_side_small(tmp_path, spill_dir, capsys):
    out = tmp_path / "enc.json"
    rc = cli.main(["--backend", "host", "--encoding", "--mib", "2", "--cycles", "1", "--steps", "1",
                   "--spill-dir", spill_dir, "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    runs = {(r["workload"], r["encoding"]): r for r in doc["results"]["runs"]}
    assert set(runs) == {(w, e) for w in ("bf16-llm", "fp32-adamw", "random") for e in ("plain", "planes")}
    assert all(r["exact"] for r in runs.values())
    assert runs[("bf16-llm", "planes")]["ratio"] < 0.72 and runs[("bf16-llm", "plain")]["ratio"] == 1.0
    assert runs[("fp32-adamw", "planes")]["ratio"] < 0.95
    assert runs[("random", "planes")]["ratio"] == 1.0  # stored plain
    assert runs[("fp32-adamw", "planes")]["made"]["optimizer"].startswith("AdamW")
    assert "stored/raw" in capsys.readouterr().out


@pytest.mark.parametrize("args,msg", [(["--backend", "cuda"], "device kernels are not built"),
                                      (["--mib", "0"], "--mib must be"),
                                      (["--workloads", "bf16-llm,nope"], "unknown nope")])
def test_refusals_before_anything_starts(tmp_path, capsys, args, msg):
    with pytest.raises(SystemExit) as e:
        cli.main(["--encoding", *args, "--json", str(tmp_path / "x.json")])
    assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
