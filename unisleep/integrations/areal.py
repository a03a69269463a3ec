"""AReaL (inclusionAI/AReaL, areal==1.0.4) on unisleep's torch_memory_saver facade.

AReaL's ``areal.utils.offload.get_tms_env_vars()`` checks that
``torch_memory_saver_hook_mode_preload.abi3.so`` exists next to ``torch_memory_saver.__file__``
and gives its schedulers ``LD_PRELOAD`` of it with ``TMS_INIT_ENABLE=1`` and
``TMS_INIT_ENABLE_CPU_BACKUP=1``; its engines set ``hook_mode = "preload"`` and call
``pause()``/``resume()`` without any ``region()``.  With the facade as ``torch_memory_saver`` in
the launcher, that file is unisleep's library, each worker gets the facade by preloading it, and
whole-process capture makes ``pause()`` free the worker's model, optimizer state and cache.
AReaL's SGLang servers (``launch_server_cmd`` in ``areal/infra/launcher/sglang_server.py``,
``SGLangBackend.launch_server``) start with ``os.environ.copy()`` and no tms variables of their
own, so they get the facade exactly when the launcher has it (``install()`` or the two variables);
SGLang's ``TorchMemorySaverAdapter`` there then runs on the facade.
"""

from __future__ import annotations

from ..compat import install as _install

__all__ = ["tms_env_vars", "install"]


def install() -> None:
    """Make ``import torch_memory_saver`` give unisleep's facade in this process and in the
    processes it starts (call it first in AReaL's launcher script)."""
    _install()


def tms_env_vars() -> dict[str, str]:
    """What AReaL's own ``get_tms_env_vars()`` returns under the facade (its function, called);
    :class:`~unisleep.errors.NativeLibraryMissingError` first when unisleep was installed without
    the preload library AReaL's workers load."""
    from ..compat.torch_memory_saver import require_native_library

    require_native_library()
    _install()
    from areal.utils.offload import get_tms_env_vars  # AReaL, imported only here

    return get_tms_env_vars()
