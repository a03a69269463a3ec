"""Thin, checked access to the CUDA driver API through ``cuda.bindings`` (imported lazily).

cuda-bindings returns error codes instead of raising; :func:`call` turns a non-success code
into a :class:`CudaError` naming the call.  :func:`ensure_context` makes the device's *primary*
context current on the calling thread (allocator callbacks run on arbitrary threads, and driver
calls act on the thread's current context; a non-primary context would not be the one torch's
kernels use).
"""

from __future__ import annotations

import logging
import threading

from unisleep.errors import PlatformError, UnisleepError

_cu = None
_lock = threading.Lock()
_primary: dict[int, object] = {}


class CudaError(UnisleepError):
    def __init__(self, call: str, code):
        self.call, self.code = call, code
        name = getattr(code, "name", str(code))
        try:
            _, s = driver().cuGetErrorString(code)
            detail = s.decode() if isinstance(s, bytes) else str(s)
        except Exception:  # describing an error must not replace it: the code alone is shown
            detail = ""
        super().__init__(f"{call} failed: {name} {detail}".strip())


def driver():
    """The ``cuda.bindings.driver`` module, initialised once."""
    global _cu
    if _cu is None:
        with _lock:
            if _cu is None:
                from .descriptor import BACKEND

                try:
                    from cuda.bindings import driver as cu  # cuda-bindings >= 12.6
                except ImportError:
                    try:
                        from cuda import cuda as cu  # older cuda-python layout
                    except ImportError as e:
                        raise PlatformError(
                            f"the CUDA backend needs cuda-bindings: pip install 'unisleep[{BACKEND.install_extra()}]'"
                        ) from e
                warning = bindings_vs_torch(_bindings_version(), _torch_cuda())
                if warning:
                    logging.getLogger("unisleep.cuda").warning("%s", warning)
                try:
                    (err,) = cu.cuInit(0)
                except Exception as e:  # cuda.pathfinder raises when libcuda is missing
                    raise PlatformError(f"the CUDA driver library could not be loaded ({e})") from e
                if int(err) != 0:
                    raise CudaError("cuInit", err)
                try:
                    err, drv = cu.cuDriverGetVersion()
                except Exception:  # an unreadable version: the check below says "unknown"
                    err, drv = 1, 0
                problem = bindings_vs_driver(_bindings_version(), int(drv) if int(err) == 0 else None)
                if problem:
                    raise PlatformError(problem)
                _cu = cu
    return _cu


def _bindings_version():
    try:
        from importlib import metadata

        return metadata.version("cuda-bindings")
    except Exception:  # not installed, or unreadable metadata: the version checks say "unknown"
        return None


def _torch_cuda():
    try:
        import torch

        return torch.version.cuda
    except Exception:  # a torch that fails to import has no CUDA build to compare with
        return None


def bindings_vs_torch(bindings: "str | None", torch_cuda: "str | None"):
    """A warning when cuda-bindings are for another CUDA major than torch's build
    (``torch.version.cuda``): the extra to install is the one of torch's major.  Not fatal —
    both reach the same driver — but a mismatched pair is not what the extras install."""
    if not bindings or not torch_cuda:
        return None
    major, want = int(str(bindings).split(".")[0]), int(str(torch_cuda).split(".")[0])
    if want == major:
        return None
    return (f"cuda-bindings {bindings} are for CUDA {major}, but torch was built for CUDA {torch_cuda}: "
            f"pip install 'unisleep[cuda{want}]' installs the matching cuda-bindings {want}.x")


def bindings_vs_driver(bindings: "str | None", driver: "int | None"):
    """Why cuda-bindings cannot run on this driver (``cuDriverGetVersion``, e.g. 12080 for 12.8),
    or None: the driver must support the bindings' CUDA major.  Names the fix."""
    if not bindings or driver is None:
        return None
    major = int(str(bindings).split(".")[0])
    if driver // 1000 >= major:
        return None
    return (f"cuda-bindings {bindings} need a driver for CUDA {major}, but this NVIDIA driver supports CUDA "
            f"{driver // 1000}.{driver % 1000 // 10}: update the driver, or use torch built for CUDA {driver // 1000} "
            f"with pip install 'unisleep[cuda{driver // 1000}]'")


def call(name: str, *args):
    """Call ``cu.<name>(*args)``; raise on error; return the remaining results (None, one, or a tuple)."""
    out = getattr(driver(), name)(*args)
    err, rest = out[0], out[1:]
    if int(err) != 0:
        raise CudaError(name, err)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def ensure_context(device: int) -> None:
    """Make ``device``'s primary context current on this thread (never create a new context)."""
    cu = driver()
    err, cur = cu.cuCtxGetCurrent()
    if int(err) == 0 and int(cur) != 0:
        err, dev = cu.cuCtxGetDevice()
        if int(err) == 0 and int(dev) == device:
            ctx = _primary.get(device)
            if ctx is None or int(ctx) == int(cur):
                return
    ctx = _primary.get(device)
    if ctx is None:
        with _lock:
            ctx = _primary.get(device)
            if ctx is None:
                dev = call("cuDeviceGet", device)
                ctx = call("cuDevicePrimaryCtxRetain", dev)  # kept for the process lifetime
                _primary[device] = ctx
    call("cuCtxSetCurrent", ctx)
