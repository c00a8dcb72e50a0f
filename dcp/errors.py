"""Exceptions raised by the communicator."""


class DcpError(RuntimeError):
    """A DCP all-to-all call or setup failed; the message says what was expected."""


class DcpTimeoutError(DcpError):
    """A bounded wait ran out: a peer did not publish its part of a call in time."""

    def __init__(self, message: str, missing_ranks: list[int]):
        super().__init__(message)
        self.missing_ranks = missing_ranks


class DcpMismatchError(DcpError):
    """Ranks entered the same call with different token counts (a caller bug)."""
