"""Triton kernels of the packed DCP all-to-all. Kernels only: no process groups, no allocation."""

from kernels.lse_alltoall import (CTL_STATUS, CTL_TIMEOUT, CTL_WORDS, EPOCH_PERIOD, STATUS_MISMATCH,
                                  STATUS_TIMEOUT, STATUS_WORDS, MAX_PEERS, build_kernels)

__all__ = ["CTL_STATUS", "CTL_TIMEOUT", "CTL_WORDS", "EPOCH_PERIOD", "STATUS_MISMATCH", "STATUS_TIMEOUT",
           "STATUS_WORDS", "MAX_PEERS", "build_kernels"]
