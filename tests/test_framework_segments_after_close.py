"""A segment the framework's allocator holds (a region of ``pool(tag)`` or of whole-process
capture, registered with ``register_region``) when its lifecycle closes: its memory goes at
close, its address only when the allocator frees the segment.  close() used to free the
address too; a new reservation could then take it while torch still knew its old block there,
and torch's later free of that block aborted the process (seen on an H200: the CUDA side is
tests/cuda/test_compat_tms_cuda.py::test_a_tensor_outliving_its_closed_facade_is_freed_later_without_ending_the_process).
On the host backend, with real memfd mappings: the address stays reserved (mapped, no access)
after close until the region is freed."""

from __future__ import annotations

from unisleep import MemoryLifecycle
from unisleep.backends._capture import _mapping_of
from unisleep.errors import UnsupportedError
from unisleep.region import Region

MiB = 1 << 20


def _mapped(va: int) -> bool:
    try:
        _mapping_of(va)
    except UnsupportedError:
        return False
    return True


def test_a_framework_segment_keeps_its_address_until_the_allocator_frees_it():
    lc = MemoryLifecycle("host")
    drv = lc.driver
    region = Region.allocate(drv, 2 * MiB, lc.chunk_bytes)
    lc.register_region("framework", region, 2 * MiB)
    own = lc.empty((MiB,), tag="own")  # a lifecycle tensor, for contrast: its lifecycle frees it
    del own
    assert lc.resident_bytes("framework") == 2 * MiB
    lc.close()
    assert region.physical_bytes(drv) == 0  # the memory went at close
    assert _mapped(region.va), "close() freed the address of a segment the framework's allocator still holds"
    assert lc.forget_region(region.va) is None  # what the allocator's free hook hears after close
    region.free(drv)  # ... and then does (backends/_pool.py, backends/_capture.py)
    assert not _mapped(region.va)
