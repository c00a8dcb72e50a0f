"""Where the protocol's state lives: the byte layout of one channel and the status words.

The protocol itself (push, publish, bounded wait, combine, epoch advance) is the kernel in
``kernels/lse_alltoall.py``; this module sizes the memory it runs on and turns the status words the
kernel leaves in host-mapped memory into Python errors.
"""

import ctypes
from dataclasses import dataclass
from functools import cached_property
from typing import Optional

from dcp.constants import (KIND_COMBINE, KIND_GATHER, STATUS_MISMATCH, STATUS_TIMEOUT, STATUS_WORDS, TAG_ABORT,
                         TAG_BASE2, TAG_GAVE_UP, TAG_KIND_SHIFT, TAG_MAX_TOKENS, TAG_NONE, TAG_POISONED)
from dcp.errors import DcpError, DcpMismatchError, DcpTimeoutError

STATE_BYTES = 64  # the epoch word and the poison word, local to the rank
# Warps per program by call size (docs/design.md, section 5.2): a small call takes the fewest warps, so the
# fewest rows per tile, whose tiles the grid covers in one round, spreading its bytes and fences
# over more SMs; 8 where none does; large calls take 16, half as many tile steps per program.
SMALL_CALL_WARPS, LARGE_CALL_WARPS, LARGE_CALL_TOKENS = 8, 16, 128
_FEWER_WARPS = (1, 2, 4)
ALIGN = 256


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _align(x: int, a: int = ALIGN) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class ChannelLayout:
    """The rows of one collective on a channel: their width and tiling (identical on every rank).

    A row is ``head_dim`` values of ``value_words`` 16-bit words each (a combine's D values: fp16 and
    bf16 one word, fp32 two; a query row as raw 16-bit words), then, for the combine, the fp32 LSE
    as two 16-bit lanes, padded to 32 bytes (a query row to 16). Its sizes are
    computed once: the call path reads them on every launch. A call's tiling (warps per program,
    rows per tile) depends on its size, unless ``num_warps`` fixes it, and on ``programs``, the
    grid that every rank of the group keeps resident (the smallest over the ranks, so that every
    rank tiles a call alike). Tile t means different rows under different tilings, which is
    harmless: a flag names its call by epoch and tag.
    """

    world: int
    heads_per_rank: int
    head_dim: int
    max_tokens: int
    num_warps: Optional[int] = None
    programs: int = 1
    lse: bool = True
    value_words: int = 1

    @cached_property
    def padded_dim(self) -> int:  # power-of-two block width over the row's values
        return _next_pow2(self.head_dim)

    @cached_property
    def chunk_words(self) -> int:
        """Width of a tile's column block. A combine row is one block of ``padded_dim`` columns (its
        weights are per row); a query row is ``head_dim / chunk_words`` chunks, the largest power of
        two dividing it up to 64 words, so no column is padding (docs/design.md, section 4)."""
        return min(64, self.head_dim & -self.head_dim) if not self.lse else self.padded_dim

    @cached_property
    def chunks(self) -> int:  # a tile's units per row: 1 for the combine
        return self.head_dim // self.chunk_words if not self.lse else 1

    @cached_property
    def row_elems(self) -> int:
        """16-bit words: the values (+ the fp32 LSE as two lanes). A combine row is padded to 32 bytes:
        each row then starts on a memory sector, which made the push's stores of 1 KiB rows 1.5-2%
        faster than 16 bytes did (docs/design.md, section 5.1); a query row to 16."""
        return _align(self.lse_offset + (2 if self.lse else 0), 16 if self.lse else 8)

    @cached_property
    def lse_offset(self) -> int:  # the 16-bit word where a row's LSE starts
        return self.head_dim * self.value_words

    @cached_property
    def rows_max(self) -> int:
        return self.max_tokens * self.heads_per_rank

    @cached_property
    def padded_peers(self) -> int:  # a tile holds the rows of every peer: a power of two of them
        return _next_pow2(self.world)

    def value_lanes(self, warps: int) -> int:
        """Lanes of a pushed combine tile's values under ``warps``: in 16-warp tilings the other ranks
        only (a rank's own values stay in its input), a power of two of them, which doubles a tile's
        rows at N = 2, 3 and 5 (one H200, B = 512: 0.91-0.94x); else the peer axis itself (in every
        tiling, N = 3, B = 64 took the same rows on half the warps, 1.05-1.07x on one H100;
        docs/design.md, section 5.1)."""
        if self.lse and warps >= LARGE_CALL_WARPS:
            return _next_pow2(self.world - 1)
        return self.padded_peers

    def rows_per_tile(self, warps: int) -> int:
        """Units of a tile under ``warps`` per program (rows of the combine, ``chunk_words``-word
        chunks of the gather): [value lanes, units, columns] blocks of 4 KiB a warp."""
        if not self.lse:  # one [units, columns] block, stored to each peer: at most 2 KiB a warp
            most = 1 << ((64 * self.chunks).bit_length() - 1)  # at most 64 rows, a power of two of units
            return max(1, min(most, 2048 * warps // (max(4, self.padded_peers) * self.chunk_words),
                              _next_pow2(self.rows_max * self.chunks)))
        return max(1, min(64, 2048 * warps // (self.value_lanes(warps) * self.padded_dim * self.value_words),
                          _next_pow2(self.rows_max)))

    def warps_for(self, n_tokens: int) -> int:
        if self.num_warps:
            return self.num_warps
        if n_tokens >= LARGE_CALL_TOKENS:
            return LARGE_CALL_WARPS
        for w in _FEWER_WARPS:
            # (a warp count whose tiles are no smaller than twice as many warps' only thins the threads)
            if self.rows_per_tile(w) < self.rows_per_tile(2 * w) and self.tiles(n_tokens, w) <= self.programs:
                return w
        return SMALL_CALL_WARPS

    def program_warps(self, warps: int) -> int:
        """The warps a program of a tiling runs: a combine tile of one or two warps' rows runs on
        four times as many (the same rows, fewer columns a thread), which shortens a small call's
        chain of per-row work. One H100, graph8, with metadata: B = 1 0.95x (N = 3) and 0.88x
        (N = 6); B = 0 0.96x and 1.05x; the gather's copies 0.96-1.04x, so they keep their warps
        (docs/design.md, section 5.2). A fixed ``num_warps`` is taken as it is."""
        if self.lse and self.num_warps is None and warps < 4:
            return 4 * warps
        return warps

    def one_wait(self, warps: int) -> bool:
        """Whether a tiling's programs publish and wait for one flag each, not one per tile: the
        gather's and the 16-warp combine's, where programs walk many tiles (one H100, B = 512:
        0.93-0.99x). In every tiling, the pushed 8-warp combine at N = 3, B = 64 ran 1.21-1.24x
        slower (docs/design.md, sections 5.1 and 7)."""
        return not self.lse or warps >= LARGE_CALL_WARPS

    def launches_early(self, warps: int) -> bool:
        """Whether a tiling's calls use programmatic dependent launch (where it is on): only the
        small calls' (16-warp calls lost 5.6% with it at N = 6, B = 512 on one H200)."""
        return self.num_warps is not None or warps < LARGE_CALL_WARPS

    @cached_property
    def warps_by_size(self) -> tuple:
        """``warps_for(n)`` of every call size n from 1 to max_tokens (index n - 1)."""
        return tuple(self.warps_for(n) for n in range(1, self.max_tokens + 1))

    @cached_property
    def tilings(self) -> dict:
        """Warps -> rows per tile, for every tiling a call of up to max_tokens may use."""
        return {w: self.rows_per_tile(w) for w in sorted(set(self.warps_by_size))}

    def tiles(self, n_tokens: int, warps: int) -> int:
        """Tiles of a call of ``n_tokens`` under the tiling of ``warps``."""
        return -(-n_tokens * self.heads_per_rank * self.chunks // self.rows_per_tile(warps))

    @cached_property
    def tiles_max(self) -> int:  # the most tiles a launch can have: they size the flags
        return max(self.tiles(n, w) for n, w in enumerate(self.warps_by_size, 1))

    def tile_constexprs(self, warps: int) -> dict:
        """The geometry of one tiling: all that the NCCL path's kernels take."""
        return dict(N=self.world, NP=self.padded_peers, HN=self.heads_per_rank, D=self.head_dim,
                    DP=self.padded_dim, ROW=self.row_elems, LSE_OFF=self.lse_offset,
                    BLOCK_R=self.rows_per_tile(warps))


def channel_layouts(config) -> dict:
    """Kind -> the ChannelLayout of each collective of a ``dcp.config.Config`` (agreed: its grid is
    every rank's). The gather moves query rows as raw 16-bit words: a copy, bit for bit."""
    c = config
    return {KIND_COMBINE: ChannelLayout(c.world, c.heads_per_rank, c.head_dim, c.max_tokens, c.num_warps,
                                        c.programs, value_words=c.dtype.itemsize // 2),
            KIND_GATHER: ChannelLayout(c.world, c.heads_per_rank, c.query_words, c.max_tokens, c.num_warps,
                                       c.programs, lse=False)}


@dataclass(frozen=True)
class ChannelRegion:
    """Byte layout of one channel's symmetric region, shared by the collectives in ``layouts``.

    The two receive slots sit at fixed offsets, each sized for the widest rows: consecutive calls
    alternate slots whatever their kind, and a call may fill its slot while a peer still reads the
    other one. The flags are sized for the most tiles of any launch of any kind.
    """

    layouts: tuple

    @cached_property
    def tiles_max(self) -> int:
        return max(lay.tiles_max for lay in self.layouts)

    @cached_property
    def slot_elems(self) -> int:  # 16-bit elements of one slot: N sources of the widest rows
        lay = self.layouts[0]
        return lay.world * lay.rows_max * max(lay.row_elems for lay in self.layouts)

    @cached_property
    def flag_offset(self) -> int:
        return STATE_BYTES

    @cached_property
    def recv_offset(self) -> int:
        return _align(self.flag_offset + 2 * self.layouts[0].world * self.tiles_max * 8)

    @cached_property
    def nbytes(self) -> int:
        return _align(self.recv_offset + 2 * self.slot_elems * 2)

    def constexprs(self, layout: ChannelLayout, warps: int) -> dict:
        """The fused kernel's geometry for one collective's tiling on this region."""
        return dict(layout.tile_constexprs(warps), CW=layout.chunk_words, CHUNKS=layout.chunks,
                    NV=layout.value_lanes(warps), ROWS_MAX=layout.rows_max, TILES_MAX=self.tiles_max,
                    FLAG_OFF=self.flag_offset, RECV_OFF=self.recv_offset, SLOT=self.slot_elems,
                    GATHER=not layout.lse, ONE_WAIT=layout.one_wait(warps))


def call_tag(kind: int, n_tokens: int, base2: bool = False) -> int:
    """The tag a call's flags carry: its kind, its LSEs' base and its total B (every launch of the
    call alike)."""
    return (kind << TAG_KIND_SHIFT) | (TAG_BASE2 if base2 else 0) | n_tokens


_KINDS = {KIND_COMBINE: "combine", KIND_GATHER: "query all-gather"}


def gave_up_on(tag: int) -> Optional[list]:
    """The ranks a peer's retraction says it timed out waiting for; None: not a retraction."""
    if TAG_GAVE_UP - 255 <= tag <= TAG_GAVE_UP:
        mask = TAG_GAVE_UP - tag
        return [r for r in range(8) if mask >> r & 1]
    return None


def describe_tag(tag: int) -> str:
    """What a rank did in a call, as its flags announced it (after "rank r")."""
    if tag == TAG_ABORT:
        return "rejected its call before launch"
    if tag == TAG_POISONED:
        return "had already failed a call on this channel"
    if tag == TAG_NONE:
        return "sent nothing of this call"
    if gave_up_on(tag) is not None:
        return f"timed out waiting for rank(s) {gave_up_on(tag)}"
    kind = tag >> TAG_KIND_SHIFT
    base = f" (LSE base {2 if tag & TAG_BASE2 else 'e'})" if kind == KIND_COMBINE else ""
    return f"ran a {_KINDS.get(kind, 'unknown call')} of B={tag & TAG_MAX_TOKENS}{base}"


def status_words(address: int) -> "ctypes.Array":
    """The status words of one channel, read in place from the host (the kernel writes them)."""
    return (ctypes.c_int32 * STATUS_WORDS).from_address(address)


POISONED_NOTE = "every later call on this channel raises until the communicator is rebuilt"


def status_error(words: "ctypes.Array", world: int, rank: int, channel: int) -> Optional[DcpError]:
    """The error of the first failed call the kernel recorded on a channel (kept: the channel stays
    poisoned), or None."""
    code = words[0]
    if code == 0:
        return None
    epoch, tile, own = words[1], words[2], words[3]
    announced = {r: words[12 + r] for r in range(world)}
    # Ranks missing here, and those a peer that gave up first was waiting for: every rank names the
    # same culprits for one timed-out call (a late rank names itself).
    missing = sorted({r for r in range(world) if words[4 + r]}.union(
        *(gave_up_on(t) or () for r, t in announced.items() if r != rank)))
    where = f"rank {rank}, channel {channel}, epoch {epoch}, tile {tile}; {POISONED_NOTE}"
    if code == STATUS_TIMEOUT:
        # The kernel reads the flags again to record them, after its wait gave up: a rank that was
        # absent may have announced another call by then (a faster rank's next call, on a channel
        # it skipped). It was not in this call either.
        missing = sorted(set(missing).union(
            r for r, t in announced.items()
            if r != rank and t not in (own, TAG_NONE) and gave_up_on(t) is None))
        return DcpTimeoutError(
            f"DCP all-to-all timed out waiting for rank(s) {missing} ({where}); the rows of that "
            "call that had not arrived were written as NaN", missing)
    if code == STATUS_MISMATCH:
        other = "; ".join(f"rank {r} {describe_tag(t)}" for r, t in announced.items()
                          if r != rank and t != own)
        return DcpMismatchError(
            f"ranks entered the same DCP call differently: this rank {describe_tag(own)}; "
            f"{other} ({where}); its rows were written as NaN", missing)
    return DcpTimeoutError(f"DCP all-to-all failed with status {code} ({where})", missing)
