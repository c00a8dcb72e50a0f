"""Exceptions raised by the communicator."""


class DcpError(RuntimeError):
    """A DCP all-to-all call or setup failed; the message says what was expected."""


class DcpTimeoutError(DcpError):
    """A bounded wait ran out: a peer did not publish its part of a call in time."""

    def __init__(self, message: str, missing_ranks: list[int]):
        super().__init__(message)
        self.missing_ranks = missing_ranks


class DcpMismatchError(DcpError):
    """Ranks entered the same call differently: other token counts, or a rank that rejected its
    call or had failed an earlier one. ``missing_ranks``: those that sent nothing of the call."""

    def __init__(self, message: str, missing_ranks: list[int] = ()):
        super().__init__(message)
        self.missing_ranks = list(missing_ranks)


class DcpPeerLostError(DcpError):
    """A collective step of setup failed because a peer died or left the group."""
