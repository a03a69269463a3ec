"""NUMA placement (unisleep.numa) on this machine's real kernel: the device-node lookup reads
sysfs through a PCI bus id, a range bound to node 0 reads back its policy and its pages lie on
node 0 (whatever number of nodes the machine has: node 0 always exists), through libnuma and
through the raw system calls; the CUDA backend's arena binds each new segment to the node it is
given before faulting it in (its page-locking call, which needs an NVIDIA driver, is the
**simulated** part, as in tests/test_arena_growth.py)."""

from __future__ import annotations

import ctypes
import os

import pytest

from unisleep import numa
from unisleep.backends.host import libc

MiB = 1 << 20


def _anon(n: int) -> int:
    return libc.mmap(0, n, libc.PROT_READ | libc.PROT_WRITE, libc.MAP_PRIVATE | libc.MAP_ANONYMOUS)


def test_node_list_and_bus_id_spellings(tmp_path):
    assert numa.parse_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert numa.online_nodes()[0] == 0
    assert numa.online_nodes(str(tmp_path / "missing")) == [0]
    for spelled in ("00000000:3B:00.0", "0000:3b:00.0", "3b:00.0"):
        assert numa.normalize_bus_id(spelled) == "0000:3b:00.0"
    with pytest.raises(ValueError):
        numa.normalize_bus_id("GPU-1234")


def test_a_devices_node_is_read_from_sysfs():
    """Every PCI device of this machine: the lookup by bus id (in NVIDIA's spelling, upper case
    with an 8-digit domain) gives what its ``numa_node`` file says (None for -1)."""
    root = numa.PCI_DEVICES
    if not os.path.isdir(root) or not os.listdir(root):
        pytest.skip(f"this machine exposes no PCI devices in {root}")
    for bus in sorted(os.listdir(root))[:16]:
        with open(os.path.join(root, bus, "numa_node")) as f:
            raw = int(f.read())
        dom, rest = bus.split(":", 1)
        nvidia_style = f"{int(dom, 16):08X}:{rest.upper()}"
        assert numa.pci_node(nvidia_style) == (raw if raw >= 0 else None), bus
    assert numa.pci_node("0000:ff:1f.7", root=root + "-nowhere") is None


@pytest.mark.parametrize("route", ["default", "syscall"])
def test_bind_to_node_0_reads_back_and_places_the_pages(monkeypatch, route):
    if route == "syscall":  # the route without libnuma
        monkeypatch.setattr(numa, "LIBNUMA", ())
    monkeypatch.setattr(numa, "_CALLS", None)
    if numa._calls().problem:
        pytest.skip(numa._calls().problem)
    if route == "syscall":
        assert numa.how().startswith("syscall(2)")
    n = 8 * MiB
    for mode in (numa.MPOL_PREFERRED, numa.MPOL_BIND):
        addr = _anon(n)
        try:
            assert numa.bind(addr, n, 0, mode), numa.why_not()
            assert numa.policy_of(addr) == (mode, [0])
            assert set(numa.page_nodes(addr, n)) == {-2}  # -ENOENT: not faulted in yet
            ctypes.memset(addr, 1, n)
            assert set(numa.page_nodes(addr, n)) == {0}
        finally:
            libc.munmap(addr, n)
    addr = _anon(n)
    try:  # a node that does not exist is refused, and said why
        assert numa.bind(addr, n, max(numa.online_nodes()) + 1, numa.MPOL_BIND) is False
        assert "EINVAL" in numa.why_not()
        assert numa.policy_of(addr) == (numa.MPOL_DEFAULT, [])
    finally:
        libc.munmap(addr, n)


def test_placement_says_what_it_does():
    p = numa.placement(0)
    if len(numa.online_nodes()) < 2:
        assert p["bind"] is None and p["why"].startswith("one NUMA node")
    else:
        assert p["bind"] == 0
    assert numa.placement(None)["bind"] is None


def test_the_arena_binds_each_new_segment_before_faulting_it_in(monkeypatch):
    from unisleep.backends.cuda import arena as ar

    seg = 2 * MiB
    monkeypatch.setattr(ar, "SEGMENT", seg)

    class Arena(ar.PinnedArena):
        def _page_lock(self, addr, size):  # SIMULATED: cuMemHostRegister needs an NVIDIA driver
            return ar.Segment(addr, size, [(0, size)], 0)

        def _unlock(self, seg):  # SIMULATED: nothing was registered
            pass

    auto = Arena(0, None)
    try:
        if len(numa.online_nodes()) < 2:
            assert auto.placement()["bind"] is None and "one NUMA node" in auto.placement()["why"]
    finally:
        auto.close()
    a = Arena(0, None, numa_node=0)
    try:
        a.prepare(3 * seg, background=False)
        assert a.placement()["bind"] == 0
        for s in a._segs:
            assert numa.policy_of(s.addr) == (numa.MPOL_PREFERRED, [0])
        nodes = a.page_nodes()
        assert nodes and set(nodes) == {0}
        a.numa_node = None  # changed later: new segments follow
        assert a.placement()["bind"] is None
    finally:
        a.close()
