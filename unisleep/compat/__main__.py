"""``python -m unisleep.compat --pythonpath``: print the shim folder to put first on PYTHONPATH
(with ``UNISLEEP_TMS=1``) so ``import torch_memory_saver`` gives unisleep's facade."""

import argparse

from . import ENV_SWITCH, shim_dir

ap = argparse.ArgumentParser(prog="python -m unisleep.compat", description=__doc__)
ap.add_argument("--pythonpath", action="store_true", help="print the shim folder only")
args = ap.parse_args()
if args.pythonpath:
    print(shim_dir())
else:
    print(f'export {ENV_SWITCH}=1 PYTHONPATH="{shim_dir()}${{PYTHONPATH:+:$PYTHONPATH}}"')
