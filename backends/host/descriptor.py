"""The host backend's descriptor (:class:`unisleep.backend.Backend`): what unisleep knows of the
platform; the package exports it as ``BACKEND``, the entry point names it."""

from unisleep.backend import Backend

BACKEND = Backend(
    name="host",
    package=__package__,
    torch_device="cpu",
    driver=".driver:HostDriver",
    detect=".detect:detect",
    priority=0,
    store=".spill_store:SpillStore",
    collective=".collective",
    ipc=".ipc",
    extra="test",
)
