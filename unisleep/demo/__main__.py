"""``python -m unisleep.demo``: the same as ``unisleep demo``."""

import sys

from . import main

sys.exit(main())
