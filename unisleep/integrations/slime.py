"""slime (THUDM/slime) on unisleep's torch_memory_saver facade.

slime offloads its Megatron trainer with torch_memory_saver: its driver finds the preload library
next to ``torch_memory_saver.__file__`` and starts each train actor with ``LD_PRELOAD`` of it,
``TMS_INIT_ENABLE=1`` and ``TMS_INIT_ENABLE_CPU_BACKUP=1`` (slime/ray/actor_group.py); the actor
calls ``pause()``/``resume()`` and runs its weight sync in ``disable()``; its DeepEP patch turns
the interesting region off through ``torch_memory_saver._impl._binary_wrapper.cdll``.  Its SGLang
rollout engines are Ray actors (``SGLangEngine``) that start SGLang's server with
multiprocessing's *spawn*; SGLang's ``TorchMemorySaverAdapter`` imports ``torch_memory_saver``.

All of that works unchanged once the *driver* process and the SGLang actors import the facade as
``torch_memory_saver``.  slime's scripts start the driver, ``train.py``, with
``ray job submit --runtime-env-json="${RUNTIME_ENV_JSON}"``: the job's ``env_vars`` are the
driver's environment and every actor of the job inherits them (an actor's own ``env_vars`` —
slime gives its train and SGLang actors some — are merged key by key over the job's), while an
``export`` in the submitting shell reaches neither.  So the two variables go into that JSON
(:func:`runtime_env_json`); the train actors then get the facade twice over — from the job's
variables and from the preload library slime now finds, which is unisleep's.
"""

from __future__ import annotations

import json
import sys

from ..compat import ENV_SWITCH, shim_dir
from ..errors import InvalidArgumentError

__all__ = ["driver_env", "export_line", "runtime_env_json"]

#: Ray expands ``${NAME}`` in a runtime env's ``env_vars`` from the environment the worker or
#: driver would have had (``ray._private.utils.update_envs``; an unset name becomes empty)
_INHERITED_PYTHONPATH = "${PYTHONPATH}"


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
    """The shell line for the same, for a driver started from this shell (``python train.py``
    without ``ray job submit``; ``python -m unisleep.compat`` prints it too)."""
    return f'export {ENV_SWITCH}=1 PYTHONPATH="{shim_dir()}${{PYTHONPATH:+:$PYTHONPATH}}"'


def runtime_env_json(runtime_env: str = "") -> str:
    """slime's ``RUNTIME_ENV_JSON`` (the ``--runtime-env-json`` of its ``ray job submit``) with
    ``UNISLEEP_TMS=1`` and the shim folder first on ``PYTHONPATH`` in its ``env_vars``; every
    other key and variable is kept as given.  A ``PYTHONPATH`` already there (slime's scripts
    give their Megatron-LM checkout) follows the shim folder; without one, ``${PYTHONPATH}`` does,
    which Ray expands to the path the job would have had.  Given twice, the shim folder is not
    added twice.  ``runtime_env``: the JSON text (empty: none).  Raises
    :class:`~unisleep.errors.InvalidArgumentError` for text that is not a JSON object whose
    ``env_vars`` (if any) is an object of strings, before anything is written."""
    try:
        env = json.loads(runtime_env) if runtime_env.strip() else {}
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(f"RUNTIME_ENV_JSON is not JSON ({e}); give Ray's runtime env as a JSON object, "
                                   "e.g. '{\"env_vars\": {...}}'") from None
    if not isinstance(env, dict):
        raise InvalidArgumentError(f"RUNTIME_ENV_JSON must be a JSON object (Ray's runtime env), got {type(env).__name__}")
    env_vars = env.get("env_vars", {})
    if not isinstance(env_vars, dict) or not all(isinstance(v, str) for v in env_vars.values()):
        raise InvalidArgumentError("RUNTIME_ENV_JSON's \"env_vars\" must map names to strings (Ray refuses anything "
                                   "else); fix that entry first")
    shim = shim_dir()
    rest = [p for p in env_vars.get("PYTHONPATH", _INHERITED_PYTHONPATH).split(":") if p and p != shim]
    env["env_vars"] = {**env_vars, ENV_SWITCH: "1", "PYTHONPATH": ":".join([shim, *rest])}
    return json.dumps(env, indent=2)


def main(argv: list[str] | None = None) -> int:
    """``python -m unisleep.integrations.slime [RUNTIME_ENV_JSON]``: prints
    :func:`runtime_env_json` of the argument (or of standard input with ``-``)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or args[:1] in (["-h"], ["--help"]):
        print("usage: python -m unisleep.integrations.slime [RUNTIME_ENV_JSON | -]\n"
              "prints slime's RUNTIME_ENV_JSON with UNISLEEP_TMS=1 and unisleep's shim folder first on PYTHONPATH:\n"
              '  RUNTIME_ENV_JSON="$(python -m unisleep.integrations.slime "$RUNTIME_ENV_JSON")"',
              file=sys.stderr if len(args) > 1 else sys.stdout)
        return 2 if len(args) > 1 else 0
    text = sys.stdin.read() if args == ["-"] else (args[0] if args else "")
    try:
        print(runtime_env_json(text))
    except InvalidArgumentError as e:
        print(f"unisleep.integrations.slime: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
