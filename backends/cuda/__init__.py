"""CUDA backend: cumem virtual memory through the driver API (cuda-bindings, imported lazily)."""

from unisleep.backend import Backend

BACKEND = Backend(
    name="cuda",
    package=__name__,
    torch_device="cuda",
    driver=".driver:CudaDriver",
    detect=".detect:detect",
    priority=10,
    store=".arena:PinnedArena",
    collective=".collective",
    ipc=".ipc",
    checksum=".checksum",
    pool=".pool",
    graph_class="torch.cuda:CUDAGraph",
    alloc_conf_vars=("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"),
    packages=(("cuda-bindings", "cuda.bindings"), ("pynvml (nvidia-ml-py)", "pynvml")),
    extra="cuda12",
    extra_for=".detect:install_extra",
)


def __getattr__(name):
    if name == "CudaDriver":
        from .driver import CudaDriver

        return CudaDriver
    raise AttributeError(name)


__all__ = ["BACKEND", "CudaDriver"]
