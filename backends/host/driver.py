"""The host driver: the CPU twin of CUDA's cumem, on real Linux memory.

=====================  =============================================================
reserve                ``mmap(NULL, size, PROT_NONE, PRIVATE|ANONYMOUS|NORESERVE)``
create                 ``memfd_create`` + ``ftruncate`` + ``posix_fallocate`` (committed)
map                    ``mmap(va, size, RW, SHARED|FIXED, memfd)`` — same address every time
unmap (keep address)   ``mmap(va, size, PROT_NONE, PRIVATE|ANONYMOUS|FIXED|NORESERVE)``
release                ``close(memfd)`` — the pages go back to the kernel
physical_bytes         ``fstat(memfd).st_blocks * 512`` (never RSS: MADV_DONTNEED lies)
free address           ``munmap``
=====================  =============================================================

Touching memory that sleeps faults (SIGSEGV), the host analogue of a device illegal-address
error: wake before use.
"""

from __future__ import annotations

import ctypes
import mmap as _mmap
import os
import queue
import threading
from dataclasses import dataclass, replace
from typing import Any, Optional

from unisleep.backends._capture import CaptureSpec
from unisleep.backup import BackupStore
from unisleep.driver import Capabilities, Driver, DriverConfig, _Trace
from unisleep.errors import InvalidArgumentError

from . import libc
from .spill_store import SpillStore


_DEFAULT = object()  # an argument left out


@dataclass(eq=False)
class MemfdHandle:
    fd: int
    size: int


class HostDriver(Driver):
    name = "host"
    capabilities = Capabilities(fresh_memory_is_zero=True, views_hold_owner=True, supports_release_behind=True)
    #: 256 MiB chunks: a chunk already written to the spill file is released (on a second thread)
    #: while the next one is written.  A progressive wake reads (and verifies) 32 MiB at a time
    #: (backups are checksummed in pieces of the same size, so each step verifies exactly what it
    #: read), on as many threads as a plain wake uses
    default_config = DriverConfig(chunk_bytes=256 << 20, progressive_piece=32 << 20,
                                  progressive_workers=min(4, os.cpu_count() or 1))
    #: torch's CPU allocator (libc10's ``posix_memalign``/``free``): every CPU tensor of a thread
    #: in an interesting region becomes a region of this driver
    capture_spec = CaptureSpec("libc10", "posix_memalign", "free", "host")

    def __init__(self, device: int = 0, granularity: Optional[int] = None, chunk_bytes: Any = _DEFAULT,
                 retain_backups: bool = False, **options):
        """``chunk_bytes``: the physical chunk size (None: one chunk per region; left out: the
        default config's).  ``retain_backups=True`` (``MemoryLifecycle("host",
        retain_backups=True)``): a full level-1 backup stays in its spill file after the wake, as
        on CUDA — an unchanged tag then skips its copy at the next sleep, and a weight update
        that fails part-way rolls back from it; it costs the spill files' room while awake.
        Off by default."""
        if not isinstance(retain_backups, bool):
            raise InvalidArgumentError(f"retain_backups must be True or False, got {retain_backups!r}")
        super().__init__(device, **options)
        if retain_backups:
            self.capabilities = replace(type(self).capabilities, retain_backups=True)
        page = _mmap.PAGESIZE
        gran = granularity or page
        if gran % page or gran & (gran - 1):
            raise ValueError(f"host granularity must be a power-of-two multiple of the page size {page}, got {gran}")
        self._gran = gran
        if chunk_bytes is not _DEFAULT:
            self.configure(chunk_bytes=chunk_bytes)

    # ---- primitives ------------------------------------------------------------------
    def granularity(self) -> int:
        return self._gran

    def reserve(self, size: int) -> int:
        flags = libc.MAP_PRIVATE | libc.MAP_ANONYMOUS | libc.MAP_NORESERVE
        if self._gran == _mmap.PAGESIZE:
            return libc.mmap(0, size, libc.PROT_NONE, flags)
        # over-reserve, then trim head and tail so the range is granularity-aligned
        raw = libc.mmap(0, size + self._gran, libc.PROT_NONE, flags)
        va = (raw + self._gran - 1) // self._gran * self._gran
        if va > raw:
            libc.munmap(raw, va - raw)
        tail = raw + size + self._gran - (va + size)
        if tail:
            libc.munmap(va + size, tail)
        return va

    def free_address(self, va: int, size: int) -> None:
        libc.munmap(va, size)

    def _memfd(self, size: int, commit: bool) -> MemfdHandle:
        fd = os.memfd_create("unisleep", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            if commit:
                os.posix_fallocate(fd, 0, size)
        except BaseException:
            os.close(fd)
            raise
        return MemfdHandle(fd, size)

    def create(self, size: int) -> MemfdHandle:
        self.wait_releases()  # memory released behind the last sleep is back first
        return self._memfd(size, commit=True)

    def map(self, va: int, size: int, handle: MemfdHandle) -> None:
        libc.mmap(va, size, libc.PROT_READ | libc.PROT_WRITE, libc.MAP_SHARED | libc.MAP_FIXED, handle.fd, 0)

    def unmap(self, va: int, size: int) -> None:
        libc.mmap(
            va, size, libc.PROT_NONE, libc.MAP_PRIVATE | libc.MAP_ANONYMOUS | libc.MAP_FIXED | libc.MAP_NORESERVE
        )

    def release(self, handle: MemfdHandle) -> None:
        if handle.fd >= 0:
            os.close(handle.fd)
            handle.fd = -1

    def physical_bytes(self, handle: MemfdHandle) -> int:
        return os.fstat(handle.fd).st_blocks * 512 if handle.fd >= 0 else 0

    def view(self, va: int, nbytes: int, owner=None):
        import torch

        buf = (ctypes.c_char * nbytes).from_address(va)
        if owner is not None:  # the tensor's storage holds the buffer, the buffer its owner
            buf._unisleep_owner = owner
        return torch.frombuffer(buf, dtype=torch.uint8)

    def zero(self, va: int, nbytes: int) -> None:
        ctypes.memset(va, 0, nbytes)

    def memory_info(self) -> tuple[int, int]:
        """(free, total): the new memory the tightest limit allows — ``MemAvailable``, the room
        under the process's memory cgroup, its address-space limit (:mod:`unisleep.hostmem`) —
        and ``MemTotal`` (or the cgroup's limit, when lower)."""
        from unisleep.hostmem import cgroup_memory, host_room, meminfo

        self.wait_releases()
        total = meminfo().get("MemTotal", 0)
        cg = cgroup_memory()
        if cg is not None:
            total = min(total, cg.limit) if total else cg.limit
        return host_room(mapped=True).available, total

    def new_backup_store(self, budget_bytes, spill_dir) -> BackupStore:
        return SpillStore(budget_bytes, spill_dir)

    def new_file_store(self, budget_bytes, spill_dir, layout: str = "private") -> BackupStore:
        return SpillStore(budget_bytes, spill_dir, layout=layout)

    # ---- composite: write each chunk, release it on another thread while the next is written
    def suspend(self, saves, discards, store: BackupStore):
        """Each full backup is written chunk by chunk (its file was allocated whole before) and
        a chunk is released once its bytes are on disk; discarded regions are released only
        after every backup is written, so a failed write leaves them intact."""
        if not isinstance(store, SpillStore):
            return super().suspend(saves, discards, store)
        tr = _Trace("suspend")
        releaser = _Background()
        copied = 0
        try:
            for job in saves:
                if job.skip_copy:
                    continue
                region = job.region
                if job.ranges == [(0, region.size)]:
                    todo = list(region.chunks)

                    def written(end, todo=todo, region=region):
                        if self.hooks.backup is not None:
                            self.hooks.backup(region.va, end)
                        while todo and todo[0].offset + todo[0].size <= end:
                            releaser.submit(region.release_chunk, self, todo.pop(0))

                    piece = min(region.chunks[0].size, self.config.progressive_piece or region.chunks[0].size)
                    store.save_progressively((job.key, 0), self.view(region.va, region.size), piece, written)
                    copied += region.size
                else:
                    for off, n in job.ranges:
                        store.save((job.key, off), self.view(region.va + off, n))
                        copied += n
            tr.mark("write (releasing under it)")
            if not self.config.release_behind:
                for r in discards:
                    releaser.submit(r.release, self)
        finally:
            released = releaser.join()
        tr.mark("wait releases")
        if self.config.release_behind:  # every write is done: unmap the rest, release it behind the return
            released += self.release_regions(discards)
        released += self.release_regions([job.region for job in saves])
        tr.mark("release the rest")
        tr.done(copied)
        return released, copied


    def resume(self, jobs, store: BackupStore) -> int:
        """Full restores are read back chunk by chunk on several threads (page allocation and
        the copy from the page cache then use every core); the rest as usual."""
        if not isinstance(store, SpillStore):
            return super().resume(jobs, store)
        tr = _Trace("resume")
        full = [j for j in jobs if not j.zero and j.ranges == [(0, j.region.size)]]
        tasks = [(j, c) for j in full for c in j.region.chunks]
        workers = [_Background() for _ in range(max(1, min(len(tasks), os.cpu_count() or 1, 4)))]

        def restore_chunk(job, c):
            job.region.map_chunk(self, c)
            store.load_range((job.key, 0), c.offset, self.view(job.region.va + c.offset, c.size))
            return c.size

        try:
            for i, (job, c) in enumerate(tasks):
                workers[i % len(workers)].submit(restore_chunk, job, c)
        finally:
            errors, copied = [], 0
            for w in workers:
                try:
                    copied += w.join()
                except BaseException as e:  # mapped chunks stay mapped; the tags stay asleep, a retry completes
                    errors.append(e)
            if errors:
                raise errors[0]
        tr.mark(f"restore {len(tasks)} chunks on {len(workers)} threads")
        rest = [j for j in jobs if j not in full]
        copied += super().resume(rest, store) if rest else 0
        tr.mark("the rest")
        tr.done(copied)
        return copied


class _Background:
    """Runs calls in order on one helper thread (inline when no thread can be started, e.g. at
    interpreter shutdown); :meth:`join` waits, re-raises the first error, returns the summed results."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._results: list = []
        self._error: Optional[BaseException] = None
        try:
            self._t: Optional[threading.Thread] = threading.Thread(target=self._run, name="unisleep-release", daemon=True)
            self._t.start()
        except RuntimeError:
            self._t = None

    def submit(self, fn, *args) -> None:
        if self._t is None:
            self._results.append(fn(*args))
        else:
            self._q.put((fn, args))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, args = item
            try:
                self._results.append(fn(*args))
            except BaseException as e:  # reported by join()
                self._error = self._error or e

    def join(self) -> int:
        if self._t is not None:
            self._q.put(None)
            self._t.join()
        if self._error is not None:
            raise self._error
        return sum(self._results)
