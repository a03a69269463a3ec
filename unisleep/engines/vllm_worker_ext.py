"""Public alias (the list: :mod:`unisleep`'s docstring): the name users' engine configurations
give ``--worker-extension-cls`` (``unisleep.engines.vllm_worker_ext.UnisleepWorkerExtension``).
The extension is :class:`unisleep.vllm_worker.extension.UnisleepWorkerExtension`."""

from ..vllm_worker.extension import UnisleepWorkerExtension  # noqa: F401

__all__ = ["UnisleepWorkerExtension"]
