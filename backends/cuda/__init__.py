"""CUDA backend: cumem virtual memory through the driver API (cuda-bindings, imported lazily)."""


def __getattr__(name):
    if name == "CudaDriver":
        from .driver import CudaDriver

        return CudaDriver
    raise AttributeError(name)


__all__ = ["CudaDriver"]
