"""The protocol's numbers, shared by the kernels and the host: the epoch's encoding, the status
words, the call tags, the control words and the trace. Plain Python: importing it loads no Triton,
so the host's planning and decoding modules (``dcp.protocol``, ``dcp.plan``) load without it."""

# The layout of what ranks exchange (rows, slots, flags, tags): the ranks of a group must all run
# the same one, which construction checks. Raised with every change to it (a test fingerprints the
# layout of each revision); 2: combine rows padded to 32 bytes, not 16; 3: 16-warp combine tiles of the
# other ranks' values only (twice the rows at N = 2, 3 and 5); 4: one flag per program and
# destination in the gather's and the 16-warp combine's tilings.
WIRE_REVISION = 4

# The epoch kept on the device runs over [0, EPOCH_PERIOD); a call uses e = epoch + 1, in
# [1, EPOCH_PERIOD]. The period is even so that the slot parity e & 1 alternates across the wrap,
# and e is never 0, the value of flags that were never written. The state word holds
# epoch * EPOCH_STRIDE as a wrapping uint32: each call's programs add EPOCH_STRIDE together.
EPOCH_SHIFT = 8
EPOCH_STRIDE = 1 << EPOCH_SHIFT  # also the most programs a call may have
EPOCH_PERIOD = 1 << (32 - EPOCH_SHIFT)

# Status words, host-readable, the first failure of a channel (kept: the channel is poisoned from
# then on): [0] code, [1] epoch, [2] tile, [3] own call tag, [4 + src] missing flag per source,
# [12 + src] the tag announced by that source (TAG_NONE: nothing of this call arrived from it).
STATUS_WORDS = 20
STATUS_TIMEOUT = 1
STATUS_MISMATCH = 2
MAX_PEERS = 8

# A flag names its call: the epoch, and above it the call's tag. A call's tag is its kind, the base
# of its LSEs (a combine's ranks must agree on it) and its total token count B (not the launch's: a
# call above max_tokens runs in several launches), so that ranks pair only launches of one call.
# Negative tags announce a call that moves no data:
# ABORT, the rank rejected its call before launch; POISONED, its channel failed earlier. LOAD is
# the constructor's launch that only loads a variant and touches nothing.
TAG_KIND_SHIFT = 28
TAG_BASE2 = 1 << 27
TAG_MAX_TOKENS = TAG_BASE2 - 1
KIND_COMBINE = 0
KIND_GATHER = 1
TAG_ABORT = -1
TAG_POISONED = -2
TAG_NONE = -3
TAG_LOAD = -4
# A rank whose wait for this call timed out retracts its flags with TAG_GAVE_UP - mask, mask the
# sources it was missing (bit s: rank s): its peers then fail the call as a timeout naming those
# ranks, as it does, instead of as a mismatch with it.
TAG_GAVE_UP = -16

# A combine's empty-token mask (vLLM's metadata, searched once per step; ``DcpAllToAll.lse_reduce``'s
# ``step``): not used, searched and written, or read instead of searching.
MASK_NONE = 0
MASK_WRITE = 1
MASK_READ = 2

CTL_STATUS = 8  # ctl[0:N] peer channel bases, ctl[8] status address, ctl[9] timeout (ns),
CTL_TIMEOUT = 9  # ctl[10] trace address (0 unless tracing)
CTL_TRACE = 10
CTL_WORDS = 11

# The opt-in trace (constexpr TRACE): per call (ring of TRACE_CALLS, indexed by epoch) and program,
# int64 [epoch, start, published, every tile arrived, combined] in %globaltimer ns.
TRACE_CALLS = 512
TRACE_PROGRAMS = EPOCH_STRIDE
TRACE_WORDS = 5
