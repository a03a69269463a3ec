"""How much memory one step of a process takes beyond what the process held before it: peak
resident host memory (RSS), the peak of any store the caller can count (a sender's or receiver's
``buffer_bytes()``), and on an accelerator the framework allocator's peak and the device's memory in
use — the figures ``unisleep bench --transfer`` prints per update, and that
``tests/transfer/test_memory_flat.py`` asserts flat.

::

    with PeakMemory(stores=[sender.buffer_bytes]) as pm:
        sender.send(...)
    pm.result["host_extra_bytes"]

Host: the baseline is the RSS when the block starts; the peak is the larger of what a sampling
thread saw (every ``every_s``, default 5 ms, from ``/proc/self/statm``) and the kernel's own high
water mark (``VmHWM``), which is reset at the start through ``/proc/self/clear_refs`` where the
kernel allows it (``hwm_reset`` says whether it did; without it only the samples count, and a
spike shorter than the interval can be missed).  RSS counts shared pages this process touched, so
memory shared through a file descriptor counts in both processes that map it.

Device (when ``device`` is an accelerator's ``torch.device``): ``device_extra_bytes`` is the
allocator's peak above its level at the start (``torch.accelerator`` statistics, reset at the
start); ``device_used_extra_bytes`` is the largest drop of the device's free memory seen by the
sampler — it includes memory made outside the allocator (exported IPC buckets) and, on a device
shared by several processes, theirs too.

Linux only (``/proc``); elsewhere the host figures are None.  Nothing here changes what the
block does beyond one extra thread that reads counters.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Optional, Sequence

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> Optional[int]:
    """This process's resident memory now, or None where ``/proc`` is not there."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def hwm_bytes() -> Optional[int]:
    """This process's peak resident memory (``VmHWM``) since it started or since the last reset."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_hwm() -> bool:
    """Set ``VmHWM`` to the current RSS; False where the kernel refuses it (or has no ``/proc``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Context manager: the memory the block takes beyond the process's baseline; after the block,
    ``result`` holds (bytes, None where not measured): ``host_extra_bytes``, ``store_peak_bytes``
    (the largest sum of ``stores()`` sampled, and read once more at the end), ``device_extra_bytes``,
    ``device_used_extra_bytes``, and ``hwm_reset``, ``samples``.

    ``stores``: callables returning bytes the caller holds outside the process's RSS accounting
    or beside it (e.g. ``WeightSender.buffer_bytes``); a call that fails while the block changes
    what it counts is skipped.  ``device``: a ``torch.device``; a CPU device (or None) measures the
    host only.  The sampler thread ends when the block does, error or not.
    """

    def __init__(self, *, device: Any = None, stores: Sequence[Callable[[], int]] = (), every_s: float = 0.005):
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0, got {every_s!r}")
        self.device = device if device is not None and getattr(device, "type", "cpu") != "cpu" else None
        self.stores = list(stores)
        self.every_s = every_s
        self.result: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._rss_peak = 0
        self._store_peak = 0
        self._free_min: Optional[int] = None
        self._samples = 0

    # ---------------------------------------------------------------- sampling
    def _store_sum(self) -> Optional[int]:
        total = 0
        for f in self.stores:
            try:
                total += int(f())
            except Exception:  # the block changed what the store counts as we read it: next sample
                return None
        return total

    def _device_free(self) -> Optional[int]:
        if self.device is None:
            return None
        import torch

        try:
            return int(torch.accelerator.get_memory_info(self.device)[0])
        except Exception:  # a backend without memory info: None, unknown
            return None

    def _sample(self) -> None:
        rss = rss_bytes()
        if rss is not None:
            self._rss_peak = max(self._rss_peak, rss)
        s = self._store_sum()
        if s is not None:
            self._store_peak = max(self._store_peak, s)
        free = self._device_free()
        if free is not None:
            self._free_min = free if self._free_min is None else min(self._free_min, free)
        self._samples += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    # ---------------------------------------------------------------- the block
    def __enter__(self) -> "PeakMemory":
        self._base_rss = rss_bytes()
        self._hwm_reset = reset_hwm()
        self._base_free = self._device_free()
        self._base_alloc = None
        if self.device is not None:
            import torch

            try:
                torch.accelerator.reset_peak_memory_stats(self.device)
                self._base_alloc = int(torch.accelerator.memory_allocated(self.device))
            except Exception:  # a backend without memory stats: the device peak is unknown
                self._base_alloc = None
        self._rss_peak = self._base_rss or 0
        self._free_min = self._base_free
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="unisleep-peak-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        host = None
        if self._base_rss is not None:
            peak = self._rss_peak
            hwm = hwm_bytes() if self._hwm_reset else None
            if hwm is not None:
                peak = max(peak, hwm)
            host = max(0, peak - self._base_rss)
        dev = None
        if self._base_alloc is not None:
            import torch

            try:
                dev = max(0, int(torch.accelerator.max_memory_allocated(self.device)) - self._base_alloc)
            except Exception:  # a backend without memory stats: the device peak is unknown
                dev = None
        used = None
        if self._base_free is not None and self._free_min is not None:
            used = max(0, self._base_free - self._free_min)
        self.result = {"host_extra_bytes": host, "store_peak_bytes": self._store_peak if self.stores else None,
                       "device_extra_bytes": dev, "device_used_extra_bytes": used,
                       "hwm_reset": self._hwm_reset, "samples": self._samples}


def peak_of(results: Sequence[dict]) -> dict:
    """The largest of each figure over several updates' ``PeakMemory.result`` (None stays None
    where no update measured it)."""
    out: dict[str, Any] = {}
    for r in results:
        for k, v in r.items():
            if isinstance(v, bool) or k == "samples":
                out[k] = (out.get(k, True) and v) if isinstance(v, bool) else out.get(k, 0) + v
            elif v is not None:
                out[k] = max(out.get(k) or 0, v)
            else:
                out.setdefault(k, None)
    return out


__all__ = ["PeakMemory", "peak_of", "rss_bytes", "hwm_bytes", "reset_hwm"]
