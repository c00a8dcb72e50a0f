"""DCP all-to-all: the exchange and LSE combine of partial attention outputs across a DCP group."""

import os

__version__ = "0.1.0"

# The wheel installs the checkout's kernels/ and bench/ as dcp/kernels and dcp/bench (pyproject's
# package-dir). Run from the checkout itself (PYTHONPATH=., python -m bench), dcp also looks in the
# repository root, so that dcp.kernels and dcp.bench import those same folders.
_here = os.path.dirname(os.path.abspath(__file__))
_root = os.path.dirname(_here)
if os.path.isdir(os.path.join(_root, "kernels")) and not os.path.isdir(os.path.join(_here, "kernels")):
    __path__.append(_root)

from dcp.errors import DcpError, DcpMismatchError, DcpPeerLostError, DcpTimeoutError  # noqa: E402


def __getattr__(name: str):
    """``DcpAllToAll`` on first use: ``import dcp.plan`` (or the doctor) need not load Triton."""
    if name == "DcpAllToAll":
        from dcp.comm import DcpAllToAll

        return DcpAllToAll
    raise AttributeError(f"module 'dcp' has no attribute {name!r}")

__all__ = ["DcpAllToAll", "DcpError", "DcpMismatchError", "DcpPeerLostError", "DcpTimeoutError"]
