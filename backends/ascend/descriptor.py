"""The ascend backend's descriptor (:class:`unisleep.backend.Backend`): what unisleep knows of the
platform; the package exports it as ``BACKEND``, the entry point names it."""

from unisleep.backend import Backend

from .detect import EXPANDABLE_NOTE

BACKEND = Backend(
    name="ascend",
    package=__package__,
    torch_device="npu",
    driver=".driver:AscendDriver",
    detect=".detect:detect",
    priority=30,
    store=".store:AclHostStore",
    collective=".collective",
    ipc=".ipc",  # colocated buffers by pid-whitelisted shareable handle; tested over the simulated ACL library only
    pool=".pool",
    graph_class="torch_npu.npu.graphs:NPUGraph",  # capture_begin/capture_end defined in Python
    environment_warnings=".detect:environment_warnings",
    alloc_conf_vars=("PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF"),
    expandable_note=EXPANDABLE_NOTE,
    packages=(("torch_npu", "torch_npu"), ("vllm_ascend", "vllm_ascend")),
    extra="ascend",
    vllm_worker=".vllm_worker",
)
