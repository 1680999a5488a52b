"""sbus: a small, fast publish/subscribe message bus on unix SOCK_SEQPACKET sockets."""

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from .client import AsyncClient, Client
    from .defaults import default_address
    from .errors import ConnectError, ConnectionLost, InvalidRequest, Refused, SbusError
    from .protocol import Control, Publish, Subscribe, Unsubscribe
    from .session import Dropped

#: Where each public name lives.  Imported when first used (PEP 562): the broker's own
#: start-up (`sbus serve`, e.g. the successor during a restart) needs none of the client
#: side, whose imports (anyio among them) would add ~50 ms to the gap its clients see.
_EXPORTS = {
    "Client": "client", "AsyncClient": "client", "default_address": "defaults",
    "SbusError": "errors", "ConnectError": "errors", "ConnectionLost": "errors",
    "InvalidRequest": "errors", "Refused": "errors", "Publish": "protocol",
    "Control": "protocol", "Subscribe": "protocol", "Unsubscribe": "protocol",
    "Dropped": "session",
}

__all__ = ["Client", "AsyncClient", "SbusError", "ConnectError", "ConnectionLost",
           "InvalidRequest", "Refused", "default_address",
           "Publish", "Control", "Dropped", "Subscribe", "Unsubscribe"]


def __getattr__(name: str) -> object:
    """The public names, and ``sbus.__version__`` read from the installed package's
    metadata, each looked up when asked."""
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    if name == "__version__":
        from .version import version

        return version()
    raise AttributeError(f"module 'sbus' has no attribute {name!r}")
