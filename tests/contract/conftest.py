"""One driver contract, every backend: the fixture ``backend`` gives a fresh lifecycle on

* ``host`` — the host driver on real memfd memory (spill files on disk);
* ``sim-hip`` — the ROCm driver over the SIMULATED HIP library (tests/sim/fake_hip.py), HIP 6.2;
* ``sim-hip-7.2-4k`` — the same with the HIP 7.2 profile (SetAccess only from a reservation's
  start) and the 4 KiB minimum granularity ROCm reports on gfx950;
* ``sim-acl`` — the Ascend driver over the SIMULATED ACL library (tests/sim/fake_acl.py);
* ``cuda`` — the CUDA driver on a real NVIDIA GPU (marker ``cuda``; skipped without one).

The simulated libraries stand in for vendor runtimes that cannot run here: a pass on them says
the driver and the core keep the contract, not that ROCm or Ascend hardware does.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

MiB = 1 << 20


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.version.cuda else 0
    except Exception:
        return 0


@dataclass
class Backend:
    """A lifecycle under test and what can be read about its device from outside."""

    name: str
    lc: Any
    #: bytes the device (or the kernel, for host memory) really holds for this lifecycle
    device_bytes: Callable[[], int]
    #: allocation sizes that give several chunks (or several regions) on this backend
    unit: int
    simulated: bool
    lib: Optional[Any] = None

    @property
    def driver(self):
        return self.lc.driver

    def random(self, n: int, seed: int):
        import torch

        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)

    def fill(self, tag: str, n: int, seed: int):
        """A tensor of ``n`` random bytes in ``tag`` and a host copy of them."""
        import torch

        t = self.lc.empty(n, torch.uint8, tag=tag)
        host = self.random(n, seed)
        t.copy_(host.to(t.device))
        return t, host

    def host(self, t):
        return t.detach().to("cpu")


def _host(tmp_path):
    from unisleep import MemoryLifecycle
    from unisleep.backends.host import HostDriver

    spill = tmp_path / "spill"
    spill.mkdir()
    drv = HostDriver(chunk_bytes=1 * MiB)
    lc = MemoryLifecycle(drv, spill_dir=str(spill))
    return Backend("host", lc, lambda: lc.resident_bytes(), 1 * MiB, False)


def _sim_hip(tmp_path):
    from sim.fake_hip import FakeHip
    from unisleep import MemoryLifecycle
    from unisleep.backends.rocm import RocmDriver

    lib = FakeHip(granularity=64 << 10, total_bytes=96 * MiB)
    lc = MemoryLifecycle(RocmDriver(lib=lib, tensor_device="cpu", chunk_bytes=1 * MiB, env={}))
    return Backend("sim-hip", lc, lambda: lib.dev.used_bytes, 1 * MiB, True, lib)


def _sim_hip_72_4k(tmp_path):
    from sim.fake_hip import FakeHip
    from unisleep import MemoryLifecycle
    from unisleep.backends.rocm import RocmDriver

    lib = FakeHip(granularity=4 << 10, total_bytes=96 * MiB, runtime_version=70200000)
    lc = MemoryLifecycle(RocmDriver(lib=lib, tensor_device="cpu", chunk_bytes=256 << 10, env={}))
    return Backend("sim-hip-7.2-4k", lc, lambda: lib.dev.used_bytes, 1 * MiB, True, lib)


def _sim_acl(tmp_path):
    from sim.fake_acl import FakeAcl
    from unisleep import MemoryLifecycle
    from unisleep.backends.ascend import AscendDriver

    lib = FakeAcl(granularity=2 * MiB, total_bytes=96 * MiB)
    lc = MemoryLifecycle(AscendDriver(lib=lib, tensor_device="cpu"))
    return Backend("sim-acl", lc, lambda: lib.dev.used_bytes, 2 * MiB, True, lib)


def _cuda(tmp_path):
    from unisleep import MemoryLifecycle

    lc = MemoryLifecycle("cuda")

    def held() -> int:
        free, total = lc.driver.memory_info()
        return total - free

    return Backend("cuda", lc, held, 2 * MiB, False)


MAKERS = {"host": _host, "sim-hip": _sim_hip, "sim-hip-7.2-4k": _sim_hip_72_4k, "sim-acl": _sim_acl, "cuda": _cuda}


@pytest.fixture(params=["host", "sim-hip", "sim-hip-7.2-4k", "sim-acl", pytest.param("cuda", marks=pytest.mark.cuda)])
def backend(request, tmp_path):
    if request.param == "cuda" and _gpu_count() == 0:
        pytest.skip("needs an NVIDIA GPU with a CUDA build of torch (pytest -m cuda tests/contract on one)")
    b = MAKERS[request.param](tmp_path)
    yield b
    b.lc.close()
    if b.lib is not None:
        assert not b.lib.dev.internal_errors, b.lib.dev.internal_errors
        assert not b.lib.dev.reservations and b.lib.dev.used_bytes == 0, "the lifecycle left device memory behind"
        b.lib.close()
