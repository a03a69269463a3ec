"""``python -m unisleep.compat``: print the line that makes ``import torch_memory_saver`` give
unisleep's facade in the processes a shell starts; ``--pythonpath``: only the shim folder (with
``UNISLEEP_TMS=1``); ``--preload-path``: unisleep's native library, the file to name in
``LD_PRELOAD`` where a launcher sets torch_memory_saver's (preloading it gives the facade)."""


from ..cli import CommandParser, plain
from . import ENV_SWITCH, shim_dir

ap = CommandParser(prog="python -m unisleep.compat", description=plain(__doc__))
ap.add_argument("--pythonpath", action="store_true", help="print the shim folder only")
ap.add_argument("--preload-path", action="store_true", help="print the native library's path")
args = ap.parse_args()
if args.pythonpath:
    print(shim_dir())
elif args.preload_path:
    import sys

    from ..errors import NativeLibraryMissingError
    from .torch_memory_saver import require_native_library

    try:
        print(require_native_library())
    except NativeLibraryMissingError as e:
        print(f"python -m unisleep.compat: {e}", file=sys.stderr)
        sys.exit(1)
else:
    print(f'export {ENV_SWITCH}=1 PYTHONPATH="{shim_dir()}${{PYTHONPATH:+:$PYTHONPATH}}"')
