"""ROCm backend: HIP virtual memory through ctypes ``libamdhip64.so`` (loaded only when a
driver is created).  The bindings are checked against the real HIP 5.2.3 runtime and header
(tests/test_hip_real.py), the driver's logic against the simulated HIP library in tests/sim;
not run on ROCm hardware — see docs/rocm.md."""

from unisleep.backend import Backend

BACKEND = Backend(
    name="rocm",
    package=__name__,
    torch_device="cuda",  # a ROCm build of torch calls its HIP devices "cuda"
    driver=".driver:RocmDriver",
    detect=".detect:detect",
    priority=20,  # before CUDA: a ROCm machine may have CUDA-looking device nodes, never the reverse
    store=".store:HipHostStore",
    collective=".collective",
    pool=".pool",
    graph_class="torch.cuda:CUDAGraph",  # HIP graphs in a ROCm build of torch
    environment_warnings=".config:environment_warnings",
    alloc_conf_vars=("PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"),
    packages=(("amdsmi", "amdsmi"),),
    extra="rocm",
)

_LAZY = {"RocmDriver": ".driver", "HipHandle": ".driver", "FileLimitError": ".driver", "AddressMovedError": ".driver",
         "HipError": ".hip", "HipNoDeviceError": ".hip"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(name)


__all__ = ["BACKEND", *_LAZY]
