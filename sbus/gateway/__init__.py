"""The network gateway: remote clients publish and subscribe on the bus over TCP or TLS.

`codec` is the wire protocol (pure); `server` the trio service behind
``sbus gateway``; `client` the remote client library (`Client` for trio,
`BlockingClient` for threads).
"""

from .client import BlockingClient, Client, Message

__all__ = ["Client", "BlockingClient", "Message"]
