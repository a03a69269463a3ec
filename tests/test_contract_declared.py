"""Every method or attribute the core uses on a driver or a backup store is declared on the
:class:`~unisleep.driver.Driver` / :class:`~unisleep.backup.BackupStore` ABCs (and every
capability, knob and hook it reads on ``driver.capabilities`` / ``driver.config`` /
``driver.hooks`` on :class:`~unisleep.driver.Capabilities` / :class:`~unisleep.driver.DriverConfig`
/ :class:`~unisleep.driver.DriverHooks`), and a store
every backend must complete (``load_range``) is abstract there: a backend that lacks it cannot
be instantiated, instead of failing with AttributeError in the middle of a wake."""

from __future__ import annotations

import ast
import os

import pytest

from unisleep.backup import BackupStore
from unisleep.driver import Capabilities, Driver, DriverConfig, DriverHooks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = os.path.join(ROOT, "unisleep")
#: not a lifecycle's driver or store there: the transfer group's TCP store, the platform
#: table's driver entry ("module:Class")
SKIP = {os.path.join(CORE, "transfer"), os.path.join(CORE, "platform.py"), os.path.join(CORE, "driver.py")}

STORE_NAMES = {"store", "_store"}
DRIVER_NAMES = {"driver", "_driver", "drv"}


def _receiver(node: ast.AST):
    """'store' / 'driver' when ``node`` is an expression naming one (x.store, self._driver...)."""
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
    if isinstance(node, ast.Attribute) and (isinstance(node.value, ast.Subscript)
                                            or getattr(node.value, "attr", getattr(node.value, "id", "")) == "spec"):
        return None  # SPECS[name].driver / platform.spec.driver: the "module:Class" string
    if name in STORE_NAMES:
        return "store"
    if name in DRIVER_NAMES:
        return "driver"
    return None


#: what a driver holds besides its methods: the attribute -> the class that declares its fields
PARTS = {"capabilities": Capabilities, "config": DriverConfig, "hooks": DriverHooks}


def core_uses() -> dict[str, set[str]]:
    uses = {"store": set(), "driver": set(), **{k: set() for k in PARTS}}
    for root, dirs, files in os.walk(CORE):
        dirs[:] = [d for d in dirs if d != "__pycache__" and os.path.join(root, d) not in SKIP]
        for f in files:
            if not f.endswith(".py") or os.path.join(root, f) in SKIP:
                continue
            tree = ast.parse(open(os.path.join(root, f)).read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute):
                    kind = _receiver(node.value)
                    if kind:
                        uses[kind].add(node.attr)
                    elif isinstance(node.value, ast.Attribute) and node.value.attr in PARTS \
                            and _receiver(node.value.value) == "driver":
                        uses[node.value.attr].add(node.attr)
                elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr") \
                        and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                    kind = _receiver(node.args[0])
                    if kind:
                        uses[kind].add(node.args[1].value)
    return uses


def test_the_scan_finds_what_the_core_calls():
    uses = core_uses()
    assert {"load_range", "flush", "drop", "has"} <= uses["store"]
    assert {"suspend", "resume", "view", "zero", "graph_pool", "capabilities", "config", "hooks"} <= uses["driver"]
    assert {"supports_pool", "fresh_memory_is_zero", "retain_backups"} <= uses["capabilities"]
    assert {"progressive_piece", "chunk_bytes"} <= uses["config"] and "restore" in uses["hooks"]


@pytest.mark.parametrize("kind,abc_cls", [("store", BackupStore), ("driver", Driver), *PARTS.items()])
def test_everything_the_core_uses_is_declared(kind, abc_cls):
    declared = set(dir(abc_cls)) | {a for c in abc_cls.__mro__ for a in getattr(c, "__annotations__", {})}
    missing = sorted(a for a in core_uses()[kind] if not a.startswith("__") and a not in declared)
    assert not missing, f"the core uses {missing} on a {kind}, which {abc_cls.__name__} does not declare"


def test_load_range_is_abstract_and_every_store_implements_it():
    from unisleep.backup import HostBufferStore
    from unisleep.backends.ascend.store import AclHostStore
    from unisleep.backends.host.spill_store import SpillStore
    from unisleep.backends.rocm.store import HipHostStore

    assert "load_range" in BackupStore.__abstractmethods__

    class Incomplete(BackupStore):  # everything but load_range
        held_bytes = 0

        def ensure_fits(self, nbytes): ...
        def save(self, key, src): ...
        def load(self, key, dst): ...
        def drop(self, key): ...
        def has(self, key): ...

    with pytest.raises(TypeError, match="load_range"):
        Incomplete()
    for cls in (HostBufferStore, SpillStore, HipHostStore, AclHostStore):
        assert "load_range" not in getattr(cls, "__abstractmethods__", set()), cls
        assert cls.load_range is not BackupStore.load_range, cls
