"""Public alias (the list: :mod:`unisleep`'s docstring): the target of unisleep's vLLM
general-plugin entry point ``unisleep = "unisleep.vllm_plugin:register"`` in pyproject.toml, the
name installed environments record.  The plugin is :mod:`unisleep.vllm_worker.plugin`."""

from .vllm_worker.plugin import *  # noqa: F401,F403
