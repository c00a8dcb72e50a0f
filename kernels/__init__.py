"""Triton kernels of the packed DCP all-to-all. Kernels only: no process groups, no allocation."""

from kernels.lse_alltoall import (CTL_STATUS, CTL_TIMEOUT, CTL_WORDS, EPOCH_PERIOD, STATUS_MISMATCH,
                                  STATUS_TIMEOUT, STATUS_WORDS, build_lse_alltoall)

__all__ = ["CTL_STATUS", "CTL_TIMEOUT", "CTL_WORDS", "EPOCH_PERIOD", "STATUS_MISMATCH", "STATUS_TIMEOUT",
           "STATUS_WORDS", "build_lse_alltoall"]
