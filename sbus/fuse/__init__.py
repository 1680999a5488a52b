"""The bus as a filesystem (``sbus mount``): writing a file publishes, reading subscribes.

`mapping` (paths to keys and patterns, the tree of known names) and `framing` (messages
to the bytes a reader sees) are pure; `signals` reads a caller's pending signals;
`operations` is the pyfuse3 shell that ties them to broker connections; `cli` mounts.
See docs/fuse.md for the user-facing mapping.
"""
