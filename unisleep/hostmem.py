"""Host memory: how much a backup may take before the kernel would kill someone, and how much
the backups of this process hold.

* :func:`host_room` reads every limit that bounds new host memory of this process — what the
  kernel has available (``MemAvailable``), the room left under its memory cgroup (v2
  ``memory.max`` − ``memory.current`` at every level up the hierarchy, v1
  ``memory.limit_in_bytes`` / ``hierarchical_memory_limit`` − ``memory.usage_in_bytes``; the
  cgroup's reclaimable page cache, ``inactive_file``, counts as room), its address-space and data
  limits (``RLIMIT_AS``, ``RLIMIT_DATA``) for memory it maps, and its locked-memory limit
  (``RLIMIT_MEMLOCK``, unless it holds ``CAP_IPC_LOCK``) for memory it page-locks with ``mlock``;
* :func:`check_host_room` refuses, with :class:`~unisleep.errors.HostMemoryError` naming what is
  needed, what is available and under which limit, a backup that would not fit — before anything
  is pinned or released, so the answer is an error in this process instead of an OOM kill of
  whichever process the kernel picks (in a cgroup: possibly a neighbour in the same container);
* :func:`backups_of_process` sums what the backups of every open lifecycle of the process hold
  (pinned / pageable / on disk), for ``unisleep doctor`` and the demo's memory table.

Reading is cheap (a few small files under ``/proc`` and the cgroup file system) and never
raises: a limit that cannot be read is left out (and named in :attr:`HostRoom.unreadable`).
"""

from __future__ import annotations

import os
import resource
import threading
import weakref
from dataclasses import dataclass, field
from typing import Optional

from .errors import HostMemoryError, InvalidArgumentError
from .units import human_bytes

#: a cgroup or rlimit value at least this large is "no limit" (v1 writes 2^63 rounded to pages)
UNLIMITED = 1 << 60
CAP_IPC_LOCK = 14

MEMINFO = "/proc/meminfo"
SELF_CGROUP = "/proc/self/cgroup"
SELF_MOUNTINFO = "/proc/self/mountinfo"
SELF_STATUS = "/proc/self/status"


@dataclass(frozen=True)
class Limit:
    """One limit on new host memory: its ``name`` (e.g. ``"MemAvailable"``, ``"cgroup v2
    /sys/fs/cgroup/x memory.max"``, ``"RLIMIT_AS"``), the bytes still ``available`` under it,
    and how that was read (``detail``)."""

    name: str
    available: int
    detail: str
    #: the limit applies to the whole machine or cgroup (headroom is kept below it), not to
    #: this process alone
    shared: bool = True


@dataclass
class HostRoom:
    """Every limit read (:class:`Limit`), tightest first by :attr:`available`."""

    limits: list[Limit] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)

    @property
    def available(self) -> int:
        """Bytes of new host memory the tightest limit allows (0 when nothing could be read)."""
        return min((l.available for l in self.limits), default=0)

    @property
    def tightest(self) -> Optional[Limit]:
        return min(self.limits, key=lambda l: l.available, default=None)

    def as_dict(self) -> dict:
        return {"available": self.available,
                "limits": [{"name": l.name, "available": l.available, "detail": l.detail} for l in self.limits],
                "unreadable": list(self.unreadable)}

    def describe(self) -> str:
        return "; ".join(f"{l.name}: {human_bytes(l.available)} available ({l.detail})" for l in self.limits)


#: what happens to host backups after a wake (``MemoryLifecycle(host_backups=...)``)
HOST_BACKUPS = ("keep", "release")
#: the environment variable read when ``host_backups`` is not given
HOST_BACKUPS_ENV = "UNISLEEP_HOST_BACKUPS"
#: the default (docs/lifecycle.md, "Host memory after a wake", has the measurements behind it)
DEFAULT_HOST_BACKUPS = "keep"


def host_backups_setting(value: Optional[str]) -> str:
    """``value`` checked, or (None) the ``UNISLEEP_HOST_BACKUPS`` environment variable, or the
    default ``"keep"``; anything else raises :class:`~unisleep.errors.InvalidArgumentError`."""
    src = "host_backups"
    if value is None:
        env = os.environ.get(HOST_BACKUPS_ENV, "").strip()
        if not env:
            return DEFAULT_HOST_BACKUPS
        value, src = env.lower(), HOST_BACKUPS_ENV
    if value not in HOST_BACKUPS:
        raise InvalidArgumentError(
            f"{src} must be 'keep' (host backups stay after a wake: the next sleep reuses their room, an unchanged "
            f"tag skips its copy) or 'release' (host memory given back at every wake), got {value!r}")
    return value


# ---------------------------------------------------------------------------------- readers
def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (empty when it cannot be read)."""
    out: dict[str, int] = {}
    text = _read(MEMINFO) or ""
    for line in text.splitlines():
        k, _, v = line.partition(":")
        parts = v.split()
        if parts and parts[0].isdigit():
            out[k] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


def process_status() -> dict[str, str]:
    """``/proc/self/status`` as name -> raw value."""
    out: dict[str, str] = {}
    for line in (_read(SELF_STATUS) or "").splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


def _status_bytes(status: dict[str, str], key: str) -> int:
    v = status.get(key, "").split()
    return int(v[0]) * 1024 if v and v[0].isdigit() else 0


def has_ipc_lock(status: Optional[dict[str, str]] = None) -> bool:
    """The process holds ``CAP_IPC_LOCK`` in its effective set (then ``RLIMIT_MEMLOCK`` does not
    bound what it locks)."""
    status = process_status() if status is None else status
    try:
        return bool(int(status.get("CapEff", "0"), 16) >> CAP_IPC_LOCK & 1)
    except ValueError:
        return False


@dataclass(frozen=True)
class CgroupMemory:
    """The memory limit of the process's cgroup where it is tightest: ``version`` (1 or 2), the
    cgroup ``path`` whose limit binds, ``limit`` and ``usage`` there, the ``reclaimable`` page
    cache (``inactive_file``) in that usage, and what is ``available`` (limit − usage +
    reclaimable)."""

    version: int
    path: str
    limit: int
    usage: int
    reclaimable: int

    @property
    def available(self) -> int:
        return max(0, self.limit - self.usage + self.reclaimable)


def _mounts(mountinfo: str) -> list[tuple[str, str, str, str]]:
    """(root, mount point, fs type, super options) of every cgroup file system mounted."""
    out = []
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(" - ")
        if not sep:
            continue
        f, p = pre.split(), post.split()
        if len(f) < 5 or len(p) < 3 or p[0] not in ("cgroup", "cgroup2"):
            continue
        out.append((f[3].replace("\\040", " "), f[4].replace("\\040", " "), p[0], p[2]))
    return out


def _cgroup_dir(mount_root: str, mount_point: str, path: str) -> str:
    """Where the cgroup ``path`` (as /proc/self/cgroup names it) lives under a mount of the
    hierarchy whose own root is ``mount_root`` (a container sees only its part)."""
    root = mount_root.rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root):]
    elif root and not path.startswith(root):  # a namespace hides the prefix: path is already relative
        pass
    return os.path.normpath(mount_point + "/" + path.lstrip("/"))


def _int_file(path: str) -> Optional[int]:
    text = _read(path)
    if text is None:
        return None
    text = text.strip()
    if text == "max":
        return UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: str, key: str) -> int:
    for line in (_read(path) or "").splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            try:
                return int(v)
            except ValueError:
                return 0
    return 0


def cgroup_memory(proc_cgroup: Optional[str] = None, mountinfo: Optional[str] = None) -> Optional[CgroupMemory]:
    """The memory limit of this process's cgroup where it is tightest, or None when the process
    is under no memory limit (or the cgroup file system cannot be read).  ``proc_cgroup`` and
    ``mountinfo`` replace the contents of ``/proc/self/cgroup`` and ``/proc/self/mountinfo``."""
    proc_cgroup = _read(SELF_CGROUP) if proc_cgroup is None else proc_cgroup
    mountinfo = _read(SELF_MOUNTINFO) if mountinfo is None else mountinfo
    if not proc_cgroup or not mountinfo:
        return None
    v1_path = v2_path = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, ctrls, path = parts
        if hier == "0" and ctrls == "":
            v2_path = path
        elif "memory" in ctrls.split(","):
            v1_path = path
    mounts = _mounts(mountinfo)
    if v1_path is not None:  # the memory controller is on a v1 hierarchy (v1 or hybrid set-up)
        for root, point, fstype, opts in mounts:
            if fstype == "cgroup" and "memory" in opts.split(","):
                return _v1(_cgroup_dir(root, point, v1_path))
    if v2_path is not None:
        for root, point, fstype, _ in mounts:
            if fstype == "cgroup2":
                return _v2(_cgroup_dir(root, point, v2_path), point)
    return None


def _v1(d: str) -> Optional[CgroupMemory]:
    limit = _int_file(os.path.join(d, "memory.limit_in_bytes"))
    usage = _int_file(os.path.join(d, "memory.usage_in_bytes"))
    if limit is None or usage is None:
        return None
    stat = os.path.join(d, "memory.stat")
    hier = _stat_value(stat, "hierarchical_memory_limit") or limit
    limit = min(limit, hier)
    if limit >= UNLIMITED:
        return None
    return CgroupMemory(1, d, limit, usage, _stat_value(stat, "total_inactive_file"))


def _v2(d: str, mount_point: str) -> Optional[CgroupMemory]:
    """The tightest level from ``d`` up to (not including) the hierarchy's root."""
    best: Optional[CgroupMemory] = None
    mount_point = os.path.normpath(mount_point)
    while True:
        if d == mount_point or not d.startswith(mount_point):
            break
        limit = _int_file(os.path.join(d, "memory.max"))
        usage = _int_file(os.path.join(d, "memory.current"))
        if limit is not None and usage is not None and limit < UNLIMITED:
            c = CgroupMemory(2, d, limit, usage, _stat_value(os.path.join(d, "memory.stat"), "inactive_file"))
            if best is None or c.available < best.available:
                best = c
        d = os.path.dirname(d)
    return best


def host_room(*, mapped: bool = True, locked: bool = False) -> HostRoom:
    """Every limit on new host memory of this process.  ``mapped``: the memory is new mappings
    of this process (``RLIMIT_AS``, and ``RLIMIT_DATA`` for private ones, bound it); ``locked``:
    it is page-locked with ``mlock`` (``RLIMIT_MEMLOCK`` bounds it unless the process holds
    ``CAP_IPC_LOCK``)."""
    room = HostRoom()
    info = meminfo()
    if "MemAvailable" in info:
        room.limits.append(Limit("MemAvailable", info["MemAvailable"],
                                 f"/proc/meminfo, of {human_bytes(info.get('MemTotal', 0))} in total"))
    else:
        room.unreadable.append("/proc/meminfo MemAvailable")
    try:
        cg = cgroup_memory()
    except Exception as e:  # a cgroup file system laid out in a way not foreseen: say so, go on
        cg = None
        room.unreadable.append(f"the memory cgroup ({type(e).__name__}: {e})")
    if cg is not None:
        name = "memory.max" if cg.version == 2 else "memory.limit_in_bytes"
        room.limits.append(Limit(
            f"cgroup v{cg.version} {cg.path} {name}", cg.available,
            f"limit {human_bytes(cg.limit)}, {human_bytes(cg.usage)} in use of which {human_bytes(cg.reclaimable)} "
            "is reclaimable page cache"))
    status = process_status() if (mapped or locked) else {}
    if mapped:
        for rl, name, key in ((resource.RLIMIT_AS, "RLIMIT_AS", "VmSize"), (resource.RLIMIT_DATA, "RLIMIT_DATA", "VmData")):
            soft = resource.getrlimit(rl)[0]
            if soft != resource.RLIM_INFINITY and soft < UNLIMITED:
                used = _status_bytes(status, key)
                room.limits.append(Limit(name, max(0, soft - used),
                                         f"ulimit {human_bytes(soft)}, {human_bytes(used)} mapped ({key})", shared=False))
    if locked and not has_ipc_lock(status):
        soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
        if soft != resource.RLIM_INFINITY and soft < UNLIMITED:
            used = _status_bytes(status, "VmLck")
            room.limits.append(Limit("RLIMIT_MEMLOCK", max(0, soft - used),
                                     f"ulimit -l {human_bytes(soft)}, {human_bytes(used)} locked (VmLck)", shared=False))
    room.limits.sort(key=lambda l: l.available)
    return room


def available_bytes(*, mapped: bool = True, locked: bool = False) -> int:
    """:attr:`HostRoom.available` of :func:`host_room` (0 when nothing could be read)."""
    return host_room(mapped=mapped, locked=locked).available


def check_host_room(need: int, *, what: str, headroom: int = 0, mapped: bool = True, locked: bool = False,
                    fix: str = "") -> HostRoom:
    """Raise :class:`~unisleep.errors.HostMemoryError` unless ``need`` more bytes of host memory
    fit under every limit (``headroom`` more are kept free below the machine's and the cgroup's
    limits, none below the process's own ulimits).  ``what`` names the memory in the message
    (e.g. "a level-1 backup of 8.00 GiB of tag(s) 'weights'"); ``fix`` is added to the standard
    advice.  Returns the limits read."""
    room = host_room(mapped=mapped, locked=locked)
    if need <= 0:
        return room
    for lim in room.limits:
        want = need + (headroom if lim.shared else 0)
        if want > lim.available:
            keep = f" (+ {human_bytes(headroom)} kept free)" if lim.shared and headroom else ""
            raise HostMemoryError(
                f"{what} needs {human_bytes(need)} of host memory{keep}, but only {human_bytes(lim.available)} is "
                f"available under {lim.name} ({lim.detail}). Every limit read: {room.describe()}. "
                + (fix + " " if fix else "")
                + "Free host memory or raise that limit, sleep at level 2 (no backup), or back up to disk "
                  "(MemoryLifecycle(backup_to='disk', spill_dir=...)). Nothing was pinned or released.",
                needed=need, available=lim.available, limit=lim.name,
                limits={l.name: l.available for l in room.limits})
    return room


# ---------------------------------------------------------------------------------- the process's backups
_OPEN: "weakref.WeakSet" = weakref.WeakSet()
_OPEN_LOCK = threading.Lock()


def track(lifecycle) -> None:
    """Count ``lifecycle``'s backups in :func:`backups_of_process` while it is open."""
    with _OPEN_LOCK:
        _OPEN.add(lifecycle)


def backups_of_process() -> dict[str, int]:
    """What the backups of every open lifecycle of this process hold now, summed:
    ``{"pinned", "pageable", "disk", "held", "lifecycles"}`` (bytes; see
    :meth:`MemoryLifecycle.backup_resident_bytes <unisleep.MemoryLifecycle.backup_resident_bytes>`)."""
    with _OPEN_LOCK:
        lcs = list(_OPEN)
    out = {"pinned": 0, "pageable": 0, "disk": 0, "held": 0, "lifecycles": 0}
    for lc in lcs:
        if lc.closed:
            continue
        try:
            r = lc.backup_resident_bytes()
        except Exception:  # closed meanwhile
            continue
        for k in ("pinned", "pageable", "disk", "held"):
            out[k] += r[k]
        out["lifecycles"] += 1
    return out
