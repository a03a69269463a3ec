"""Import shim: ``import torch_memory_saver`` in a process that has this folder's parent on its
path (``unisleep.compat.install()`` or ``configure_subprocess()`` put it first on ``sys.path`` and
``PYTHONPATH``, so child processes inherit it without ``LD_PRELOAD``, ``.pth`` files or
``sitecustomize``).

With ``UNISLEEP_TMS=1`` (or true/yes/on) it becomes unisleep's facade
(``unisleep.compat.torch_memory_saver``); otherwise it steps aside and loads the real
torch_memory_saver from the rest of the path, so the folder alone changes nothing.
"""

import os as _os
import sys as _sys

if _os.environ.get("UNISLEEP_TMS", "").strip().lower() in ("1", "true", "yes", "on"):
    from unisleep.compat import torch_memory_saver as _facade

    _sys.modules[__name__] = _facade  # the import statement returns what sys.modules holds
else:
    import importlib.machinery as _machinery
    import importlib.util as _util

    _here = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _rest = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]
    _spec = _machinery.PathFinder.find_spec(__name__, _rest)
    if _spec is None:
        raise ImportError(
            "No module named 'torch_memory_saver' beside unisleep's shim: set UNISLEEP_TMS=1 to get unisleep's "
            "facade, or install torch_memory_saver",
            name=__name__,
        )
    _real = _util.module_from_spec(_spec)
    _sys.modules[__name__] = _real
    _spec.loader.exec_module(_real)
