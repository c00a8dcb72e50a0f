"""Triton kernels of the packed DCP all-to-all. Kernels only: no process groups, no allocation."""

from kernels.lse_alltoall import (CTL_STATUS, CTL_TIMEOUT, CTL_TRACE, CTL_WORDS, EPOCH_PERIOD, EPOCH_STRIDE, MAX_PEERS,
                                  STATUS_MISMATCH, STATUS_TIMEOUT, STATUS_WORDS, TRACE_CALLS,
                                  TRACE_PROGRAMS, TRACE_WORDS, build_kernels)

__all__ = ["CTL_STATUS", "CTL_TIMEOUT", "CTL_TRACE", "CTL_WORDS", "EPOCH_PERIOD", "EPOCH_STRIDE", "MAX_PEERS",
           "STATUS_MISMATCH", "STATUS_TIMEOUT", "STATUS_WORDS", "TRACE_CALLS", "TRACE_PROGRAMS",
           "TRACE_WORDS", "build_kernels"]
