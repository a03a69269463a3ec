"""The host's memory bandwidth, measured in the same run as ``unisleep bench --devices``: a
multi-threaded memcpy inside each NUMA node (source, destination and threads on that node), each
node alone, then every node at once.

A copy of ``n`` bytes reads ``n`` and writes ``n``: the figures are the bytes copied per second
(``copied_gbps``) and the DRAM traffic that is (``traffic_gbps``, reads plus writes, twice the
bytes copied).  The buffers are anonymous mappings bound to the node (:func:`unisleep.numa.bind`,
``MPOL_PREFERRED``) and faulted in by the node's own threads before anything is timed; each
thread is pinned to the node's CPUs (those this process may run on).  ``ctypes.memmove`` drops
the interpreter lock, so the threads copy in parallel.  Best of ``repeat`` passes.  Where the host
has one node (or no NUMA directory), that node is every CPU this process may use.  Every wait
here (the threads' start and end) is bounded by ``timeout_s``.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Optional

from .. import numa
from ..backends.host import libc

NODE_CPULIST = "/sys/devices/system/node/node{}/cpulist"
#: threads per node at most (memory bandwidth is reached well before this on current sockets)
MAX_THREADS = 32
#: each thread copies pieces of at most this size (the pieces of one thread are contiguous)
PIECE = 64 << 20


def node_cpus(node: int) -> list[int]:
    """The CPUs of ``node`` this process may run on (every allowed CPU where sysfs has no node
    directory)."""
    allowed = sorted(os.sched_getaffinity(0))
    try:
        with open(NODE_CPULIST.format(node)) as f:
            cpus = [c for c in numa.parse_list(f.read()) if c in set(allowed)]
    except OSError:
        return allowed
    return cpus


class _NodeCopy:
    """A source and a destination of ``size`` bytes on ``node``, and the threads that copy one
    into the other."""

    def __init__(self, node: int, size: int, threads: Optional[int]):
        self.node, self.size = node, size
        self.cpus = node_cpus(node) or sorted(os.sched_getaffinity(0))
        self.nthreads = max(1, min(threads or len(self.cpus), MAX_THREADS, max(1, size // (1 << 20))))
        self.src = self.dst = 0
        self.bound = True
        prot, flags = libc.PROT_READ | libc.PROT_WRITE, libc.MAP_PRIVATE | libc.MAP_ANONYMOUS
        self.src = libc.mmap(0, size, prot, flags)
        try:
            self.dst = libc.mmap(0, size, prot, flags)
        except BaseException:
            self.close()
            raise
        if len(numa.online_nodes()) > 1:
            self.bound = numa.bind(self.src, size, node) and numa.bind(self.dst, size, node)
        self.why_not_bound = None if self.bound else numa.why_not()

    def slices(self) -> list[tuple[int, int]]:
        step = -(-self.size // self.nthreads)
        step = (step + 4095) // 4096 * 4096
        return [(o, min(step, self.size - o)) for o in range(0, self.size, step)]

    def work(self, fault_in: bool):
        """One callable per thread: pin to the node's CPUs, then fault in (memset) or copy."""
        def one(off: int, n: int):
            def run():
                try:
                    os.sched_setaffinity(0, self.cpus)  # this thread only (Linux: per thread)
                except OSError:
                    pass
                done = 0
                while done < n:
                    k = min(PIECE, n - done)
                    if fault_in:
                        ctypes.memset(self.src + off + done, 0x5A, k)
                        ctypes.memset(self.dst + off + done, 0, k)
                    else:
                        ctypes.memmove(self.dst + off + done, self.src + off + done, k)
                    done += k
            return run
        return [one(o, n) for o, n in self.slices()]

    def pages(self) -> tuple[int, int]:
        """(pages of the source and destination found on the node, pages sampled)."""
        try:
            got = numa.page_nodes(self.src, self.size, 32) + numa.page_nodes(self.dst, self.size, 32)
        except OSError:
            return 0, 0
        return sum(1 for p in got if p == self.node), len(got)

    def close(self) -> None:
        for a in (getattr(self, "src", 0), getattr(self, "dst", 0)):
            if a:
                libc.munmap(a, self.size)
        self.src = self.dst = 0


def _run_threads(fns, timeout_s: float) -> float:
    """Start one thread per callable behind a barrier; the seconds from the barrier to the last
    end.  Raises TimeoutError when they do not end within ``timeout_s``."""
    barrier = threading.Barrier(len(fns) + 1, timeout=timeout_s)
    errors: list[BaseException] = []

    def wrap(fn):
        def run():
            try:
                barrier.wait()
                fn()
            except BaseException as e:  # reported below
                errors.append(e)
        return run

    ts = [threading.Thread(target=wrap(f), daemon=True) for f in fns]
    for t in ts:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    for t in ts:
        t.join(max(0.0, deadline - time.monotonic()))
    dt = time.perf_counter() - t0
    if any(t.is_alive() for t in ts):
        raise TimeoutError(f"the host memcpy threads did not finish within {timeout_s:g} s")
    if errors:
        raise errors[0]
    return dt


def measure(size: int, threads: Optional[int] = None, repeat: int = 3, timeout_s: float = 120.0) -> dict:
    """The host's memcpy bandwidth: ``{"nodes": [row per node alone], "all": row with every node
    at once, "how": ..., "size_bytes": size}``; a row: ``node``, ``threads``, ``cpus``,
    ``copied_gbps``, ``traffic_gbps``, ``pages_on_node``/``pages_sampled``, ``bound``."""
    nodes = numa.online_nodes()
    copies = []
    try:
        for node in nodes:
            copies.append(_NodeCopy(node, size, threads))
        for c in copies:  # faulted in by the node's own threads, untimed
            _run_threads(c.work(True), timeout_s)
        rows = []
        for c in copies:
            best = min(_run_threads(c.work(False), timeout_s) for _ in range(repeat))
            on, sampled = c.pages()
            rows.append({"node": c.node, "threads": c.nthreads, "cpus": len(c.cpus), "seconds": best,
                         "copied_gbps": size / best / 1e9, "traffic_gbps": 2 * size / best / 1e9,
                         "pages_on_node": on, "pages_sampled": sampled, "bound": c.bound,
                         "why_not_bound": c.why_not_bound})
        every = [f for c in copies for f in c.work(False)]
        best = min(_run_threads(every, timeout_s) for _ in range(repeat))
        total = size * len(copies)
        all_row = {"nodes": nodes, "threads": len(every), "seconds": best, "copied_gbps": total / best / 1e9,
                   "traffic_gbps": 2 * total / best / 1e9}
    finally:
        for c in copies:
            c.close()
    return {"nodes": rows, "all": all_row, "size_bytes": size, "repeat": repeat, "calls": numa.how()}
