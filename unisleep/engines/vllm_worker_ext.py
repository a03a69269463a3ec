"""A thin alias, kept for ``--worker-extension-cls unisleep.engines.vllm_worker_ext.UnisleepWorkerExtension``
as users' engine configurations name it: the extension is
:class:`unisleep.vllm_worker.extension.UnisleepWorkerExtension`."""

from ..vllm_worker.extension import UnisleepWorkerExtension  # noqa: F401

__all__ = ["UnisleepWorkerExtension"]
