"""The native library behind the torch_memory_saver facade (:mod:`.torch_memory_saver`): its
per-thread settings as tms's ``_impl._binary_wrapper``, the checks of the TMS_INIT_* variables
and of ``LD_PRELOAD`` made before it loads, and the listener that follows changes of a thread's
interesting region made by other code."""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import MutableMapping
from typing import Optional

from ..errors import InvalidArgumentError, UnsupportedError

log = logging.getLogger("unisleep.compat")

#: torch_memory_saver's accepted values of its boolean variables (others end that library's process)
_ON, _OFF = ("1", "true", "TRUE", "yes", "YES"), ("0", "false", "FALSE", "no", "NO")
_INIT_VARS = ("TMS_INIT_ENABLE", "TMS_INIT_ENABLE_CPU_BACKUP", "TMS_INIT_ENABLE_DISK_BACKUP")


class _NativeLibrary(ctypes.CDLL):
    """unisleep's native library as ``cdll``.  A name it does not define is looked up in the
    device runtime library loaded in this process (``runtime``: its file stem, the backend's
    ``capture_spec.runtime``; None: the process's global symbols): tms's library links the
    runtime, so code reaches runtime functions through tms's ``cdll`` (its examples call
    ``cdll.cudaHostGetFlags`` on CUDA).  The native library itself needs only libc."""

    def __init__(self, path: str, runtime: Optional[str] = None):
        super().__init__(path)
        self._runtime_stem = runtime
        self._runtime_lib = None

    def __getattr__(self, name: str):
        if name.startswith("_"):  # dunders, and this object's own fields before they are set
            return super().__getattr__(name)
        try:
            return super().__getattr__(name)
        except AttributeError:
            fn = getattr(self._runtime(), name)  # AttributeError names the runtime library
            setattr(self, name, fn)
            return fn

    def _runtime(self) -> ctypes.CDLL:
        if self._runtime_lib is None:
            if self._runtime_stem is None:
                self._runtime_lib = ctypes.CDLL(None)
            else:
                from ..backends._capture import find_loaded

                found = find_loaded(self._runtime_stem)
                if found is None:
                    raise AttributeError(
                        f"{self._runtime_stem} (the device runtime library) is not loaded in this process; "
                        "use the device through torch first")
                self._runtime_lib = ctypes.CDLL(found[0])
        return self._runtime_lib


#: tms's per-thread settings: each has ``tms_set_<name>(value)`` and ``tms_get_<name>()``
_SETTINGS = (("current_tag", ctypes.c_char_p), ("interesting_region", ctypes.c_bool),
             ("enable_cpu_backup", ctypes.c_bool), ("cpu_backup_backend", ctypes.c_char_p),
             ("enable_disk_backup", ctypes.c_bool))


class _BinaryWrapper:
    """torch_memory_saver's ``_impl._binary_wrapper``: ``cdll`` is unisleep's native library
    with tms's per-thread setting functions (``tms_{get,set}_interesting_region``,
    ``_current_tag``, ``_enable_cpu_backup``, ``_cpu_backup_backend``, ``_enable_disk_backup``),
    their signatures set as tms sets them, and the device runtime's functions behind them
    (:class:`_NativeLibrary`).  Turning the interesting region off on a thread makes that
    thread's allocations ordinary memory, outside any tag, until it is turned on again."""

    def __init__(self, path: str, runtime: Optional[str] = None):
        self.path = path
        self.cdll = _NativeLibrary(path, runtime)
        c = self.cdll
        for name, ctype in _SETTINGS:
            getattr(c, f"tms_set_{name}").argtypes = [ctype]
            getattr(c, f"tms_get_{name}").restype = ctype
        c.unisleep_tms_set_cpu_backup_backend.argtypes = [ctypes.c_char_p]
        c.unisleep_capture_owned.restype = ctypes.c_size_t
        c.unisleep_tms_library.restype = ctypes.c_char_p

    def set_config(self, *, tag: str, interesting_region: bool, enable_cpu_backup: bool,
                   cpu_backup_backend: Optional[str] = None, enable_disk_backup: bool = False) -> None:
        """All of the calling thread's settings at once (tms's ``BinaryWrapper.set_config``)."""
        self.cdll.tms_set_current_tag(tag.encode("utf-8"))
        self.cdll.tms_set_interesting_region(interesting_region)
        self.cdll.tms_set_enable_cpu_backup(enable_cpu_backup)
        if cpu_backup_backend is not None:
            self.cdll.tms_set_cpu_backup_backend(cpu_backup_backend.encode("utf-8"))
        self.cdll.tms_set_enable_disk_backup(enable_disk_backup)

    def get_config(self) -> tuple:
        c = self.cdll
        return (c.tms_get_current_tag().decode("utf-8"), bool(c.tms_get_interesting_region()),
                bool(c.tms_get_enable_cpu_backup()), c.tms_get_cpu_backup_backend().decode("utf-8"),
                bool(c.tms_get_enable_disk_backup()))


class _Impl:
    """What ``torch_memory_saver._impl`` is once the facade started (``None`` before, as in
    tms), with the private parts of tms's ``_impl`` that its own examples use:
    ``_binary_wrapper``, ``_mem_pools`` (:class:`_MemPools`) and ``_with_region_config``."""

    def __init__(self, binary_wrapper: _BinaryWrapper, saver=None):
        self._binary_wrapper = binary_wrapper
        self._saver = saver
        self._mem_pools = _MemPools(saver)

    def _with_region_config(self, tag: str, enable_cpu_backup: bool, enable_disk_backup: bool = False,
                            cpu_backup_backend: Optional[str] = None):
        """The calling thread's tms settings set to an interesting region of ``tag`` with these
        backups inside, restored after (what tms's ``region()`` does around its pool)."""
        return self._saver._thread_config(tag=tag, interesting=True, cpu=enable_cpu_backup,
                                          backend=cpu_backup_backend if enable_cpu_backup else None,
                                          disk=enable_disk_backup)


class _MemPools(MutableMapping):
    """tms's ``_impl._mem_pools``: the torch memory pool behind each region configuration, keyed
    ``(tag, enable_cpu_backup, enable_disk_backup, cpu_backup_backend, device)`` with the backend
    resolved (``"pinned"`` unless ``TMS_INIT_CPU_BACKUP_BACKEND`` says otherwise), for the
    configurations ``region()`` used on a backend with pools.  Removing one (``pop``, ``del``)
    hands the pool to the caller: once the caller drops it and nothing allocated in it is alive,
    ``empty_cache()`` gives its memory back — and with it the CPU backup kept for it, as in tms.
    The next ``region()`` of that configuration makes a new pool.  Entries cannot be set."""

    def __init__(self, saver):
        self._saver = saver

    def _slots(self) -> dict:
        return self._saver._region_pools if self._saver is not None else {}

    def __getitem__(self, key):
        slot = self._slots()[key]
        return slot.lc.driver.mempool(slot.lc, slot.ltag)

    def __delitem__(self, key) -> None:
        slot = self._slots()[key]
        with self._saver._lock:
            for k in [k for k, s in self._slots().items() if s is slot]:
                del self._slots()[k]
        slot.lc.driver.mempool(slot.lc, slot.ltag, detach=True)

    def __setitem__(self, key, value) -> None:
        raise InvalidArgumentError("torch_memory_saver's memory pools are made by region(); they cannot be set")

    def __iter__(self):
        return iter(list(self._slots()))

    def __len__(self) -> int:
        return len(self._slots())



def _check_init_env() -> None:
    """The TMS_INIT_* variables with values torch_memory_saver accepts (it ends the process on
    others); an unset or empty variable is off."""
    for var in _INIT_VARS:
        v = os.environ.get(var, "")
        if v and v not in _ON + _OFF:
            raise InvalidArgumentError(f"{var}={v!r}: use 1/true/yes (on) or 0/false/no (off), as torch_memory_saver reads it")
    b = os.environ.get("TMS_INIT_CPU_BACKUP_BACKEND", "")
    if b not in ("", "mmap", "pinned"):
        raise InvalidArgumentError(f"TMS_INIT_CPU_BACKUP_BACKEND={b!r}: use 'pinned' or 'mmap'")
    if os.environ.get("TMS_INIT_ENABLE_CPU_BACKUP", "") in _ON and os.environ.get("TMS_INIT_ENABLE_DISK_BACKUP", "") in _ON:
        raise InvalidArgumentError(
            "TMS_INIT_ENABLE_CPU_BACKUP and TMS_INIT_ENABLE_DISK_BACKUP are both on; they are mutually exclusive, set one")


def _check_preload(ours: str) -> None:
    """torch_memory_saver's own preload library in LD_PRELOAD would capture the allocations a
    second time, under this facade: refused, naming it."""
    real_ours = os.path.realpath(ours)
    for entry in os.environ.get("LD_PRELOAD", "").replace(" ", ":").split(":"):
        if "torch_memory_saver" in os.path.basename(entry) and os.path.realpath(entry) != real_ours:
            raise UnsupportedError(
                f"LD_PRELOAD names torch_memory_saver's own library ({entry}): under unisleep's facade it would capture "
                f"this process's allocations a second time. Remove it from LD_PRELOAD, or name unisleep's instead ({ours}; "
                "`python -m unisleep.compat --preload-path` prints it)")


_LISTENER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_int)
_listening: "weakref.WeakSet[TorchMemorySaver]" = None  # type: ignore[assignment]
_listener_fn = None


def _listen(saver: "TorchMemorySaver", cdll) -> None:
    """Tell ``saver`` when code other than a facade sets a thread's interesting region."""
    global _listening, _listener_fn
    import weakref

    if _listener_fn is None:
        _listening = weakref.WeakSet()

        def changed(_what, _value):
            try:
                for s in list(_listening):
                    s._interesting_changed()
            except BaseException as e:  # never raise through C
                log.error("torch_memory_saver: could not follow a change of the interesting region: %s", e)

        _listener_fn = _LISTENER(changed)
        cdll.unisleep_tms_set_listener(_listener_fn)
    _listening.add(saver)
