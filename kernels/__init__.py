"""Triton kernels of the packed DCP all-to-all. Kernels only: no process groups, no allocation.
Their numbers (tags, status words, control words) are ``dcp.constants``."""

from .lse_alltoall import build_kernels

__all__ = ["build_kernels"]
