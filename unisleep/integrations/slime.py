"""slime (THUDM/slime) on unisleep's torch_memory_saver facade.

slime offloads its Megatron trainer with torch_memory_saver: its driver finds the preload library
next to ``torch_memory_saver.__file__`` and starts each train actor with ``LD_PRELOAD`` of it,
``TMS_INIT_ENABLE=1`` and ``TMS_INIT_ENABLE_CPU_BACKUP=1`` (slime/ray/actor_group.py); the actor
calls ``pause()``/``resume()`` and runs its weight sync in ``disable()``; its DeepEP patch turns
the interesting region off through ``torch_memory_saver._impl._binary_wrapper.cdll``.  All of
that works unchanged once the *driver* process imports the facade as ``torch_memory_saver``: the
library it then finds is unisleep's, and preloading it gives each actor the facade with
whole-process capture.  This module only says how to start the driver.
"""

from __future__ import annotations

from ..compat import ENV_SWITCH, shim_dir

__all__ = ["driver_env", "export_line"]


def driver_env(pythonpath: str = "") -> dict[str, str]:
    """The two variables to start slime's driver (``python train.py ...``) with, so its
    ``import torch_memory_saver`` is unisleep's facade.  ``pythonpath``: the current
    ``PYTHONPATH``, kept after the shim folder.  Raises
    :class:`~unisleep.errors.NativeLibraryMissingError` when unisleep was installed without the
    preload library slime's train actors load."""
    from ..compat.torch_memory_saver import require_native_library

    require_native_library()
    return {ENV_SWITCH: "1", "PYTHONPATH": shim_dir() + (":" + pythonpath if pythonpath else "")}


def export_line() -> str:
    """The shell line for the same (``python -m unisleep.compat`` prints it too)."""
    return f'export {ENV_SWITCH}=1 PYTHONPATH="{shim_dir()}${{PYTHONPATH:+:$PYTHONPATH}}"'
