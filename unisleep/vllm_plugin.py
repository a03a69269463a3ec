"""A thin alias, kept for the vLLM general-plugin entry point ``unisleep.vllm_plugin:register``
that users and older installs may name (and for code importing it): the plugin is
:mod:`unisleep.vllm_worker.plugin`, which pyproject.toml's entry point names now."""

from .vllm_worker.plugin import *  # noqa: F401,F403
