"""Host memory a backup may take (unisleep.hostmem), on the CPU.

* The limits are read from the kernel's files: the cgroup reading is checked on a directory tree
  laid out as the cgroup file system is (v1, v2 with a tighter parent, a container's view), and
  on the real one where the machine lets a test make a memory cgroup.
* The refusals run in a child process under a **real** limit the child sets on itself
  (``RLIMIT_AS``, ``RLIMIT_MEMLOCK``): the CUDA backend's pinned arena refuses to grow before it
  maps or pins anything (its growth is plain host memory; only its page-locking call needs an
  NVIDIA driver, and it is never reached), the host backend refuses an allocation with a named
  error instead of ``ENOMEM``, and the locked-memory check agrees with what ``mlock`` does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from unisleep import hostmem
from unisleep.errors import HostMemoryError, InvalidArgumentError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB, GiB = 1 << 20, 1 << 30


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


# ---------------------------------------------------------------------------- reading the cgroup
def test_cgroup_v2_takes_the_tightest_level_up_the_hierarchy(tmp_path):
    """The files are the kernel's stand-ins (a directory tree laid out as cgroup2 is)."""
    fs = tmp_path / "cg"
    _write(f"{fs}/job/memory.max", "8589934592\n")  # 8 GiB for the whole job
    _write(f"{fs}/job/memory.current", str(7 * GiB))
    _write(f"{fs}/job/memory.stat", f"anon 1\ninactive_file {512 * MiB}\n")
    _write(f"{fs}/job/rank0/memory.max", "max\n")  # the process's own cgroup: no limit of its own
    _write(f"{fs}/job/rank0/memory.current", str(3 * GiB))
    _write(f"{fs}/job/rank0/memory.stat", "inactive_file 0\n")
    mountinfo = f"30 1 0:26 / {fs} rw,nosuid - cgroup2 cgroup2 rw\n"
    cg = hostmem.cgroup_memory("0::/job/rank0\n", mountinfo)
    assert cg.version == 2 and cg.path == f"{fs}/job"
    assert (cg.limit, cg.usage, cg.reclaimable) == (8 * GiB, 7 * GiB, 512 * MiB)
    assert cg.available == GiB + 512 * MiB
    # no limit anywhere: None
    _write(f"{fs}/job/memory.max", "max\n")
    assert hostmem.cgroup_memory("0::/job/rank0\n", mountinfo) is None


def test_cgroup_v1_and_a_container_that_sees_only_its_part(tmp_path):
    fs = tmp_path / "memory"
    # the container's cgroup /docker/abc is mounted as the root of its view
    _write(f"{fs}/memory.limit_in_bytes", str(4 * GiB))
    _write(f"{fs}/memory.usage_in_bytes", str(GiB))
    _write(f"{fs}/memory.stat", f"cache 5\nhierarchical_memory_limit {2 * GiB}\ntotal_inactive_file {256 * MiB}\n")
    mountinfo = (f"35 31 0:32 /docker/abc {fs} rw,relatime - cgroup cgroup rw,memory\n"
                 f"41 31 0:38 / {tmp_path}/unified rw,relatime - cgroup2 cgroup2 rw\n")
    cg = hostmem.cgroup_memory("4:memory:/docker/abc\n0::/\n", mountinfo)
    assert cg.version == 1 and cg.path == str(fs)
    assert cg.limit == 2 * GiB  # the hierarchical limit is the tighter one
    assert cg.available == GiB + 256 * MiB


def test_host_room_of_this_process_is_read_from_the_kernel():
    room = hostmem.host_room(mapped=True, locked=True)
    names = [l.name for l in room.limits]
    assert "MemAvailable" in names
    with open("/proc/meminfo") as f:
        total = next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemTotal:"))
    assert 0 < room.available <= total
    assert room.limits == sorted(room.limits, key=lambda l: l.available)
    hostmem.check_host_room(MiB, what="a small backup")  # fits
    with pytest.raises(HostMemoryError) as ei:
        hostmem.check_host_room(total * 4, what="a backup four times the machine")
    e = ei.value
    assert e.needed == total * 4 and e.available < e.needed and e.limit in names
    assert "a backup four times the machine needs" in str(e) and "Nothing was pinned or released" in str(e)


def test_the_host_backups_setting_is_checked(monkeypatch):
    monkeypatch.delenv("UNISLEEP_HOST_BACKUPS", raising=False)
    assert hostmem.host_backups_setting(None) == "keep"
    monkeypatch.setenv("UNISLEEP_HOST_BACKUPS", "release")
    assert hostmem.host_backups_setting(None) == "release"
    assert hostmem.host_backups_setting("keep") == "keep"  # the argument wins
    monkeypatch.setenv("UNISLEEP_HOST_BACKUPS", "free")
    with pytest.raises(InvalidArgumentError, match="UNISLEEP_HOST_BACKUPS must be 'keep'"):
        hostmem.host_backups_setting(None)
    with pytest.raises(InvalidArgumentError, match="host_backups must be"):
        hostmem.host_backups_setting("drop")


# ---------------------------------------------------------------------------- refusals under real limits
def _child(code: str, argv=(), timeout=240, prefix=()) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, UNISLEEP_PLATFORM="host", OMP_NUM_THREADS="1")
    out = subprocess.run([*prefix, sys.executable, "-c", textwrap.dedent(code), *argv], capture_output=True,
                         text=True, timeout=timeout, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_under_a_real_address_space_limit_growth_and_allocation_are_refused_by_name(tmp_path):
    """A child limits its own address space (``RLIMIT_AS``) to what it maps now + 256 MiB.  The
    pinned arena asked for a 1 GiB backup refuses (``ensure_fits`` and ``reserve``) with
    HostMemoryError naming RLIMIT_AS, having mapped nothing; the host backend refuses a 1 GiB
    allocation with InsufficientMemoryError (before: ``ensure_fits`` passed on MemAvailable,
    and the allocation failed inside mmap with a bare OSError)."""
    res = _child("""
        import json, resource, sys
        import torch
        from unisleep import MemoryLifecycle
        from unisleep.backends.cuda.arena import PinnedArena
        from unisleep.errors import HostMemoryError, InsufficientMemoryError
        from unisleep.hostmem import _status_bytes, process_status

        lc = MemoryLifecycle("host", spill_dir=sys.argv[1])
        arena = PinnedArena(0, None)
        vm = _status_bytes(process_status(), "VmSize")
        resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
        out = {}
        for what, call in (("ensure_fits", lambda: arena.ensure_fits(1 << 30)),
                           ("reserve", lambda: arena.reserve((1, 0), 1 << 30))):
            try:
                call()
                out[what] = "no error"
            except HostMemoryError as e:
                out[what] = {"limit": e.limit, "needed": e.needed, "available": e.available, "msg": str(e)}
        out["arena"] = {"capacity": arena.capacity, "promised": len(arena._promised), "grower": arena._grower is not None}
        out["mapped_more"] = _status_bytes(process_status(), "VmSize") - vm
        try:
            lc.empty((1 << 30,), torch.uint8, tag="weights")
            out["empty"] = "no error"
        except InsufficientMemoryError as e:
            out["empty"] = str(e)
        except OSError as e:
            out["empty"] = f"OSError {e}"
        small = lc.empty((8 << 20,), torch.uint8, tag="small")  # what fits is still allowed
        small.fill_(1)
        out["small"] = int(small.sum())
        print(json.dumps(out))
    """, [str(tmp_path)])
    for what in ("ensure_fits", "reserve"):
        r = res[what]
        assert isinstance(r, dict), f"{what}: {r}"
        assert r["limit"] == "RLIMIT_AS" and r["needed"] >= GiB and r["available"] <= 256 * MiB, r
        assert "RLIMIT_AS" in r["msg"] and "Nothing was pinned or released" in r["msg"]
    assert res["arena"] == {"capacity": 0, "promised": 0, "grower": False}
    assert res["mapped_more"] < 16 * MiB  # nothing was mapped for the refused growth
    assert res["empty"].startswith("1.00 GiB asked for tag 'weights'"), res["empty"]
    assert res["small"] == 8 * MiB


def _without_ipc_lock() -> list:
    """A command prefix that runs the child without CAP_IPC_LOCK (root holds it; then
    RLIMIT_MEMLOCK binds), or skips saying what is missing."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("as root the child must drop CAP_IPC_LOCK for RLIMIT_MEMLOCK to bind: needs setpriv (util-linux)")
    return ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock"]


@pytest.mark.slow
def test_the_locked_memory_check_agrees_with_mlock():
    """Under a real RLIMIT_MEMLOCK of L = 16 MiB (or the hard limit, when lower) and without
    CAP_IPC_LOCK, a locked backup of 4 L is refused by name and mlock of 4 L really fails;
    L / 2 passes both."""
    res = _child("""
        import ctypes, json, mmap, resource
        from unisleep.errors import HostMemoryError
        from unisleep.hostmem import check_host_room, has_ipc_lock

        hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
        lim = 16 << 20 if hard == resource.RLIM_INFINITY else min(16 << 20, hard)
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (lim, hard))
        libc = ctypes.CDLL(None, use_errno=True)
        out = {"cap_ipc_lock": has_ipc_lock()}
        for key, n in (("big", 4 * lim), ("small", lim // 2)):
            try:
                check_host_room(n, what="a locked backup", locked=True)
                checked = "fits"
            except HostMemoryError as e:
                checked = e.limit
            buf = mmap.mmap(-1, n)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
            rc = libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(n))
            out[key] = {"check": checked, "mlock": rc == 0}
            if rc == 0:
                libc.munlock(ctypes.c_void_p(addr), ctypes.c_size_t(n))
        print(json.dumps(out))
    """, prefix=_without_ipc_lock())
    assert res["cap_ipc_lock"] is False
    assert res["big"] == {"check": "RLIMIT_MEMLOCK", "mlock": False}
    assert res["small"] == {"check": "fits", "mlock": True}


@pytest.mark.slow
def test_a_real_memory_cgroup_limit_is_read_and_refuses(tmp_path):
    """Makes a memory cgroup with a 256 MiB limit at the root of the machine's cgroup file system
    and runs a child in it: the child reads that limit as its own and a 512 MiB backup is
    refused under it.  Opt-in (it moves a process into a new cgroup): UNISLEEP_TEST_CGROUP=1."""
    if os.environ.get("UNISLEEP_TEST_CGROUP") != "1":
        pytest.skip("makes a memory cgroup under the root of /sys/fs/cgroup and moves a child process into it: "
                    "set UNISLEEP_TEST_CGROUP=1 where that is allowed (as root, on a machine of its own)")
    if os.geteuid() != 0:
        pytest.skip("making a memory cgroup needs root")
    cg = hostmem._read(hostmem.SELF_CGROUP) or ""
    mounts = hostmem._mounts(hostmem._read(hostmem.SELF_MOUNTINFO) or "")
    v1 = next((p for _, p, t, o in mounts if t == "cgroup" and "memory" in o.split(",")), None)
    v2 = next((p for _, p, t, _ in mounts if t == "cgroup2"), None)
    uses_v1 = any("memory" in line.split(":")[1].split(",") for line in cg.splitlines() if line.count(":") >= 2)
    base = v1 if uses_v1 else v2
    if base is None:
        pytest.skip("no memory cgroup hierarchy is mounted")
    d = os.path.join(base, f"unisleep-test-{os.getpid()}")
    os.mkdir(d)
    try:
        limit_file = "memory.limit_in_bytes" if uses_v1 else "memory.max"
        with open(os.path.join(d, limit_file), "w") as f:
            f.write(str(256 * MiB))
        code = """
            import json, os, sys
            with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            from unisleep.errors import HostMemoryError
            from unisleep.hostmem import cgroup_memory, check_host_room
            cg = cgroup_memory()
            out = {"path": cg and cg.path, "limit": cg and cg.limit}
            try:
                check_host_room(512 << 20, what="a backup")
                out["refused"] = None
            except HostMemoryError as e:
                out["refused"] = e.limit
            with open("/proc/self/cgroup") as f:
                out["proc"] = f.read()
            print(json.dumps(out))
        """
        res = _child(code, [d])
        assert os.path.realpath(res["path"]) == os.path.realpath(d), res
        assert res["limit"] == 256 * MiB
        assert res["refused"] and res["refused"].startswith("cgroup v"), res
    finally:
        try:
            os.rmdir(d)
        except OSError:
            pass
