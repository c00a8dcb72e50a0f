"""DCP all-to-all: the exchange and LSE combine of partial attention outputs across a DCP group."""

from dcp.comm import DcpAllToAll
from dcp.errors import DcpError, DcpMismatchError, DcpPeerLostError, DcpTimeoutError

__all__ = ["DcpAllToAll", "DcpError", "DcpMismatchError", "DcpPeerLostError", "DcpTimeoutError"]
