"""sbus: a small, fast publish/subscribe message bus on unix SOCK_SEQPACKET sockets."""

from .client import AsyncClient, Client
from .defaults import default_address
from .errors import ConnectError, ConnectionLost, InvalidRequest, Refused, SbusError
from .protocol import Control, Publish, Subscribe, Unsubscribe
from .session import Dropped

__all__ = ["Client", "AsyncClient", "SbusError", "ConnectError", "ConnectionLost",
           "InvalidRequest", "Refused", "default_address",
           "Publish", "Control", "Dropped", "Subscribe", "Unsubscribe"]
