"""Attacks on the host backend's spill directory by another user (uid 65534 through ``setpriv``).

A spill directory another uid can swap (``spill_dir=``, ``UNISLEEP_SPILL_DIR``,
``TMS_DISK_BACKUP_DIR``) is refused with :class:`~unisleep.errors.SpillDirError` naming the fix,
before anything is written there.  And should a directory become swappable after the start-up
check, the attacker who renames root's private directory away and plants its own in its place
(world-writable files, links to a root-owned 0600 file) still gets nothing: root's backups go
through the private directory's descriptor (``O_NOFOLLOW``, ``O_EXCL``), so the weights never
land where the attacker can read them and the 0600 file is untouched.

Root's side runs in a child process (it writes the backups); the attacker is a standard-library
Python run as uid 65534.  Without root or ``setpriv`` the attacks skip, saying which is missing;
the refusals run as any user.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap

import pytest

from nobody import NOBODY, ROOT, as_nobody, stdlib_python_for_nobody

from unisleep import MemoryLifecycle
from unisleep.errors import SpillDirError


@pytest.fixture
def base():
    """A directory every user can traverse (pytest's own tmp_path is 0700 to root)."""
    d = tempfile.mkdtemp(prefix="us-spill-attack-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _dir(path: str, mode: int, uid: int | None = None) -> str:
    os.makedirs(path, exist_ok=True)
    if uid is not None:
        os.chown(path, uid, uid)
    os.chmod(path, mode)
    return path


def _root_only():
    if os.geteuid() != 0:
        pytest.skip("making a directory owned by uid 65534 needs root (CI runs as root)")


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("case", ["world-writable", "group-writable", "other-owner", "other-owner-0777",
                                  "ancestor", "missing-under-unsafe-ancestor", "link-through-unsafe"])
def test_a_spill_dir_another_user_can_swap_is_refused(base, case, monkeypatch):
    """Refused with SpillDirError naming the path and the fix, before anything is created or
    written there (every way the directory reaches the lifecycle)."""
    me = os.geteuid()
    if case == "world-writable":
        spill = _dir(os.path.join(base, "spill"), 0o777)
    elif case == "group-writable":
        spill = _dir(os.path.join(base, "spill"), 0o770)
    elif case == "other-owner":
        _root_only()
        spill = _dir(os.path.join(base, "spill"), 0o700, NOBODY)
    elif case == "other-owner-0777":  # a 0777 /tmp/spill made by uid 65534
        _root_only()
        spill = _dir(os.path.join(base, "spill"), 0o777, NOBODY)
    elif case == "ancestor":
        _dir(os.path.join(base, "shared"), 0o777)
        spill = _dir(os.path.join(base, "shared", "mine"), 0o700)
    elif case == "missing-under-unsafe-ancestor":
        _dir(os.path.join(base, "shared"), 0o777)
        spill = os.path.join(base, "shared", "new", "spill")
    else:  # a link (in a safe place) to a directory under a world-writable one
        _dir(os.path.join(base, "shared"), 0o777)
        target = _dir(os.path.join(base, "shared", "real"), 0o700)
        spill = os.path.join(base, "link")
        os.symlink(target, spill)
    before = sorted(os.listdir(spill)) if os.path.isdir(spill) else None
    ways = {
        "spill_dir=": lambda: MemoryLifecycle("host", spill_dir=spill),
        "UNISLEEP_SPILL_DIR": lambda: (monkeypatch.setenv("UNISLEEP_SPILL_DIR", spill), MemoryLifecycle("host"))[1],
    }
    for way, make in ways.items():
        with pytest.raises(SpillDirError) as e:
            lc = make()
            lc.close()
        msg = str(e.value)
        assert "not safe" in msg and "chmod go-w" in msg and "spill_dir=" in msg, (way, msg)
        assert "Nothing was written there" in msg, msg
        if case in ("other-owner", "other-owner-0777"):
            assert f"uid {NOBODY}" in msg, msg
        monkeypatch.delenv("UNISLEEP_SPILL_DIR", raising=False)
    after = sorted(os.listdir(spill)) if os.path.isdir(spill) else None
    assert after == before, (before, after)
    if case == "missing-under-unsafe-ancestor":
        assert not os.path.exists(os.path.join(base, "shared", "new"))


@pytest.mark.slow
def test_the_tms_facade_refuses_a_swappable_disk_backup_dir(base):
    """TMS_DISK_BACKUP_DIR reaches the lifecycle as its spill directory: same refusal."""
    spill = _dir(os.path.join(base, "tms"), 0o777)
    code = textwrap.dedent(f"""
        import torch
        from unisleep.compat.torch_memory_saver import torch_memory_saver as tms
        from unisleep.errors import SpillDirError
        try:
            with tms.region(tag="weights", enable_disk_backup=True) as r:
                r.empty((1024,), dtype=torch.uint8)
            print("RESULT accepted")
        except SpillDirError as e:
            print("RESULT refused " + str(e))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT, TMS_DISK_BACKUP_DIR=spill, UNISLEEP_PLATFORM="host"))
    out = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert out and out[-1].startswith("RESULT refused"), r.stdout + r.stderr[-3000:]
    assert spill in out[-1] and "TMS_DISK_BACKUP_DIR" in out[-1], out[-1]
    assert os.listdir(spill) == []


def test_a_sticky_world_writable_dir_like_tmp_is_accepted(base):
    """Others may write in a sticky directory but not rename what is ours: accepted."""
    spill = _dir(os.path.join(base, "sticky"), 0o1777)
    lc = MemoryLifecycle("host", spill_dir=spill)
    try:
        st = os.stat(lc.backup_store.dir)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    finally:
        lc.close()
    assert os.listdir(spill) == []


# ----------------------------------------------------------------------------- attacks
ROOT_SIDE = """
import hashlib, json, os, sys, time, zlib
import torch
from unisleep import MemoryLifecycle
parent, ctl, mode = sys.argv[1], sys.argv[2], sys.argv[3]
MiB = 1 << 20

def wait(name):
    t0 = time.monotonic()
    while not os.path.exists(os.path.join(ctl, name)):
        assert time.monotonic() - t0 < 120, "timed out waiting for " + name
        time.sleep(0.01)

def signal(name):
    open(os.path.join(ctl, name), "w").close()

def sha(t):
    return hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()

lc = MemoryLifecycle("host", spill_dir=parent)
g = torch.Generator().manual_seed(5)
w = lc.empty((4 * MiB,), torch.uint8, tag="weights")
w.copy_(torch.randint(0, 256, w.shape, dtype=torch.uint8, generator=g))
o = lc.empty((4 * MiB,), torch.uint8, tag="optim")
o.copy_(torch.randint(0, 256, o.shape, dtype=torch.uint8, generator=g))
want = {"weights": sha(w), "optim": sha(o)}
if mode == "became-swappable":
    os.chmod(parent, 0o777)  # after the start-up check (e.g. an administrator's chmod)
signal("ready")
wait("planted")
lc.sleep(1, offload_tags=["optim"])
assert lc.state() == {"weights": "offloaded", "optim": "offloaded"}, lc.state()
signal("asleep")
wait("read")
lc.wake_up()
exact = sha(w) == want["weights"] and sha(o) == want["optim"]
lc.close()
print("RESULT " + json.dumps({"want": want, "exact": exact}), flush=True)
"""

ATTACKER = """
import hashlib, json, os, sys, time
parent, ctl, secret = sys.argv[1], sys.argv[2], sys.argv[3]

def wait(name):
    t0 = time.monotonic()
    while not os.path.exists(os.path.join(ctl, name)):
        if time.monotonic() - t0 > 120:
            raise SystemExit("timed out waiting for " + name)
        time.sleep(0.01)

def signal(name):
    open(os.path.join(ctl, name), "w").close()

out = {"uid": os.getuid(), "planted": []}
wait("ready")
victims = [n for n in os.listdir(parent) if n.startswith("unisleep-")]
out["seen"] = victims
victim = os.path.join(parent, victims[0])
names = [f"{k}-0{s}.bin" for k in (1, 2, 3, 4) for s in ("", "-0", "-1", "-2")]
try:  # rename root's private directory away and plant one of ours in its place
    os.rename(victim, os.path.join(parent, "moved-away"))
    out["renamed"] = True
    os.mkdir(victim)
    os.chmod(victim, 0o777)
    where = victim
except OSError as e:
    out["renamed"] = e.strerror
    where = victim  # else try planting in root's own directory
for n in names:
    p = os.path.join(where, n)
    try:
        if n.startswith("1-"):  # a link to root's 0600 file: a write would overwrite it
            os.symlink(secret, p)
        else:  # a file we can read back
            fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o666)
            os.fchmod(fd, 0o666)
            os.close(fd)
        out["planted"].append(n)
    except OSError as e:
        out.setdefault("plant_errors", []).append(e.strerror)
signal("planted")
wait("asleep")
read = {}
for root, dirs, files in os.walk(parent):
    for f in files:
        p = os.path.join(root, f)
        try:
            with open(p, "rb") as fh:
                data = fh.read()
            read[p] = [len(data), hashlib.sha256(data).hexdigest()]
        except OSError as e:
            read[p] = e.strerror
out["read"] = read
print("RESULT " + json.dumps(out), flush=True)
signal("read")
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["became-swappable", "sticky"])
def test_an_attacker_renaming_and_planting_never_gets_the_weights(base, mode):
    """uid 65534 renames root's private spill directory away and plants its own (world-writable
    files, links to a root-owned 0600 file) while root's lifecycle sleeps.  ``became-swappable``:
    the spill directory was root's 0755 at start-up and became 0777 afterwards; ``sticky``: a
    1777 directory like /tmp (the rename is refused by the kernel).  Either way the backups go
    only into root's private directory: the attacker reads none of the weights, the 0600 file is
    untouched, and the wake is exact."""
    python = stdlib_python_for_nobody()
    parent = _dir(os.path.join(base, "spill"), 0o755 if mode == "became-swappable" else 0o1777)
    ctl = _dir(os.path.join(base, "ctl"), 0o777)
    secret = os.path.join(base, "root-secret")
    with open(secret, "wb") as f:
        f.write(b"root's private key material\n" * 10)
    os.chmod(secret, 0o600)
    secret_sha = hashlib.sha256(open(secret, "rb").read()).hexdigest()
    root_script, attacker_script = os.path.join(base, "root_side.py"), os.path.join(base, "attacker.py")
    for path, text in ((root_script, ROOT_SIDE), (attacker_script, ATTACKER)):
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o644)
    root = subprocess.Popen([sys.executable, root_script, parent, ctl, mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    attacker = subprocess.Popen(as_nobody(["-I", "-S", attacker_script, parent, ctl, secret], python=python),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
    try:
        a_out, a_err = attacker.communicate(timeout=240)
        r_out, r_err = root.communicate(timeout=240)
    finally:
        for p in (root, attacker):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert attacker.returncode == 0, a_out + a_err
    got = json.loads([l for l in a_out.splitlines() if l.startswith("RESULT ")][-1][7:])
    assert got["uid"] == NOBODY and got["seen"], got
    assert root.returncode == 0, f"root's side exited {root.returncode}\n{r_out}\n{r_err[-4000:]}\nattacker: {got}"
    res = json.loads([l for l in r_out.splitlines() if l.startswith("RESULT ")][-1][7:])
    leaked = {p: v for p, v in got["read"].items() if isinstance(v, list) and v[1] in res["want"].values()}
    with open(secret, "rb") as f:
        secret_now = f.read()
    overwritten = hashlib.sha256(secret_now).hexdigest() != secret_sha
    assert not leaked and not overwritten, (
        f"uid {NOBODY} read backed-up weights: {leaked}; root's 0600 file overwritten: {overwritten} "
        f"(now {len(secret_now)} bytes, {hashlib.sha256(secret_now).hexdigest()[:16]}...; the weights are "
        f"{res['want']})")
    if mode == "became-swappable":
        assert got["renamed"] is True and got["planted"], got  # the attack did take place
        planted = {p: v for p, v in got["read"].items() if isinstance(v, list)}
        assert planted and all(v[0] == 0 for v in planted.values()), planted  # nothing written into them
    else:
        assert got["renamed"] == "Operation not permitted", got
        assert not got["planted"], got
    assert res["exact"], res


# ----------------------------------------------------------------------------- planted links
PLANT_LINK = """
import os, sys
link, target = sys.argv[1], sys.argv[2]
os.symlink(target, link)
st = os.lstat(link)
print("RESULT", st.st_uid)
"""


@pytest.fixture
def sticky_tmp():
    """A root-owned 1777 directory like /tmp, and a root-owned directory on /dev/shm (a RAM file
    system whose chain root may use: both are where another user's link could send root's
    spill files)."""
    d = tempfile.mkdtemp(prefix="us-spill-sticky-", dir="/tmp")
    os.chmod(d, 0o1777)
    shm = tempfile.mkdtemp(prefix="us-spill-target-", dir="/dev/shm") if os.path.isdir("/dev/shm") else None
    yield d, shm
    shutil.rmtree(d, ignore_errors=True)
    if shm:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["spill-dir-is-the-link", "link-on-the-way"])
def test_another_users_link_at_a_missing_spill_dir_is_refused(sticky_tmp, case):
    """uid 65534 plants a link in a sticky directory like /tmp at the name of a spill directory
    root has not made yet (``/tmp/spill``), or at a directory on the way to it (``/tmp/new`` for
    ``/tmp/new/spill``), pointing at a root-owned directory on /dev/shm.  Root's lifecycle refuses
    it with SpillDirError naming the link, its owner and the fix; nothing is made or written where
    it points (before: the link was followed and the backups went to /dev/shm)."""
    python = stdlib_python_for_nobody()
    base, target = sticky_tmp
    if target is None:
        pytest.skip("no /dev/shm on this host")
    link = os.path.join(base, "spill" if case == "spill-dir-is-the-link" else "new")
    spill = link if case == "spill-dir-is-the-link" else os.path.join(link, "spill")
    script = os.path.join(base, "plant.py")
    with open(script, "w") as f:
        f.write(PLANT_LINK)
    os.chmod(script, 0o644)
    r = subprocess.run(as_nobody(["-I", "-S", script, link, target], python=python), capture_output=True,
                       text=True, timeout=60, cwd="/")
    assert r.returncode == 0 and f"RESULT {NOBODY}" in r.stdout, r.stdout + r.stderr
    os.unlink(script)
    with pytest.raises(SpillDirError) as e:
        MemoryLifecycle("host", spill_dir=spill).close()
    msg = str(e.value)
    assert "not safe" in msg and f"{link}" in msg and f"is a link of uid {NOBODY}" in msg, msg
    assert f"rm {link}" in msg and "spill_dir=" in msg, msg
    assert "Nothing was written there" in msg, msg
    assert os.listdir(target) == [], os.listdir(target)
    assert os.path.islink(link) and sorted(os.listdir(base)) == [os.path.basename(link)]


def test_this_users_own_link_is_followed_and_a_ram_spill_is_named(sticky_tmp, recwarn):
    """A link root itself made (in the same sticky directory) to its directory on /dev/shm is
    followed; the spill lands on tmpfs and the warning says so, naming where it really is."""
    base, target = sticky_tmp
    if target is None:
        pytest.skip("no /dev/shm on this host")
    link = os.path.join(base, "mine")
    os.symlink(target, link)
    lc = MemoryLifecycle("host", spill_dir=link)
    try:
        assert os.path.dirname(lc.backup_store.dir) == link and os.listdir(target)
    finally:
        lc.close()
    said = [str(w.message) for w in recwarn if "free no memory" in str(w.message)]
    assert said and target in said[0] and "tmpfs" in said[0], [str(w.message) for w in recwarn]
    assert os.listdir(target) == []


@pytest.mark.slow
def test_a_link_planted_between_the_look_and_the_mkdir_is_refused(sticky_tmp, monkeypatch):
    """The race: ``/tmp/new`` does not exist when root looks, and uid 65534 links it to /dev/shm
    just before root's mkdir.  The mkdir (at /tmp's descriptor) fails, the name is looked at again
    and the link refused; nothing is written where it points."""
    python = stdlib_python_for_nobody()
    base, target = sticky_tmp
    if target is None:
        pytest.skip("no /dev/shm on this host")
    link = os.path.join(base, "new")
    script = os.path.join(base, "plant.py")
    with open(script, "w") as f:
        f.write(PLANT_LINK)
    os.chmod(script, 0o644)
    real, planted = os.mkdir, []

    def racing(path, *a, **k):  # the attacker wins between root's look and root's mkdir
        if os.path.basename(str(path)) == "new" and not planted:
            r = subprocess.run(as_nobody(["-I", "-S", script, link, target], python=python), capture_output=True,
                               text=True, timeout=60, cwd="/")
            planted.append(r.stdout + r.stderr)
        return real(path, *a, **k)

    monkeypatch.setattr(os, "mkdir", racing)
    with pytest.raises(SpillDirError) as e:
        MemoryLifecycle("host", spill_dir=os.path.join(link, "spill")).close()
    monkeypatch.setattr(os, "mkdir", real)
    assert planted and f"RESULT {NOBODY}" in planted[0], planted
    assert f"is a link of uid {NOBODY}" in str(e.value) and f"rm {link}" in str(e.value), str(e.value)
    assert os.listdir(target) == []
