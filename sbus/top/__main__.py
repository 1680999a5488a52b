"""``python -m sbus.top``: the same as ``sbus-top``."""

import sys

from . import main

sys.exit(main())
