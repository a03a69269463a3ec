"""The backend registry: the built-in descriptors, register_backend, and the ``unisleep.backends``
entry-point group that lets a third party add a backend without touching unisleep (a whole
out-of-tree backend, installed by pip: tests/test_out_of_tree_backend.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from unisleep import MemoryLifecycle, available_backends, register_backend
from unisleep.backend import Backend
from unisleep.backends.host import HostDriver
from unisleep.errors import PlatformError
from unisleep.platform import Platform, load_driver
from unisleep.registry import ENTRY_POINT_GROUP, _extra, backend, driver_class

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_builtins_listed():
    table = available_backends()
    for name in ("host", "cuda", "rocm", "ascend"):
        assert name in table and ":" in table[name]
    assert table["host"] == "unisleep.backends.host:BACKEND"
    assert ENTRY_POINT_GROUP == "unisleep.backends"
    for name in ("host", "cuda", "rocm", "ascend"):
        b = backend(name)
        assert isinstance(b, Backend) and b.name == name and b.package == f"unisleep.backends.{name}"


def test_driver_class_and_load_driver():
    assert driver_class("host") is HostDriver
    d = load_driver("  HOST ")
    assert isinstance(d, HostDriver) and d.name == "host"
    assert isinstance(load_driver(Platform("host", "test")), HostDriver)
    with pytest.raises(PlatformError) as exc:
        driver_class("nope")
    assert "host" in str(exc.value) and "nope" in str(exc.value)
    with pytest.raises(PlatformError):
        load_driver(123)


def test_unimportable_backend_says_what_is_wrong(tmp_path):
    register_backend("broken-test", "no_such_module_for_unisleep:BACKEND")
    try:
        with pytest.raises(PlatformError, match="could not be imported"):
            driver_class("broken-test")
    finally:
        _extra.pop("broken-test", None)


def test_the_entry_points_are_read_once_per_name(monkeypatch):
    """``Platform.backend`` is asked several times in every weight update and sleep; reading the
    entry points walks every installed distribution's metadata, so a name's descriptor is found
    once per process — and a backend registered in the process still overrides it."""
    import unisleep.registry as reg

    monkeypatch.setattr(reg, "_by_name", {}, raising=False)
    calls = []
    real = reg._entry_points
    monkeypatch.setattr(reg, "_entry_points", lambda: calls.append(1) or real())
    host = backend("host")
    for _ in range(5):
        assert backend("host") is host and Platform("host", "test").backend is host
    assert len(calls) == 1, f"the entry points were read {len(calls)} times for one name"
    mine = Backend(name="host", package=__name__, torch_device="cpu", driver=f"{__name__}:CountingDriver")
    register_backend(mine)
    try:
        assert backend("host") is mine
    finally:
        _extra.pop("host", None)
    assert backend("host") is host


class CountingDriver(HostDriver):
    """A third-party driver: the host primitives, counting what it is asked to create."""

    name = "counting"

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.created = 0

    def create(self, size):
        self.created += 1
        return super().create(size)


COUNTING = Backend(name="counting", package=__name__, torch_device="cpu", driver=f"{__name__}:CountingDriver",
                   collective="unisleep.backends.host.collective")


def test_an_entry_point_naming_a_driver_class_is_refused_with_the_fix():
    """The form before descriptors (``name = "module:DriverClass"``) names what to do instead."""
    register_backend("old-form", f"{__name__}:CountingDriver")
    try:
        with pytest.raises(PlatformError, match="not a unisleep.backend.Backend descriptor"):
            driver_class("old-form")
    finally:
        _extra.pop("old-form", None)


def test_register_backend_in_process(tmp_path):
    register_backend(COUNTING)
    try:
        assert "counting" in available_backends() and backend("counting") is COUNTING
        with MemoryLifecycle("counting", spill_dir=str(tmp_path)) as lc:
            assert isinstance(lc.driver, CountingDriver)
            import torch

            t = lc.empty((4096,), torch.uint8, tag="weights")
            t.fill_(9)
            lc.sleep(1)
            lc.wake_up()
            assert lc.driver.created == 2 and int(t.sum()) == 9 * 4096
    finally:
        _extra.pop("counting", None)
    assert "counting" not in available_backends()


PLUGIN = '''
"""A third-party unisleep backend, installed only through its entry point."""
from unisleep.backend import Backend
from unisleep.backends.host.driver import HostDriver

BACKEND = Backend(name="tinyhost", package=__name__, torch_device="cpu", driver=__name__ + ":TinyDriver",
                  collective="unisleep.backends.host.collective")


class TinyDriver(HostDriver):
    name = "tinyhost"
    made = 0

    def create(self, size):
        TinyDriver.made += 1
        return super().create(size)
'''


@pytest.fixture
def plugin_dist(tmp_path):
    """A distribution on sys.path that declares ``tinyhost`` in the ``unisleep.backends`` group."""
    pkg = tmp_path / "unisleep_tinyhost"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(PLUGIN)
    dist = tmp_path / "unisleep_tinyhost-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: unisleep-tinyhost\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\ntinyhost = unisleep_tinyhost:BACKEND\n")
    return str(tmp_path)


def _run(code: str, path: str, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "UNISLEEP_PLATFORM"}
    env["PYTHONPATH"] = path
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


SCRIPT = """
import json, os, sys, tempfile, torch, unisleep
from unisleep.registry import available_backends
table = available_backends()
assert "unisleep_tinyhost" not in sys.modules  # listed without being imported
lc = unisleep.MemoryLifecycle(PLATFORM, spill_dir=tempfile.mkdtemp())
t = lc.empty((1 << 16,), torch.float32, tag="weights")
t.fill_(2.5)
ptr = t.data_ptr()
lc.sleep(1); asleep = lc.resident_bytes(); lc.wake_up()
print(json.dumps({"target": table.get("tinyhost"), "cls": type(lc.driver).__name__,
                  "made": type(lc.driver).made, "asleep": asleep, "ok": bool((t == 2.5).all()),
                  "same_ptr": t.data_ptr() == ptr, "name": lc.platform_name}))
lc.close()
"""


@pytest.mark.slow
def test_entry_point_backend_loads_by_name(plugin_dist):
    r = _run(SCRIPT.replace("PLATFORM", "'tinyhost'"), plugin_dist)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out == {"target": "unisleep_tinyhost:BACKEND", "cls": "TinyDriver", "made": 2, "asleep": 0,
                   "ok": True, "same_ptr": True, "name": "tinyhost"}


@pytest.mark.slow
def test_entry_point_backend_selected_by_environment(plugin_dist):
    """The registry promises ``UNISLEEP_PLATFORM=<third-party name>`` selects it."""
    r = _run(SCRIPT.replace("PLATFORM", "None"), plugin_dist, {"UNISLEEP_PLATFORM": "tinyhost"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["cls"] == "TinyDriver" and out["ok"] and out["same_ptr"]


def test_entry_point_absent_without_distribution():
    assert "tinyhost" not in available_backends()
    with pytest.raises(PlatformError, match="tinyhost"):
        MemoryLifecycle("tinyhost")


def test_library_caches_are_named_where_a_platform_has_them():
    """A side going to sleep gives back what the framework's device libraries keep beyond its
    allocator (CUDA: torch's cuBLAS workspaces, one per thread that ran a matmul); the CUDA
    descriptor's function loads and, on a build without CUDA, does nothing; the host names none."""
    cuda = backend("cuda")
    assert cuda.library_caches is not None and callable(cuda.load(cuda.library_caches))
    cuda.release_library_caches()  # a CPU build of torch has no cuBLAS: nothing to give back, no error
    assert backend("host").library_caches is None
    backend("host").release_library_caches()


def test_the_keyed_digest_finds_kernels_through_the_registry():
    """The keyed digest, which the backends import, looks no backend up itself: the registry
    installs its finder when imported (before any digest can run, as ``import unisleep`` imports
    it), and the finder asks the backends' descriptors."""
    import unisleep  # noqa: F401
    from unisleep import keyed_hash, registry

    assert keyed_hash._finder is registry.checksum_kernel
    assert registry.checksum_kernel("cpu", "nh_level1") is None  # the host backend ships no kernel
