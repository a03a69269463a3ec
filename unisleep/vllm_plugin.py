"""Public alias (the list: :mod:`unisleep`'s docstring) of :mod:`unisleep.vllm_worker.plugin`, for
environments installed from unisleep 0.1.0 sources before 2026-12-03: their entry-point metadata
records vLLM's general plugin as ``unisleep = "unisleep.vllm_plugin:register"`` until unisleep is
installed again.  pyproject.toml's entry point names the plugin itself."""

from .vllm_worker.plugin import *  # noqa: F401,F403
