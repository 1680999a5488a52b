"""sbus: a small, fast publish/subscribe message bus on unix SOCK_SEQPACKET sockets."""

from .client import AsyncClient, Client
from .defaults import default_address
from .errors import ConnectError, ConnectionLost, InvalidRequest, Refused, SbusError
from .protocol import Control, Publish, Subscribe, Unsubscribe
from .session import Dropped

__all__ = ["Client", "AsyncClient", "SbusError", "ConnectError", "ConnectionLost",
           "InvalidRequest", "Refused", "default_address",
           "Publish", "Control", "Dropped", "Subscribe", "Unsubscribe"]


def __getattr__(name: str) -> str:
    """``sbus.__version__``, read from the installed package's metadata when asked."""
    if name == "__version__":
        from .version import version

        return version()
    raise AttributeError(f"module 'sbus' has no attribute {name!r}")
