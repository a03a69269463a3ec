"""Drop-ins for other libraries' APIs, above the core (they know nothing of engines).

``unisleep.compat.torch_memory_saver`` is torch_memory_saver 0.0.10's public surface on
:class:`~unisleep.MemoryLifecycle`.  Unmodified code that does
``from torch_memory_saver import torch_memory_saver`` gets it after :func:`install`::

    import unisleep.compat
    unisleep.compat.install()          # before anything imports torch_memory_saver
    import sglang                      # ... its torch_memory_saver is now unisleep's

How child processes get it too (no ``LD_PRELOAD``, no ``.pth`` file, no ``sitecustomize``):
``install()`` puts a small shim folder (``unisleep/compat/shim``, holding a package named
``torch_memory_saver``) first on ``sys.path`` — which multiprocessing's *spawn* and *forkserver*
children copy — and first on ``PYTHONPATH``, and sets ``UNISLEEP_TMS=1`` — which any child
Python inherits (``subprocess``, Ray workers started with this environment).  In a child the shim
package becomes the facade when ``UNISLEEP_TMS`` is on and otherwise loads the real
torch_memory_saver from the rest of the path, so the folder alone changes nothing.  A launcher
that cannot call ``install()`` sets the two variables itself::

    export UNISLEEP_TMS=1 PYTHONPATH="$(python -m unisleep.compat --pythonpath):$PYTHONPATH"
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import sys
from typing import Iterator

from ..errors import InvalidTransitionError

__all__ = ["install", "uninstall", "installed", "shim_dir", "shim_env", "ENV_SWITCH", "MODULE"]

ENV_SWITCH = "UNISLEEP_TMS"
MODULE = "torch_memory_saver"
_FACADE = "unisleep.compat.torch_memory_saver"


def shim_dir() -> str:
    """The folder to put first on the path: it holds the ``torch_memory_saver`` shim package."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim")


class _Finder(importlib.abc.MetaPathFinder):
    """Answers ``import torch_memory_saver`` with the facade in this process, even if the entry
    in ``sys.modules`` is removed later (e.g. by a test harness)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != MODULE:
            return None
        return importlib.util.spec_from_loader(fullname, _Loader())


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return sys.modules.get(_FACADE) or importlib.import_module(_FACADE)

    def exec_module(self, module):
        sys.modules[MODULE] = module


_finder = _Finder()
_saved: dict = {}


def _prepend_path(value: str, entry: str) -> str:
    parts = [p for p in value.split(os.pathsep) if p and p != entry]
    return os.pathsep.join([entry] + parts)


def installed() -> bool:
    """Whether ``import torch_memory_saver`` in this process gives the facade."""
    mod = sys.modules.get(MODULE)
    return mod is not None and mod.__name__ == _FACADE


def install(subprocesses: bool = True) -> None:
    """Make ``import torch_memory_saver`` give unisleep's facade in this process and, with
    ``subprocesses=True`` (default), in the Python processes it starts afterwards.

    Call it before anything imports the real torch_memory_saver: code that already holds the
    real module keeps it, so that case raises :class:`~unisleep.errors.InvalidTransitionError`."""
    import importlib

    facade = importlib.import_module(_FACADE)
    cur = sys.modules.get(MODULE)
    if cur is not None and cur is not facade:
        raise InvalidTransitionError(
            f"the real torch_memory_saver was already imported (from {getattr(cur, '__file__', '?')}); call "
            "unisleep.compat.install() before anything imports it — e.g. first thing in the entry script — or "
            f"start the process with {ENV_SWITCH}=1 and the shim folder on PYTHONPATH (docs/compat-tms.md)"
        )
    if not _saved:
        _saved.update(
            env={k: os.environ.get(k) for k in (ENV_SWITCH, "PYTHONPATH")}, path=list(sys.path)
        )
    sys.modules[MODULE] = facade
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    if subprocesses:
        d = shim_dir()
        if not sys.path or sys.path[0] != d:
            sys.path[:] = [d] + [p for p in sys.path if p != d]
        os.environ[ENV_SWITCH] = "1"
        os.environ["PYTHONPATH"] = _prepend_path(os.environ.get("PYTHONPATH", ""), d)


def uninstall() -> None:
    """Undo :func:`install` (environment, ``sys.path`` and the module entry)."""
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    if installed():
        del sys.modules[MODULE]
    if _saved:
        for k, v in _saved["env"].items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        d = shim_dir()
        sys.path[:] = [p for p in sys.path if p != d]
        _saved.clear()


@contextlib.contextmanager
def shim_env() -> Iterator[None]:
    """``UNISLEEP_TMS=1`` and the shim folder first on ``PYTHONPATH`` while inside (for the
    processes started there); the previous values come back on exit."""
    old = {k: os.environ.get(k) for k in (ENV_SWITCH, "PYTHONPATH")}
    os.environ[ENV_SWITCH] = "1"
    os.environ["PYTHONPATH"] = _prepend_path(old["PYTHONPATH"] or "", shim_dir())
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
