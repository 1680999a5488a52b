"""sbus: a small, fast publish/subscribe message bus on unix SOCK_SEQPACKET sockets."""

__version__ = "0.1.0"  # the one place: pyproject.toml and tools/build-deb.sh read it

from .client import AsyncClient, Client, ConnectError, SbusError, default_address
from .protocol import Control, Publish, Subscribe, Unsubscribe

__all__ = ["Client", "AsyncClient", "SbusError", "ConnectError", "default_address",
           "Publish", "Control", "Subscribe", "Unsubscribe"]
