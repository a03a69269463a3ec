"""A reserved address range and the physical chunks mapped into it.

This is the vendor-neutral half of every backend: the *mapping policy*.  A region keeps its
virtual address for its whole life; sleeping it unmaps and releases each chunk's physical
handle, waking it creates and maps new ones at the same offsets.  The chunk size is a policy
parameter: one chunk per region on CUDA, ``VLLM_ROCM_SLEEP_MEM_CHUNK_SIZE`` MB on ROCm (where
``hipMemMap`` maps a whole handle at offset 0), and whatever the host backend is told.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol


class Driver(Protocol):
    """The primitives a region uses (:class:`unisleep.driver.Driver` provides them)."""

    def granularity(self) -> int: ...
    def reserve(self, size: int) -> int: ...
    def free_address(self, va: int, size: int) -> None: ...
    def create(self, size: int) -> Any: ...
    def map(self, va: int, size: int, handle: Any) -> None: ...
    def set_access(self, va: int, size: int) -> None: ...
    def grant_chunk(self, region: "Region", chunk: "Chunk") -> None: ...
    def unmap(self, va: int, size: int) -> None: ...
    def release(self, handle: Any) -> None: ...
    def physical_bytes(self, handle: Any) -> int: ...
    def synchronize(self) -> None: ...


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def chunk_sizes(size: int, chunk_bytes: Optional[int], granularity: int) -> list[int]:
    """Split an aligned ``size`` into chunks of ``chunk_bytes`` (rounded up to the granularity);
    ``None`` or 0 means one chunk."""
    if size % granularity:
        raise ValueError(f"region size {size} is not a multiple of the granularity {granularity}")
    if not chunk_bytes or chunk_bytes >= size:
        return [size]
    chunk = round_up(chunk_bytes, granularity)
    full, rest = divmod(size, chunk)
    return [chunk] * full + ([rest] if rest else [])


@dataclass
class Chunk:
    offset: int
    size: int
    handle: Any = None  # driver handle while mapped, None while asleep


@dataclass
class Region:
    """One reserved address range of ``size`` bytes (a multiple of the granularity)."""

    va: int
    size: int
    chunks: list[Chunk] = field(default_factory=list)

    @classmethod
    def allocate(cls, driver: "Driver", nbytes: int, chunk_bytes: Optional[int] = None) -> "Region":
        gran = driver.granularity()
        size = round_up(max(nbytes, 1), gran)
        va = driver.reserve(size)
        region = cls(va, size, [Chunk(off, sz) for off, sz in _offsets(chunk_sizes(size, chunk_bytes, gran))])
        try:
            region.map(driver)
        except BaseException:
            region.release(driver)
            driver.free_address(va, size)
            raise
        return region

    @property
    def mapped(self) -> bool:
        return all(c.handle is not None for c in self.chunks)

    @property
    def unmapped(self) -> bool:
        return all(c.handle is None for c in self.chunks)

    def map_chunk(self, driver: "Driver", c: Chunk, access: bool = True) -> None:
        """Create and map one unmapped chunk at its offset (same address as before)."""
        if c.handle is not None:
            return
        h = driver.create(c.size)
        try:
            driver.map(self.va + c.offset, c.size, h)
            if access:
                driver.grant_chunk(self, c)
        except BaseException:
            try:
                driver.unmap(self.va + c.offset, c.size)
            except BaseException:  # it may not have been mapped yet; the error that matters is
                pass  # re-raised below, after the handle is released
            driver.release(h)
            raise
        c.handle = h

    def map(self, driver: "Driver", each: Optional[Callable[[Chunk], None]] = None) -> None:
        """Create and map every unmapped chunk; on failure undo what this call mapped.
        ``each(chunk)`` runs on every chunk as soon as it is mapped and accessible (e.g. queue
        its zeroing while the next one is mapped); a failure then first waits for the device."""
        done: list[Chunk] = []
        try:
            for c in self.chunks:
                if c.handle is not None:
                    continue
                self.map_chunk(driver, c, access=each is not None)
                done.append(c)
                if each is not None:
                    each(c)
            if each is None:
                driver.set_access(self.va, self.size)
        except BaseException:
            if each is not None and done:
                driver.synchronize()  # work ``each`` queued may still touch the chunks
            for c in done:
                driver.unmap(self.va + c.offset, c.size)
                driver.release(c.handle)
                c.handle = None
            raise

    def release(self, driver: "Driver") -> int:
        """Unmap (keeping the address) and release every mapped chunk; returns bytes released."""
        return sum(self.release_chunk(driver, c) for c in self.chunks)

    def release_chunk(self, driver: "Driver", c: Chunk) -> int:
        """Unmap and release one chunk (its own mapping); returns bytes released."""
        if c.handle is None:
            return 0
        freed = driver.physical_bytes(c.handle)
        driver.unmap(self.va + c.offset, c.size)
        driver.release(c.handle)
        c.handle = None
        return freed

    def physical_bytes(self, driver: "Driver") -> int:
        return sum(driver.physical_bytes(c.handle) for c in self.chunks if c.handle is not None)

    def free(self, driver: "Driver") -> None:
        self.release(driver)
        driver.free_address(self.va, self.size)


def _offsets(sizes: list[int]):
    off = 0
    for s in sizes:
        yield off, s
        off += s
