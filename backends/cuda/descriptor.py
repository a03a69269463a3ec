"""The cuda backend's descriptor (:class:`unisleep.backend.Backend`): what unisleep knows of the
platform; the package exports it as ``BACKEND``, the entry point names it."""

from unisleep.backend import Backend

BACKEND = Backend(
    name="cuda",
    package=__package__,
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
    library_caches=".pool:release_library_caches",
    alloc_conf_vars=("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"),
    packages=(("cuda-bindings", "cuda.bindings"), ("pynvml (nvidia-ml-py)", "pynvml")),
    extra="cuda12",
    extra_for=".detect:install_extra",
)
