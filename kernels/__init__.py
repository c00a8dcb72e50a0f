"""Triton kernels of the packed DCP all-to-all. Kernels only: no process groups, no allocation.
Their numbers (tags, status words, control words) live in ``dcp.constants``, re-exported here."""

from dcp.constants import (CTL_STATUS, CTL_TIMEOUT, CTL_TRACE, CTL_WORDS, EPOCH_PERIOD, EPOCH_STRIDE, KIND_COMBINE,
                           KIND_GATHER, MAX_PEERS, STATUS_MISMATCH, STATUS_TIMEOUT, STATUS_WORDS, TAG_ABORT, TAG_BASE2,
                           TAG_GAVE_UP, TAG_KIND_SHIFT, TAG_LOAD, TAG_MAX_TOKENS, TAG_NONE, TAG_POISONED, TRACE_CALLS,
                           TRACE_PROGRAMS, TRACE_WORDS)

from .lse_alltoall import build_kernels

__all__ = ["CTL_STATUS", "CTL_TIMEOUT", "CTL_TRACE", "CTL_WORDS", "EPOCH_PERIOD", "EPOCH_STRIDE", "KIND_COMBINE",
           "KIND_GATHER", "MAX_PEERS", "STATUS_MISMATCH", "STATUS_TIMEOUT", "STATUS_WORDS", "TAG_ABORT", "TAG_BASE2",
           "TAG_GAVE_UP", "TAG_KIND_SHIFT", "TAG_LOAD", "TAG_MAX_TOKENS", "TAG_NONE", "TAG_POISONED", "TRACE_CALLS",
           "TRACE_PROGRAMS", "TRACE_WORDS", "build_kernels"]
