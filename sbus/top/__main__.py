"""``python -m sbus.top``: the same as ``sbus-top``."""

import sys

from ..cmd.top import main

sys.exit(main())
