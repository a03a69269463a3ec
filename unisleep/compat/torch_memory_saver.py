"""The public surface of torch_memory_saver 0.0.10, backed by :class:`~unisleep.MemoryLifecycle`.

Same names, arguments and meaning as torch_memory_saver (tms) 0.0.10: the ``torch_memory_saver``
singleton and the ``TorchMemorySaver`` class with ``region``, ``cuda_graph``, ``pause``,
``resume``, ``disable``, ``enabled``, ``hook_mode``, ``memory_margin_bytes``,
``retain_cpu_backup``, ``get_cpu_backup``, ``set_disk_backup_dir``, and the module-level
``configure_subprocess()``.  It runs on every unisleep platform (CUDA, ROCm, Ascend, host), never
needs ``LD_PRELOAD``, accepts ``expandable_segments`` and reports per-tag resident bytes
(``resident_bytes(tag)``, ``state()``).  docs/compat-tms.md has the method table and every
difference; the main ones:

* a region routes the framework's own allocations into the tag on accelerators (the lifecycle's
  ``pool(tag)``); the **host backend has no pool**, so there only tensors made through the
  region's helpers (``with tms.region(...) as r: r.empty(...)`` / ``r.adopt(module)``, or
  ``tms.empty``/``tms.adopt`` inside the region) sleep — plain ``torch.empty`` stays ordinary
  memory;
* memory paused without a backup comes back zeroed (tms: "thrown away", contents undefined);
* pausing a paused allocation or resuming a running one raises
  :class:`~unisleep.errors.InvalidTransitionError` before anything changes (tms 0.0.10 ends the
  process with ``exit(1)``; ``MemoryLifecycle`` alone would make both a no-op); a tag with no
  allocations is a no-op, as in tms (``MemoryLifecycle`` would raise ``UnknownTagError``).

Backing: one lifecycle per device holds every tag with a CPU backup or none — its host backups
freed at each resume unless ``retain_cpu_backup`` (``host_backups="release"`` / ``"keep"``), as tms
frees its CPU backup — and disk-backed tags have one of their own per disk backup directory, whose
backups are files directly in that directory (``backup_to="disk"``, ``spill_layout="flat"``),
removed at resume.  ``pause(tag)`` is one
``sleep(2, offload_tags=<the backed-up ones>, tags=<the tag's>)`` per lifecycle — so a pause of
weights and KV cache together is one pipelined sleep (the KV cache released while the weights'
copies run) — and ``resume(tag)`` one ``wake_up(tags)``.  With ``UNISLEEP_TMS_PREPARE_BACKUP=1``
the host backup room is taken when a backed-up region ends (``prepare_backup(background=False)``)
instead of in the first pause, as tms does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any, Iterator, Literal, Optional

from .. import graph_capture
from ..errors import (
    InvalidArgumentError,
    InvalidTransitionError,
    NativeLibraryMissingError,
    UnsupportedError,
)
from ..platform import env_flag
from ..units import human_bytes
from .tms_capture import _SaverCapture
from .tms_lifecycles import _SaverLifecycles
from .tms_native import (
    _ON, _BinaryWrapper, _check_init_env, _check_preload, _Impl, _listen,
)
from .tms_slots import CPU, DISK, NONE, RegionHandle, _by_lifecycle, _check_tag, _names, _pool_key, _Slot  # noqa: F401

log = logging.getLogger("unisleep.compat")

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess", "RegionHandle"]

_TAG_DEFAULT = "default"
CpuBackupBackend = Literal["mmap", "pinned"]
HookMode = Literal["preload", "torch"]
_HOOK_MODES = ("preload", "torch")

#: the native library's file name: torch_memory_saver's own preload library is called so, and
#: slime and AReaL look for it in ``dirname(dirname(torch_memory_saver.__file__))``
NATIVE_NAME = "torch_memory_saver_hook_mode_preload.abi3.so"


def native_library_path() -> str:
    """Where the native library is installed: beside ``unisleep/compat/`` in the unisleep
    package, i.e. ``dirname(dirname(torch_memory_saver.__file__))`` when the facade is the
    ``torch_memory_saver`` module — the file slime and AReaL put in ``LD_PRELOAD``."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), NATIVE_NAME)


def native_library_missing(path: Optional[str] = None) -> str:
    """Why the native library at ``path`` (default: :func:`native_library_path`) is absent and
    how to get it."""
    path = path or native_library_path()
    return (f"unisleep's torch_memory_saver preload library ({path}) is not installed: it is built only when a C "
            "compiler is there at install time, and it serves only torch_memory_saver's preload mode (LD_PRELOAD, "
            "TMS_INIT_ENABLE=1: slime, AReaL). To get it, install a C compiler (e.g. `apt-get install gcc`) and "
            "install unisleep again (`pip install --force-reinstall --no-deps .` in the clone, or from the wheel); "
            "in a source tree, `python setup.py build_ext --inplace`")


def require_native_library() -> str:
    """The native library's path; :class:`~unisleep.errors.NativeLibraryMissingError` naming
    how to build it when unisleep was installed without it."""
    path = native_library_path()
    if not os.path.exists(path):
        raise NativeLibraryMissingError(native_library_missing(path))
    return path


class TorchMemorySaver(_SaverCapture, _SaverLifecycles):
    """torch_memory_saver 0.0.10's ``TorchMemorySaver``, on unisleep.  One per process is the
    norm (the module's ``torch_memory_saver``); each instance owns its own memory."""

    def __init__(self):
        self._lock = threading.RLock()
        self._local = threading.local()  # per-thread stack of regions, and the disable flag
        self._platform = None
        self._lcs: dict[tuple[int, Optional[str]], Any] = {}  # (device, disk backup dir or None) -> lifecycle
        self._slots: dict[tuple[str, int, str], _Slot] = {}  # (kind, device, ltag) -> slot
        self._graph_pools: dict[Any, _Slot] = {}  # graph pool id / caller's handle -> slot
        self._graphs = 0
        self._initialized = False
        self._margin = 0
        self._retain = bool(env_flag("TMS_RETAIN_CPU_BACKUP"))
        self._disk_dir: Optional[str] = os.environ.get("TMS_DISK_BACKUP_DIR") or None
        self._default_backend = os.environ.get("TMS_INIT_CPU_BACKUP_BACKEND") or "pinned"
        self._warned: set[str] = set()
        self._impl: Optional[_Impl] = None  # tms's attribute: set by the first use
        self._native_problem: Optional[str] = None
        self._capture = None  # whole-process capture (TMS_INIT_ENABLE=1), owned by this instance
        self._listener = None
        # get_cpu_backup: tags resumed with retain_cpu_backup on (their backup stays readable), and
        # the host tensors handed out with zero_copy=True, by (ptr, nbytes): (tensor, slot)
        self._retained: set[tuple[int, str]] = set()
        self._zero_copy: dict[tuple[int, int], tuple[Any, _Slot]] = {}
        # tms's _impl._mem_pools: (tag, cpu, disk, resolved cpu backup backend, device) -> slot
        self._region_pools: dict[tuple, _Slot] = {}

    # ------------------------------------------------------------------ tms surface
    @contextlib.contextmanager
    def region(
        self,
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: Optional[CpuBackupBackend] = None,
    ) -> Iterator[RegionHandle]:
        """Memory allocated inside may be paused; ``enable_cpu_backup`` keeps its bytes across a
        pause (host memory, freed at resume unless ``retain_cpu_backup``), ``enable_disk_backup``
        keeps them in files directly in the disk backup directory, one per allocation, removed at
        resume (every platform).  The two are mutually exclusive, as in tms."""
        self._check_backend(enable_cpu_backup, cpu_backup_backend)
        if enable_cpu_backup and enable_disk_backup:
            raise InvalidArgumentError(
                "enable_cpu_backup and enable_disk_backup are mutually exclusive; pass one of them"
            )
        _check_tag(tag)
        self._ensure_initialized()
        kind = CPU if enable_cpu_backup else DISK if enable_disk_backup else NONE
        slot = self._slot(tag, kind, self._current_device(), tag)
        handle = RegionHandle(self, slot)
        lc = slot.lc
        # the thread's settings as tms keeps them (what the capture reads, and what callers of
        # _impl._binary_wrapper.cdll see); the previous ones come back at the end
        config = self._thread_config(tag=tag, interesting=True, cpu=enable_cpu_backup,
                                     backend=cpu_backup_backend if enable_cpu_backup else None,
                                     disk=enable_disk_backup)
        if lc.driver.capabilities.supports_pool:
            with self._lock:
                self._region_pools[(tag, bool(enable_cpu_backup), bool(enable_disk_backup),
                                    cpu_backup_backend or self._default_backend, slot.device)] = slot
            with config, self._pushed(slot, route=True):
                yield handle
            self._prepare_backup(slot)
        else:
            if self._capture is None:
                self._say_once(
                    "host-region",
                    f"torch_memory_saver.region() on the {lc.platform_name} backend: torch's own allocations are "
                    "routed into the tag only with whole-process capture (TMS_INIT_ENABLE=1); otherwise allocate "
                    "with `with torch_memory_saver.region(...) as r: r.empty(...)` or r.adopt(module)",
                )
            with config, self._pushed(slot, route=False):
                yield handle
            self._prepare_backup(slot)

    @contextlib.contextmanager
    def cuda_graph(
        self,
        cuda_graph,
        pool=None,
        stream=None,
        capture_error_mode: str = "global",
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        cpu_backup_backend: Optional[CpuBackupBackend] = None,
    ) -> Iterator[RegionHandle]:
        """Like the device module's ``graph(...)`` capture context, with the graph's memory (its
        intermediate tensors) in ``tag`` so ``pause(tag)`` releases it.  ``pool=None`` gives the
        graph a private pool, as the device module does; a ``pool`` shared between captures
        (``graph.pool()`` of an earlier capture, or a graph pool handle) is shared here too."""
        import torch

        self._check_backend(enable_cpu_backup, cpu_backup_backend)
        _check_tag(tag)
        self._ensure_initialized()
        if not self._platform.is_accelerator:
            raise UnsupportedError(
                f"{self.cuda_graph.__name__}() needs an accelerator with graph capture; the host backend has "
                "none. Run the captured code directly, or on an accelerator"
            )
        devmod = torch.get_device_module(self._platform.torch_device_type)
        kind = CPU if enable_cpu_backup else NONE
        device = self._current_device()
        with self._lock:
            slot = self._graph_pools.get(_pool_key(pool)) if pool is not None else None
            if slot is None:
                self._graphs += 1
                slot = self._slot(tag, kind, device, f"{tag}/graph-pool-{self._graphs}")
                if pool is not None:  # the caller's handle: every capture passing it shares our pool
                    self._graph_pools[_pool_key(pool)] = slot
        lc = slot.lc
        graph_pool = getattr(lc.driver, "graph_pool", None)
        if graph_pool is None:
            self._say_once(
                "graph-pool",
                f"{self.cuda_graph.__name__}(): the {lc.platform_name} backend cannot put graph memory in a tag; the graph is "
                "captured as usual and its memory is not released by pause()",
            )
            with self._pushed(slot, route=False), graph_capture.capture(), \
                    devmod.graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
                yield RegionHandle(self, slot)
            return
        if lc.state().get(slot.ltag, "awake") != "awake":
            raise InvalidTransitionError(
                f"tag {tag!r} is paused; resume it (resume({tag!r})) before capturing into it — nothing was changed"
            )
        pid = graph_pool(lc, slot.ltag)
        with self._lock:
            self._graph_pools[_pool_key(pid)] = slot
        # the capture allocates from its own pool: no region's routing may be active meanwhile
        with self._pushed(slot, route=False), graph_capture.capture(), \
                devmod.graph(cuda_graph, pool=pid, stream=stream, capture_error_mode=capture_error_mode):
            yield RegionHandle(self, slot)

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        """Allocations inside are ordinary memory, outside any tag (e.g. weight-update buffers
        that must not be paused; slime runs its weight sync in it)."""
        self._ensure_initialized()
        # as tms: the thread's "interesting region" is off (nothing it allocates is captured) and
        # the routing into the current region's pool is switched off; with whole-process capture
        # on an accelerator the thread also allocates from a throwaway pool, given back at the
        # end, so torch never hands out cached blocks of captured (maybe paused) memory inside
        with self._pushed(None, route=False), self._thread_config(interesting=False), self._scratch_pool():
            yield  # a region entered inside routes again, as in tms

    def pause(self, tag: Optional[str] = None) -> None:
        """Release the memory of ``tag`` (every tag if ``None``); backed-up regions keep their
        bytes, the others come back zeroed.  Addresses never change."""
        self._ensure_initialized()
        with self._own(), self._lock:
            slots = self._targets(tag)
            busy = [s for s in slots if s.lc.state().get(s.ltag) != "awake"]
            if busy:
                raise InvalidTransitionError(
                    f"cannot pause tag(s) {_names(busy)}: already paused (torch_memory_saver 0.0.10 ends the process "
                    f"here). Resume first (resume({tag!r})) — nothing was changed."
                )
            done: list[tuple[Any, list[str]]] = []
            try:  # one transactional sleep per lifecycle; a failure wakes what the others paused
                for lc, group in _by_lifecycle(slots):
                    ltags = [s.ltag for s in group]
                    # level 2: nothing but offload_tags is kept (level 1 would also keep a tag named "weights")
                    lc.sleep(2, offload_tags=[s.ltag for s in group if s.kind != NONE], tags=ltags)
                    done.append((lc, ltags))
            except BaseException:
                for lc, ltags in done:
                    try:
                        lc.wake_up(ltags)
                    except Exception as e:  # keep the original error
                        log.error("could not resume %s after a failed pause: %s", ltags, e)
                raise
            # host tensors handed out by get_cpu_backup(zero_copy=True) show the new backup, at the
            # same address (tms refreshes its retained host buffer in place)
            paused = set(map(id, slots))
            for (ptr, _n), (t, s) in list(self._zero_copy.items()):
                if id(s) in paused and not s.lc.read_backup(ptr, t):
                    self._zero_copy.pop((ptr, _n), None)

    def resume(self, tag: Optional[str] = None) -> None:
        """Map the memory of ``tag`` (every tag if ``None``) back at the same addresses."""
        self._ensure_initialized()
        with self._own(), self._lock:
            slots = self._targets(tag)
            awake = [s for s in slots if s.lc.state().get(s.ltag) == "awake"]
            if awake:
                raise InvalidTransitionError(
                    f"cannot resume tag(s) {_names(awake)}: not paused (torch_memory_saver 0.0.10 ends the process "
                    f"here). Pause first, or resume only the paused tags — nothing was changed."
                )
            for lc, group in _by_lifecycle(slots):
                if lc is not self._lcs.get((group[0].device, None)):
                    lc.wake_up([s.ltag for s in group])  # disk-backed: files removed at resume
                    continue
                # tms frees a CPU backup at resume unless retain_cpu_backup is on: the host
                # memory of the lifecycle's backups goes back with it (CUDA: the arena's
                # segments are unregistered and unmapped)
                lc.host_backups = "keep" if self._retain else "release"
                lc.wake_up([s.ltag for s in group])
            # tms decides at resume: retained backups stay readable (same host tensors) until the
            # next resume without retain_cpu_backup; the others are given up
            woken = set(map(id, slots))
            for s in slots:
                if self._retain and s.kind == CPU:
                    self._retained.add((id(s.lc), s.ltag))
                else:
                    self._retained.discard((id(s.lc), s.ltag))
            for key, (_t, s) in list(self._zero_copy.items()):
                if id(s) in woken and (id(s.lc), s.ltag) not in self._retained:
                    self._zero_copy.pop(key, None)

    @property
    def enabled(self) -> bool:
        return True

    @property
    def hook_mode(self):
        raise AttributeError("hook_mode can only be set (as in torch_memory_saver 0.0.10)")

    @hook_mode.setter
    def hook_mode(self, hook_mode: HookMode) -> None:
        # tms 0.0.10 refuses this after its first use (it picks its hook then); unisleep's
        # routing does not depend on it (regions use the lifecycle's pool, whole-process capture
        # follows TMS_INIT_ENABLE), so any valid value is accepted at any time and changes
        # nothing (SGLang's adapter sets "torch" or "preload" whenever it is created; AReaL sets
        # "preload" after its first use)
        if hook_mode not in _HOOK_MODES:
            raise InvalidArgumentError(f"hook_mode must be 'preload' or 'torch', got {hook_mode!r}")

    @property
    def memory_margin_bytes(self):
        raise NotImplementedError("Only setter is supported")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidArgumentError(f"memory_margin_bytes must be an int >= 0, got {value!r}")
        self._ensure_initialized()
        self._margin = value

    @property
    def retain_cpu_backup(self) -> bool:
        self._ensure_initialized()
        return self._retain

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        self._ensure_initialized()
        self._retain = bool(value)

    def get_cpu_backup(self, x, zero_copy: bool = False):
        """The host copy of ``x``'s bytes: while ``x`` is paused with a CPU backup, and after a
        resume made while ``retain_cpu_backup`` was on, until the next resume made while it is
        off (as tms decides); ``None`` otherwise (disk-backed regions always give ``None``, as in
        tms).  ``zero_copy=False``: a new CPU tensor each call.  ``zero_copy=True``: the same host
        tensor (same ``data_ptr``) for the same ``x`` for as long as its backup is readable; a
        pause refreshes its bytes in place, as tms's retained buffer.  Unlike tms it is a copy
        of the backup (which may be a spill file or split over arena segments): writes to it
        never reach the backup.  On backends that drop backups once their bytes are back (host,
        ROCm, Ascend), a retained backup is readable after resume for the tensors read with
        ``zero_copy=True`` while paused.  The host tensor of ``zero_copy=True`` is memory of its
        own — page-locked on CUDA (as tms's pinned backup) when read while ``retain_cpu_backup``
        is on, ordinary memory otherwise — given back to the system once its backup is given up
        (a resume without ``retain_cpu_backup``, or the allocation freed) and the caller holds
        it no more."""
        import torch

        self._ensure_initialized()
        if not isinstance(x, torch.Tensor):
            raise InvalidArgumentError(f"get_cpu_backup() takes a tensor, got {type(x).__name__}")
        if not x.is_contiguous():
            raise InvalidArgumentError(
                f"get_cpu_backup() needs a contiguous tensor (shape {tuple(x.shape)}, stride {x.stride()}); "
                "pass the contiguous tensor the region allocated"
            )
        ptr, n = x.data_ptr(), x.numel() * x.element_size()
        with self._own(), self._lock:
            found = next((s for s in self._slots.values() if s.lc.owns(ptr, n, s.ltag)), None)
            if found is None:
                raise InvalidArgumentError(
                    f"get_cpu_backup(): the tensor at {ptr:#x} ({human_bytes(n)}) was not allocated in a "
                    "torch_memory_saver region (torch_memory_saver 0.0.10 ends the process here)"
                )
            s = found
            if s.kind == DISK:
                return None
            paused = s.lc.state().get(s.ltag) != "awake"
            if s.kind == NONE:
                if paused:
                    raise InvalidTransitionError(
                        f"get_cpu_backup(): tag {s.tag!r} is paused without a CPU backup; its bytes are gone. "
                        "Allocate it in region(..., enable_cpu_backup=True) to read it while paused"
                    )
                return None
            if not paused and (id(s.lc), s.ltag) not in self._retained:
                return None
            hit = self._zero_copy.get((ptr, n))
            if hit is not None and hit[1] is s:
                out = hit[0] if zero_copy else hit[0].clone()
                return out.view(x.dtype).view(x.shape)
            # page-locked memory of its own (as tms's pinned backup) for a read made while
            # retain_cpu_backup is on: that tensor outlives resumes, so the page-locking is paid
            # once; a read made without it lives for one pause, and page-locking it anew at every
            # pause would cost several times the copy (docs/compat-tms.md)
            pinned = zero_copy and self._retain
            out = s.lc.driver.host_buffer(n) if pinned else torch.empty(n, dtype=torch.uint8)
            if not s.lc.read_backup(ptr, out):
                if paused:  # pragma: no cover - a paused backed-up tag always has its backup
                    raise InvalidTransitionError(f"get_cpu_backup(): no backup of tag {s.tag!r} is held")
                return None
            if zero_copy:
                self._zero_copy[(ptr, n)] = (out, s)
        return out.view(x.dtype).view(x.shape)

    def set_disk_backup_dir(self, path: str) -> None:
        """The directory of disk backups (created if needed); applies to regions whose tag is
        first used after this call."""
        self._ensure_initialized()
        os.makedirs(path, exist_ok=True)
        self._disk_dir = str(path)

    # ------------------------------------------------------------------ unisleep additions
    def empty(self, shape, dtype=None):
        """A new tensor (zeros) in the innermost active region's tag on this thread; inside
        ``disable()`` an ordinary tensor on the device."""
        return self._empty(self._current_slot("empty"), shape, dtype)

    def adopt(self, obj):
        """Move ``obj``'s tensors into the innermost active region's tag, in place."""
        return self._adopt(self._current_slot("adopt"), obj)

    def resident_bytes(self, tag: Optional[str] = None) -> int:
        """Physical bytes the backend holds now for ``tag`` (all tags if ``None``)."""
        with self._lock:
            return sum(
                s.lc.resident_bytes(s.ltag) for s in self._slots.values()
                if (tag is None or s.tag == tag) and s.ltag in s.lc.tags
            )

    def state(self) -> dict[str, str]:
        """Each tms tag's state: ``"active"``, ``"paused"`` or ``"mixed"`` (some of its
        allocations paused — e.g. a graph pool resumed apart)."""
        with self._lock:
            seen: dict[str, set[str]] = {}
            for s in self._slots.values():
                st = s.lc.state().get(s.ltag)
                if st is not None:
                    seen.setdefault(s.tag, set()).add("active" if st == "awake" else "paused")
            return {t: (next(iter(v)) if len(v) == 1 else "mixed") for t, v in seen.items()}

    def lifecycles(self) -> list:
        """The ``MemoryLifecycle`` objects behind this facade (for reports)."""
        with self._lock:
            return list(self._lcs.values())

    @property
    def platform_name(self) -> str:
        self._ensure_initialized()
        return self._platform.name

    def close(self) -> None:
        """Free every region of this facade (its tensors must no longer be used)."""
        with self._lock:
            for lc in self.lifecycles():
                lc.close()
            self._lcs.clear()
            self._slots.clear()
            self._graph_pools.clear()
            self._region_pools.clear()

    # ------------------------------------------------------------------ internals
    def _ensure_initialized(self) -> None:
        if self._initialized:
            return
        with self._lock:
            if self._initialized:
                return
            from ..platform import detect_platform

            _check_init_env()
            self._platform = detect_platform()
            self._load_native()
            if os.environ.get("TMS_INIT_ENABLE", "") in _ON:
                self._start_capture()
            self._initialized = True

    def _load_native(self) -> None:
        """The native library as ``_impl._binary_wrapper.cdll`` (tms's per-thread settings and
        the capture's hooks); without it (not built) everything but whole-process capture works."""
        from ..registry import driver_class

        path = native_library_path()
        _check_preload(path)
        spec = driver_class(self._platform.name).capture_spec
        if not os.path.exists(path):
            self._native_problem = native_library_missing(path)
            return
        try:
            bw = _BinaryWrapper(path, spec.runtime if spec is not None else None)
        except OSError as e:
            self._native_problem = f"unisleep's native library {path} does not load: {e}"
            return
        self._impl = _Impl(bw, self)
        _listen(self, bw.cdll)


# ---------------------------------------------------------------------- helpers
@contextlib.contextmanager
def configure_subprocess() -> Iterator[None]:
    """For the processes started inside: ``import torch_memory_saver`` there gets this facade
    (tms 0.0.10 sets ``LD_PRELOAD`` here; unisleep needs none).  Sets ``UNISLEEP_TMS=1`` and puts
    the shim folder first on ``PYTHONPATH``; both are restored on exit."""
    from . import shim_env

    with shim_env():
        yield


#: the global singleton, as ``from torch_memory_saver import torch_memory_saver`` gives it
torch_memory_saver = TorchMemorySaver()

if os.environ.get("TMS_INIT_ENABLE", "") in _ON:
    # whole-process capture starts with the import, before the program's first allocation (tms
    # captures from the process's start through LD_PRELOAD)
    torch_memory_saver._ensure_initialized()
