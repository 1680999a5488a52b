"""``sbus-top`` / ``sbus top``: a live traffic monitor for the bus, like ``htop`` for messages.

The package is split by what each part may touch: `model` (pure counting),
`controls` (pure key handling), `view` (pure drawing with rich), `reader` (the bus),
`terminal` (the tty) and `app` (the trio tasks that tie them together).  The command
line is sbus/cmd/top.py.
"""
