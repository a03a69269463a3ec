"""Removing a dead process's spill directory is routine housekeeping: it is logged at debug
level, not shown to a user who just made a ``MemoryLifecycle()``."""

from __future__ import annotations

import json
import logging
import os

# ctypes' find_library runs ldconfig once, when the host backend's libc module is first imported:
# do it at collection, so the fast lane's guard does not count it as the test starting a process
import unisleep.backends.host.libc  # noqa: F401
from unisleep import MemoryLifecycle
from unisleep.backends.host.spill_dir import DIR_PREFIX, MARKER_KIND, OWNER_FILE


def test_a_dead_processs_spill_directory_is_removed_quietly(tmp_path, caplog):
    spill = tmp_path / "spill"
    orphan = spill / f"{DIR_PREFIX}4242-oldboot-x"
    orphan.mkdir(parents=True, mode=0o700)
    os.chmod(spill, 0o700)
    marker = orphan / OWNER_FILE
    # an owner of an earlier boot: gone for certain, no lock to test
    marker.write_text(json.dumps({"kind": MARKER_KIND, "pid": 4242, "boot_id": "an-earlier-boot"}))
    os.chmod(marker, 0o600)
    (orphan / "0.spill").write_bytes(b"x" * 4096)
    with caplog.at_level(logging.DEBUG, logger="unisleep.host"):
        lc = MemoryLifecycle("host", spill_dir=str(spill))
    try:
        assert not orphan.exists()
        said = [r for r in caplog.records if "left by a process that is gone" in r.getMessage()]
        assert said and str(orphan) in said[0].getMessage(), [r.getMessage() for r in caplog.records]
        loud = [(r.levelname, r.getMessage()) for r in said if r.levelno >= logging.WARNING]
        assert not loud, f"a routine removal is shown to the user: {loud}"
    finally:
        lc.close()
