"""One device's process of ``unisleep bench --devices`` (:mod:`.devices` starts one per device,
as engines run): it holds a :class:`~unisleep.MemoryLifecycle` on its device and does what the
coordinator asks, one step at a time.

The wire is JSON lines, nothing pickled: a step arrives on stdin (``{"do": ...}``) and its
answer goes to stdout behind :data:`~.common.RESULT_PREFIX` (``{"error": "..."}`` when the step
raised; the process then exits 1).  Steps:

* ``limits`` — this device's copy into its backup store alone (:func:`.peers.measure_limits`:
  page-locked host memory on an accelerator), before the lifecycle exists;
* ``setup`` — the lifecycle, ``--weights`` GiB tagged "weights" filled at random and a reference
  copy, one untimed sleep and wake (the backup store grows to size), and where the backup lives
  (the store's NUMA placement and the node of its pages, read while the tag sleeps);
* ``sleep`` / ``wake`` — change the weights (before a sleep: the copy must run), synchronize,
  wait until the instant ``at`` (``time.monotonic``: one clock for every process of the host),
  then a timed level-1 sleep / wake; the wake's answer says whether the bytes are exact;
* ``close``.

Every wait ends: a step that does not arrive within ``--idle-timeout`` seconds (or stdin
closing: the coordinator is gone) ends the process.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from typing import Optional

from .common import emit_result, progress

GiB = 1 << 30


class DeviceWorker:
    def __init__(self, platform: str, device: int, label: str, weights_bytes: int, spill_dir: Optional[str]):
        self.platform, self.device, self.label = platform, device, label
        self.nbytes = weights_bytes
        self.spill_dir = spill_dir
        self.lc = self.w = self.ref = None
        self.sync = None

    def _use_device(self) -> None:
        """Make this process's device torch's current one, so that nothing (a device-wide
        synchronize, a cache) touches another device: one process, one device, as engines run."""
        import torch

        from unisleep.platform import detect_platform

        kind = detect_platform(self.platform).torch_device_type
        mod = torch.get_device_module(kind)
        if kind != "cpu" and hasattr(mod, "set_device"):
            mod.set_device(self.device)

    # ---- steps --------------------------------------------------------------------------
    def limits(self, msg: dict) -> dict:
        from . import peers

        self._use_device()
        return peers.measure_limits(self.platform, self.device, self.nbytes, self.spill_dir)

    def setup(self, msg: dict) -> dict:
        import torch

        from unisleep import MemoryLifecycle

        self._use_device()
        kw = {"spill_dir": self.spill_dir} if self.spill_dir else {}
        self.lc = MemoryLifecycle(self.platform, device=self.device, **kw)
        self.sync = self.lc.driver.synchronize
        self.w = self.lc.empty((self.nbytes,), torch.uint8, tag="weights")
        if self.nbytes % 4 == 0:
            self.w.view(torch.int32).random_()
        else:
            self.w.random_(0, 256)
        self.ref = self.w.clone()
        self.sync()
        self.lc.sleep(1)
        where = self._where()
        self.lc.wake_up()
        self.sync()
        return {"where": where, "verified": bool(torch.equal(self.w, self.ref)), "pid": os.getpid()}

    def sleep(self, msg: dict) -> dict:
        self.w[:4096].add_(1)  # a real change: the digest differs, the whole copy runs
        self.ref[:4096].add_(1)
        return self._timed(msg, lambda: self.lc.sleep(1))

    def wake(self, msg: dict) -> dict:
        import torch

        out = self._timed(msg, lambda: self.lc.wake_up())
        out["verified"] = bool(torch.equal(self.w, self.ref))
        return out

    def close(self, msg: Optional[dict] = None) -> dict:
        self.w = self.ref = None
        if self.lc is not None:
            self.lc.close()
            self.lc = None
        return {"closed": True}

    # ---- parts --------------------------------------------------------------------------
    def _timed(self, msg: dict, fn) -> dict:
        """``fn`` timed from the instant ``msg["at"]`` (monotonic seconds) to its device sync."""
        self.sync()
        at = float(msg["at"])
        late = time.monotonic() - at
        while True:  # sleep to just before the instant, then spin to it
            left = at - time.monotonic()
            if left <= 0:
                break
            if left > 0.002:
                time.sleep(left - 0.001)
        t0 = time.monotonic()
        fn()
        self.sync()
        t1 = time.monotonic()
        report = self.lc.last_report
        return {"t0": t0, "t1": t1, "seconds": t1 - t0, "late_s": max(0.0, late),
                "bytes": report.bytes_copied if report is not None and report.bytes_copied else self.nbytes}

    def _where(self) -> dict:
        """Where the backup lives, read while the weights sleep: the store, the device's NUMA
        node, the node the store binds to (and why), and the nodes its pages lie on."""
        store = self.lc.backup_store
        out: dict = {"store": store.where, "supports_numa": bool(store.supports_numa)}
        if store.supports_numa:
            out["device_node"] = store.device_numa_node()
            p = store.placement()
            out["bind"], out["why"] = p.get("bind"), p.get("why")
            pages = store.page_nodes()
            counts: dict[str, int] = {}
            for n in pages:
                counts[str(n)] = counts.get(str(n), 0) + 1
            out["page_nodes"] = counts
            out["pages_sampled"] = len(pages)
            dn = out["device_node"]
            out["local"] = None if dn is None or not pages else all(n == dn for n in pages)
        return out


def _read_step(timeout_s: float) -> Optional[dict]:
    """The next step from stdin; None when stdin closed; raises TimeoutError after ``timeout_s``."""
    fd = sys.stdin.fileno()
    buf = b""
    deadline = time.monotonic() + timeout_s
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no step from the coordinator within {timeout_s:g} s")
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return None
        buf += chunk
    line, _, rest = buf.partition(b"\n")
    if rest.strip():  # the coordinator sends one step and waits for its answer
        raise RuntimeError("the coordinator sent two steps at once")
    return json.loads(line)


def serve(platform: str, device: int, label: str, weights_bytes: int, spill_dir: Optional[str],
          idle_timeout_s: float) -> int:
    """Answer steps until ``close`` (0), stdin closing (0) or an error (1: the error is answered)."""
    worker = DeviceWorker(platform, device, label, weights_bytes, spill_dir)
    emit_result({"ready": True, "pid": os.getpid(), "device": device})
    try:
        while True:
            try:
                msg = _read_step(idle_timeout_s)
            except TimeoutError as e:
                progress(f"{label}: {e}; stopping")
                return 1
            if msg is None:
                return 0
            do = msg.get("do")
            if do not in ("limits", "setup", "sleep", "wake", "close"):
                emit_result({"error": f"unknown step {do!r}"})
                return 1
            try:
                res = getattr(worker, do)(msg)
            except Exception as e:  # answered: the coordinator names it and stops the others
                emit_result({"error": f"{type(e).__name__}: {e}"})
                return 1
            emit_result(res)
            if do == "close":
                return 0
    finally:
        try:
            worker.close()
        except Exception:  # closing after the result was sent: a close error must not hide it
            pass

