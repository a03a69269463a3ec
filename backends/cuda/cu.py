"""Thin, checked access to the CUDA driver API through ``cuda.bindings`` (imported lazily).

cuda-bindings returns error codes instead of raising; :func:`call` turns a non-success code
into a :class:`CudaError` naming the call.  :func:`ensure_context` makes the device's *primary*
context current on the calling thread (allocator callbacks run on arbitrary threads, and driver
calls act on the thread's current context; a non-primary context would not be the one torch's
kernels use).
"""

from __future__ import annotations

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
        except Exception:
            detail = ""
        super().__init__(f"{call} failed: {name} {detail}".strip())


def driver():
    """The ``cuda.bindings.driver`` module, initialised once."""
    global _cu
    if _cu is None:
        with _lock:
            if _cu is None:
                try:
                    from cuda.bindings import driver as cu  # cuda-bindings >= 12.6
                except ImportError:
                    try:
                        from cuda import cuda as cu  # older cuda-python layout
                    except ImportError as e:
                        raise PlatformError(
                            "the CUDA backend needs cuda-bindings: pip install 'unisleep[cuda]'"
                        ) from e
                try:
                    (err,) = cu.cuInit(0)
                except Exception as e:  # cuda.pathfinder raises when libcuda is missing
                    raise PlatformError(f"the CUDA driver library could not be loaded ({e})") from e
                if int(err) != 0:
                    raise CudaError("cuInit", err)
                _cu = cu
    return _cu


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
