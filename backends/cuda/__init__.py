"""CUDA backend: cumem virtual memory through the driver API (cuda-bindings, imported lazily)."""

from .descriptor import BACKEND


def __getattr__(name):
    if name == "CudaDriver":
        from .driver import CudaDriver

        return CudaDriver
    raise AttributeError(name)


__all__ = ["BACKEND", "CudaDriver"]
