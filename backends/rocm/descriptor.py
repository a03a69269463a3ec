"""The rocm backend's descriptor (:class:`unisleep.backend.Backend`): what unisleep knows of the
platform; the package exports it as ``BACKEND``, the entry point names it."""

from unisleep.backend import Backend

BACKEND = Backend(
    name="rocm",
    package=__package__,
    torch_device="cuda",  # a ROCm build of torch calls its HIP devices "cuda"
    driver=".driver:RocmDriver",
    detect=".detect:detect",
    priority=20,  # before CUDA: a ROCm machine may have CUDA-looking device nodes, never the reverse
    store=".store:HipHostStore",
    collective=".collective",
    ipc=".ipc",  # colocated buffers by POSIX fd; tested over the simulated HIP library only
    pool=".pool",
    graph_class="torch.cuda:CUDAGraph",  # HIP graphs in a ROCm build of torch
    environment_warnings=".config:environment_warnings",
    alloc_conf_vars=("PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"),
    packages=(("amdsmi", "amdsmi"),),
    extra="rocm",
)
