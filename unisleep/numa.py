"""NUMA placement of host memory, best effort: which node a device sits on, binding a mapped
range to a node before it is faulted in, and reading back where its pages are.

* :func:`online_nodes` — ``/sys/devices/system/node/online``;
* :func:`pci_node` — a PCI device's node from ``/sys/bus/pci/devices/<bus id>/numa_node``
  (None where the firmware gives none, ``-1``);
* :func:`bind` — ``mbind(MPOL_PREFERRED)`` of ``[addr, addr + size)`` to one node: pages faulted in
  afterwards are taken from that node while it has free memory, and from the others after that
  (never a failed allocation, never the OOM killer for want of one node's memory);
* :func:`page_nodes` — ``move_pages`` with no target: the node each page lies on now;
* :func:`policy_of` — ``get_mempolicy(MPOL_F_ADDR)``: the policy and nodes bound to an address.

The calls go through libnuma (``libnuma.so.1``) where it is installed, else straight to the
kernel with ``syscall(2)`` (x86-64, aarch64, ppc64le).  Nothing here raises for want of NUMA:
:func:`bind` returns False (and :func:`why_not` says why) where it cannot bind.
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Optional

MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND = 0, 1, 2
MPOL_F_NODE, MPOL_F_ADDR = 1 << 0, 1 << 1
#: the node masks passed to the kernel hold this many bits (the kernel reads ``maxnode - 1``)
MASK_BITS = 1024
_WORDS = MASK_BITS // (8 * ctypes.sizeof(ctypes.c_ulong))

#: syscall numbers by machine: mbind, get_mempolicy, move_pages
SYSCALLS = {
    "x86_64": (237, 239, 279),
    "aarch64": (235, 236, 239),
    "arm64": (235, 236, 239),
    "ppc64le": (259, 260, 301),
}

NODE_ONLINE = "/sys/devices/system/node/online"
LIBNUMA = ("libnuma.so.1", "libnuma.so")
PCI_DEVICES = "/sys/bus/pci/devices"


def parse_list(text: str) -> list[int]:
    """A kernel cpu/node list (``"0-3,8,10-11"``) as ints."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def online_nodes(path: str = NODE_ONLINE) -> list[int]:
    """The NUMA nodes online ([0] where the kernel has no NUMA directory: one node)."""
    try:
        with open(path) as f:
            return parse_list(f.read()) or [0]
    except OSError:
        return [0]


def normalize_bus_id(bus_id: str) -> str:
    """``"00000000:3B:00.0"`` / ``"0000:3b:00.0"`` -> ``"0000:3b:00.0"`` (sysfs spelling)."""
    s = bus_id.strip().lower()
    parts = s.split(":")
    if len(parts) == 2:
        parts = ["0"] + parts
    if len(parts) != 3 or "." not in parts[2]:
        raise ValueError(f"not a PCI bus id: {bus_id!r} (domain:bus:device.function)")
    dev, fn = parts[2].split(".", 1)
    return f"{int(parts[0], 16):04x}:{int(parts[1], 16):02x}:{int(dev, 16):02x}.{int(fn, 16):x}"


def pci_node(bus_id: str, root: str = PCI_DEVICES) -> Optional[int]:
    """The NUMA node of the PCI device ``bus_id`` (None when sysfs does not say: no such
    device, or ``numa_node`` reads -1 as on one-node machines and some virtual machines)."""
    try:
        with open(os.path.join(root, normalize_bus_id(bus_id), "numa_node")) as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


# ---------------------------------------------------------------------------------- the calls
class _Calls:
    def __init__(self):
        self.how, self.problem = "", None
        self._mbind = self._get_mempolicy = self._move_pages = None
        lib = path = None
        for path in LIBNUMA:  # by soname: ctypes.util.find_library would start a process
            try:
                lib = ctypes.CDLL(path, use_errno=True)
                break
            except OSError:
                lib = None
        if lib is not None and all(hasattr(lib, n) for n in ("mbind", "get_mempolicy", "move_pages")):
            self.how = f"libnuma ({path})"
            self._mbind, self._get_mempolicy, self._move_pages = lib.mbind, lib.get_mempolicy, lib.move_pages
            self._mbind.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong,
                                    ctypes.c_uint]
            self._get_mempolicy.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_ulong,
                                            ctypes.c_void_p, ctypes.c_ulong]
            self._move_pages.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_void_p, ctypes.c_int]
            self._move_pages.restype = ctypes.c_long
            return
        nums = SYSCALLS.get(os.uname().machine)
        if nums is None:
            self.problem = f"no libnuma and no known NUMA syscall numbers for {os.uname().machine}"
            return
        libc = ctypes.CDLL(None, use_errno=True)
        sc = libc.syscall
        sc.restype = ctypes.c_long
        mb, gm, mp = nums
        self.how = f"syscall(2) ({os.uname().machine}: mbind {mb}, get_mempolicy {gm}, move_pages {mp})"
        L, P = ctypes.c_long, ctypes.c_void_p
        self._mbind = lambda a, n, mode, mask, maxn, fl: sc(L(mb), P(a), ctypes.c_ulong(n), ctypes.c_int(mode),
                                                            P(mask), ctypes.c_ulong(maxn), ctypes.c_uint(fl))
        self._get_mempolicy = lambda modep, mask, maxn, addr, fl: sc(L(gm), modep, P(mask), ctypes.c_ulong(maxn),
                                                                     P(addr), ctypes.c_ulong(fl))
        self._move_pages = lambda pid, cnt, pages, nodes, status, fl: sc(L(mp), ctypes.c_int(pid), ctypes.c_ulong(cnt),
                                                                         P(pages), P(nodes), P(status), ctypes.c_int(fl))


_CALLS: Optional[_Calls] = None


def _calls() -> _Calls:
    global _CALLS
    if _CALLS is None:
        _CALLS = _Calls()
    return _CALLS


def how() -> str:
    """Which route the calls take (libnuma, or the raw syscalls), or why none."""
    c = _calls()
    return c.how or f"none: {c.problem}"


def _mask(nodes) -> ctypes.Array:
    arr = (ctypes.c_ulong * _WORDS)()
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    for n in nodes:
        if not 0 <= n < MASK_BITS:
            raise ValueError(f"NUMA node {n} is out of range 0..{MASK_BITS - 1}")
        arr[n // bits] |= 1 << (n % bits)
    return arr


def bind(addr: int, size: int, node: int, mode: int = MPOL_PREFERRED) -> bool:
    """Bind ``[addr, addr + size)`` (page-aligned, mapped, not yet faulted in) to ``node`` with
    ``mode`` (default ``MPOL_PREFERRED``).  True when the kernel took the policy; False (with
    :func:`why_not`) when it could not."""
    global _last_error
    c = _calls()
    if c._mbind is None:
        _last_error = c.problem
        return False
    mask = _mask([node])
    ctypes.set_errno(0)
    rc = c._mbind(addr, size, mode, ctypes.addressof(mask), MASK_BITS + 1, 0)
    if rc != 0:
        e = ctypes.get_errno()
        _last_error = f"mbind(node {node}) failed: {errno.errorcode.get(e, e)} {os.strerror(e)}"
        return False
    _last_error = None
    return True


_last_error: Optional[str] = None


def why_not() -> Optional[str]:
    """Why the last :func:`bind` returned False (None after a success)."""
    return _last_error


def policy_of(addr: int) -> tuple[int, list[int]]:
    """(mode, nodes) of the policy bound to the page at ``addr`` (``MPOL_DEFAULT`` and [] where
    none is); raises OSError when the kernel refuses."""
    c = _calls()
    if c._get_mempolicy is None:
        raise OSError(errno.ENOSYS, c.problem)
    mode = ctypes.c_int(-1)
    mask = (ctypes.c_ulong * _WORDS)()
    ctypes.set_errno(0)
    rc = c._get_mempolicy(ctypes.byref(mode), ctypes.addressof(mask), MASK_BITS + 1, addr, MPOL_F_ADDR)
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"get_mempolicy: {os.strerror(e)}")
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    nodes = [w * bits + b for w in range(_WORDS) for b in range(bits) if mask[w] >> b & 1]
    return mode.value, nodes


def page_nodes(addr: int, size: int, sample: int = 64) -> list[int]:
    """The node of up to ``sample`` pages spread over ``[addr, addr + size)`` (faulted-in pages;
    a negative value is ``-errno`` for a page the kernel could not place, e.g. ``-ENOENT`` for
    one not faulted in)."""
    c = _calls()
    if c._move_pages is None:
        raise OSError(errno.ENOSYS, c.problem)
    page = os.sysconf("SC_PAGE_SIZE")
    npages = max(1, size // page)
    step = max(1, npages // max(1, sample))
    addrs = [addr + i * page for i in range(0, npages, step)][:sample]
    pages = (ctypes.c_void_p * len(addrs))(*addrs)
    status = (ctypes.c_int * len(addrs))()
    ctypes.set_errno(0)
    rc = c._move_pages(0, len(addrs), ctypes.addressof(pages), None, ctypes.addressof(status), 0)
    if rc < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"move_pages: {os.strerror(e)}")
    return list(status)


def placement(device_node: Optional[int]) -> dict:
    """What a backup store does on this host, for reports: ``{"nodes": [...], "device_node":
    n or None, "bind": node or None, "why": "..."}``."""
    nodes = online_nodes()
    if len(nodes) < 2:
        return {"nodes": nodes, "device_node": device_node, "bind": None,
                "why": f"one NUMA node ({nodes[0] if nodes else 0}): nothing to choose"}
    if device_node is None:
        return {"nodes": nodes, "device_node": None, "bind": None,
                "why": "the device's NUMA node is not known (sysfs numa_node reads -1): pages go where the "
                       "faulting thread runs"}
    if device_node not in nodes:
        return {"nodes": nodes, "device_node": device_node, "bind": None,
                "why": f"the device's node {device_node} is not online ({nodes})"}
    return {"nodes": nodes, "device_node": device_node, "bind": device_node,
            "why": f"{len(nodes)} NUMA nodes: bound to the device's node {device_node} (MPOL_PREFERRED)"}
