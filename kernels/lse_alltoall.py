"""The DCP all-to-all kernels: the fused push kernel, and the pack / combine pair of the NCCL path.

Fused (``lse_alltoall_kernel``, one launch per call). Every rank runs the same grid. Program ``p``
owns the row tiles ``p, p + G, ...`` (a row is one (token, head) pair of the flattened
``[B * H/N]`` space of a head chunk; a tile holds those rows for every peer) on every rank. It packs
its tiles straight into every destination's receive slot (its own chunk's LSEs only: the combine
reads those values from the input), fences once and publishes one flag per tile and destination;
then it waits for the same tiles from every source, fences once and combines them. A waiting
program only depends on programs with the same index on other ranks, so the protocol needs no
ordering between programs of one rank. In the tilings of ``ONE_WAIT`` (large combines, every
gather) a program publishes one flag per destination instead, at its own index, and waits once:
a source's program ``p`` pushed all of program ``p``'s tiles before its one fence (every rank runs
the agreed grid and the call's tiling), so that flag covers them all.

Memory of one channel on one rank (byte offsets are constexprs computed by ``dcp.protocol``)::

    state  [epoch * EPOCH_STRIDE uint32, poisoned int32]          local only
    flags  [2 slots][N sources][tiles] int64: call tag << 32 | epoch
    recv   [2 slots of SLOT int16][N sources][B_max * H/N rows][ROW int16]
           combine row: D values (fp32: two words each), fp32 LSE, padding;
           gather row: the query row's 16-bit words

NCCL path (``pack_kernel``, ``all_to_all_single``, ``combine_kernel``): the same packed rows in a
``[N, B, H/N, ROW]`` send buffer, and the same combine over the received one.

``clock_kernel``: one timestamp, for the benchmark's per-step times.

The same Python source is built twice: compiled for CUDA, where publishing and polling are relaxed
stores and loads ordered by ``fence.acq_rel`` (at GPU scope when every rank runs on one GPU, else at
system scope: ``GPU_SCOPE``) and time comes from ``%globaltimer``;
and under Triton's interpreter for CPU tensors, where the same helpers are host atomics, a
monotonic clock and a sleep(0) per poll, so that rank processes sharing few cores, and the other
threads of a rank's process, keep progressing.
"""

import time
import types

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dcp.constants import (CTL_STATUS, CTL_TIMEOUT, CTL_TRACE, EPOCH_SHIFT, EPOCH_STRIDE, MASK_READ, MASK_WRITE,
                           STATUS_MISMATCH,
                           STATUS_TIMEOUT, TAG_GAVE_UP, TAG_LOAD, TAG_NONE, TAG_POISONED, TRACE_CALLS, TRACE_PROGRAMS,
                           TRACE_WORDS)

# The same values as constexprs, for use inside the kernels.
_SHIFT = tl.constexpr(EPOCH_SHIFT)
_STRIDE = tl.constexpr(EPOCH_STRIDE)
_TIMEOUT = tl.constexpr(STATUS_TIMEOUT)
_MISMATCH = tl.constexpr(STATUS_MISMATCH)
_CTL_STATUS = tl.constexpr(CTL_STATUS)
_CTL_TIMEOUT = tl.constexpr(CTL_TIMEOUT)
_CTL_TRACE = tl.constexpr(CTL_TRACE)
_TRACE_CALLS = tl.constexpr(TRACE_CALLS)
_TRACE_PROGRAMS = tl.constexpr(TRACE_PROGRAMS)
_TRACE_WORDS = tl.constexpr(TRACE_WORDS)
_MISMATCH_AFTER_NS = tl.constexpr(20_000)
_TAG_POISONED = tl.constexpr(TAG_POISONED)
_TAG_NONE = tl.constexpr(TAG_NONE)
_TAG_LOAD = tl.constexpr(TAG_LOAD)
_TAG_GAVE_UP = tl.constexpr(TAG_GAVE_UP)
_MASK_WRITE = tl.constexpr(MASK_WRITE)
_MASK_READ = tl.constexpr(MASK_READ)


# --- shared by both paths ------------------------------------------------------------------------
# A tile is BLOCK_R rows of the flattened [B * HN] (token, head) space of one head chunk, taken for
# every peer at once: a push moves the values as a [NV, BLOCK_R, DP] block in one load and one
# store, so it costs one memory round trip however many peers there are. The fused kernel never
# pushes its own chunk's values: its value lanes are either the peer axis with its own lane masked
# (NV = NP, N rounded up to a power of two) or, in 16-warp tilings where N - 1 rounds to fewer
# lanes, the other ranks only (lane j: rank + 1 + j mod N; dcp.protocol.ChannelLayout.value_lanes).
# The LSEs go to every peer, [NP, BLOCK_R]. Padding lanes are masked off. A combine reads the sources'
# [BLOCK_R, DP] blocks one by one, but nothing orders those loads, so they are in flight together.

_WAYS = tl.constexpr(8)  # entries of query_start_loc a metadata search step compares at once


def _tile_rows(t, n_rows, HN: tl.constexpr, BLOCK_R: tl.constexpr):
    """Tile t: its rows, their mask, token and head within the chunk."""
    rows = t * BLOCK_R + tl.arange(0, BLOCK_R)
    return rows, rows < n_rows, (rows // HN).to(tl.int64), rows % HN


def _search_start(qsl, num_seqs, s_qsl):
    """The part of the metadata search every row shares, read once per program before its push:
    the search's first step (the largest power of _WAYS <= num_seqs, and the entries of
    ``query_start_loc`` it compares: their loads are the same for every row) and the end of the
    batch (``query_start_loc[num_seqs]``). Without metadata nothing is read."""
    ok = num_seqs >= 0
    top = num_seqs * 0 + 1
    while top * _WAYS <= num_seqs:
        top *= _WAYS
    h1 = tl.load(qsl + (1 * top).to(tl.int64) * s_qsl, mask=ok & (1 * top <= num_seqs), other=0x7FFFFFFF)
    h2 = tl.load(qsl + (2 * top).to(tl.int64) * s_qsl, mask=ok & (2 * top <= num_seqs), other=0x7FFFFFFF)
    h3 = tl.load(qsl + (3 * top).to(tl.int64) * s_qsl, mask=ok & (3 * top <= num_seqs), other=0x7FFFFFFF)
    h4 = tl.load(qsl + (4 * top).to(tl.int64) * s_qsl, mask=ok & (4 * top <= num_seqs), other=0x7FFFFFFF)
    h5 = tl.load(qsl + (5 * top).to(tl.int64) * s_qsl, mask=ok & (5 * top <= num_seqs), other=0x7FFFFFFF)
    h6 = tl.load(qsl + (6 * top).to(tl.int64) * s_qsl, mask=ok & (6 * top <= num_seqs), other=0x7FFFFFFF)
    h7 = tl.load(qsl + (7 * top).to(tl.int64) * s_qsl, mask=ok & (7 * top <= num_seqs), other=0x7FFFFFFF)
    end = tl.load(qsl + tl.maximum(num_seqs, 0).to(tl.int64) * s_qsl, mask=ok, other=0)
    return top, h1, h2, h3, h4, h5, h6, h7, end


def _empty_rows(tok, rmask, tok0, seq_lens, qsl, num_seqs, s_sl, s_qsl, top, h1, h2, h3, h4, h5, h6, h7, end,
                BLOCK_R: tl.constexpr):
    """The rows vLLM's batch metadata gives no weight: tokens past ``query_start_loc[num_seqs]``
    (graph padding) and tokens of a sequence whose local ``seq_lens`` entry is 0. Token b belongs to
    sequence ``#{i in 1..num_seqs : query_start_loc[i] <= b}``, clamped to the last one.

    That count is a search of the non-decreasing ``query_start_loc``, lane by lane and _WAYS-ary:
    its first step compares the entries ``_search_start`` read (``h1..h7``, ``top`` apart); each
    further step loads _WAYS - 1 entries at once (independent loads of a few cached words), so a row
    waits for log_WAYS(num_seqs) - 1 load round trips, and there is no reduction and no barrier.
    Eight ways measured best (design, section 8: against counting every sequence in blocks of 64,
    a binary search, and sixteen ways); reading the first step once per program, not per row, took
    N = 3, B = 64 with metadata from 13.6 to 11.3 us on one H100 (design, section 8)."""
    b = tok + tok0
    n = ((h1 <= b).to(tl.int32) + (h2 <= b).to(tl.int32) + (h3 <= b).to(tl.int32) + (h4 <= b).to(tl.int32)
         + (h5 <= b).to(tl.int32) + (h6 <= b).to(tl.int32) + (h7 <= b).to(tl.int32))
    seq = n * top
    step = top // _WAYS
    while step > 0:  # every index up to seq counts, seq + _WAYS * step does not (or is past num_seqs)
        n = tl.full([BLOCK_R], 0, tl.int32)
        for k in tl.static_range(1, _WAYS):
            i = seq + k * step
            v = tl.load(qsl + i.to(tl.int64) * s_qsl, mask=rmask & (i <= num_seqs), other=0x7FFFFFFF)
            n += (v <= b).to(tl.int32)
        seq += n * step
        step = step // _WAYS
    seq = tl.minimum(seq, num_seqs - 1)
    local = tl.load(seq_lens + seq.to(tl.int64) * s_sl, mask=rmask & (seq >= 0), other=0)
    return (b >= end) | (local == 0)


def _load_tile(po, lse, t, n_rows, peer, vpeer, vok, c_off, cmask, s_po_b, s_po_h, s_lse_b, s_lse_h, tmask, tok0,
               mask_mode, N: tl.constexpr, HN: tl.constexpr, BLOCK_R: tl.constexpr):
    """Tile t of the input: values [NV, BLOCK_R, DP] of the head chunks ``vpeer`` (where ``vok``)
    and fp32 LSEs [NP, BLOCK_R] of every peer's chunk (masked off past the last row and for padding
    lanes); and
    where ``mask_mode`` is _MASK_READ, its rows' tokens' bytes of the empty-token mask ``tmask``
    (nonzero: empty), loaded with the values, one tile ahead of their use."""
    rows, rmask, tok, hh = _tile_rows(t, n_rows, HN, BLOCK_R)
    m2 = (peer < N)[:, None] & rmask[None, :]
    vhead = vpeer[:, None] * HN + hh[None, :]
    vals = tl.load(po + tok[None, :, None] * s_po_b + vhead[:, :, None] * s_po_h + c_off[None, None, :],
                   mask=(vok[:, None] & rmask[None, :])[:, :, None] & cmask[None, None, :])
    lv = tl.load(lse + tok[None, :] * s_lse_b + (peer[:, None] * HN + hh[None, :]) * s_lse_h, mask=m2).to(tl.float32)
    gone = tl.load(tmask + (tok + tok0), mask=rmask & (mask_mode == _MASK_READ), other=0)
    return vals, lv, gone


def _store_tile(dst16, vdst16, t, vals, lv, gone, n_rows, peer, vok, c_off, cmask, tok0, seq_lens, qsl, num_seqs, s_sl,
                s_qsl, tmask, mask_mode, top, h1, h2, h3, h4, h5, h6, h7, end,
                N: tl.constexpr, HN: tl.constexpr, BLOCK_R: tl.constexpr, ROW: tl.constexpr, LSE_OFF: tl.constexpr):
    """Store a loaded tile as packed rows (the values, then the fp32 LSE at 16-bit word LSE_OFF) at
    its rows of each destination: the values of lane j at ``vdst16[j]`` (where ``vok``), the LSEs
    of peer d at ``dst16[d]``. With batch
    metadata (``num_seqs`` >= 0; ``tok0`` the launch's first token in the call) the LSEs of empty
    rows are -inf: this rank adds nothing to them. The values go first, so that they are on their
    way while the search for the empty rows waits for its loads. ``mask_mode``: _MASK_READ takes
    the empty tokens from ``gone`` (the mask's bytes ``_load_tile`` read) instead of searching;
    _MASK_WRITE also stores each token's emptiness in ``tmask`` (by its head-0 row) for later calls."""
    rows, rmask, tok, hh = _tile_rows(t, n_rows, HN, BLOCK_R)
    m2 = (peer < N)[:, None] & rmask[None, :]
    drow = dst16[:, None] + rows.to(tl.int64)[None, :] * ROW
    vrow = vdst16[:, None] + rows.to(tl.int64)[None, :] * ROW
    vmask = (vok[:, None] & rmask[None, :])[:, :, None] & cmask[None, None, :]
    if vals.dtype == tl.float32:  # two 16-bit words a value
        tl.store(vrow.to(tl.pointer_type(tl.float32), bitcast=True)[:, :, None] + c_off[None, None, :], vals,
                 mask=vmask)
    else:
        tl.store(vrow[:, :, None] + c_off[None, None, :], vals.to(tl.int16, bitcast=True), mask=vmask)
    if num_seqs >= 0:
        if mask_mode == _MASK_READ:
            empty = gone != 0
        else:
            empty = _empty_rows(tok, rmask, tok0, seq_lens, qsl, num_seqs, s_sl, s_qsl, top, h1, h2, h3, h4, h5, h6,
                                h7, end, BLOCK_R)
            if mask_mode == _MASK_WRITE:
                tl.store(tmask + (tok + tok0), empty.to(tl.int8), mask=rmask & (hh == 0))
        lv = tl.where(empty[None, :], float("-inf"), lv)
    tl.store((drow + LSE_OFF).to(tl.pointer_type(tl.float32), bitcast=True), lv, mask=m2)


def _chunk_units(t, n_units, HN: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_R: tl.constexpr):
    """Tile t of the gather: BLOCK_R chunks of the flattened [B * HN * CHUNKS] space, their mask,
    token, head within the chunk, and place within the row."""
    u = t * BLOCK_R + tl.arange(0, BLOCK_R)
    row = u // CHUNKS
    return u.to(tl.int64), u < n_units, (row // HN).to(tl.int64), row % HN, u % CHUNKS


def _load_chunks(q, t, n_units, c_off, s_q_b, s_q_h, HN: tl.constexpr, CHUNKS: tl.constexpr, CW: tl.constexpr,
                 BLOCK_R: tl.constexpr):
    """Tile t of this rank's own query rows as 16-bit words [BLOCK_R, CW]: the gather sends the same
    chunks to every peer."""
    u, umask, tok, hh, part = _chunk_units(t, n_units, HN, CHUNKS, BLOCK_R)
    return tl.load(q + tok[:, None] * s_q_b + hh[:, None] * s_q_h + (part * CW)[:, None] + c_off[None, :],
                   mask=umask[:, None])


def _store_chunks(ctl, local, to_slot, stage, t, vals, n_units, c_off, N: tl.constexpr, CW: tl.constexpr,
                  BLOCK_R: tl.constexpr, RECV_OFF: tl.constexpr, PULL: tl.constexpr):
    """Store one tile of chunks at its place in every peer's receive slot (``to_slot``: this rank's
    rows there, in 16-bit words past RECV_OFF), peer by peer from the same registers: no padding
    peers; or, pulled, once in this rank's own slot (``stage``), where every peer reads it. Gather
    rows are whole 16-byte vectors, so chunk u sits at word u * CW of the rows."""
    u = t * BLOCK_R + tl.arange(0, BLOCK_R)
    off = u.to(tl.int64)[:, None] * CW + c_off[None, :]
    if PULL:
        tl.store(tl.multiple_of(local.to(tl.pointer_type(tl.int16)), 16) + (RECV_OFF // 2 + stage) + off, vals,
                 mask=(u < n_units)[:, None])
    else:
        for s in tl.static_range(N):
            dst = tl.multiple_of(tl.load(ctl + s).to(tl.pointer_type(tl.int16)), 16) + (RECV_OFF // 2 + to_slot)
            tl.store(dst + off, vals, mask=(u < n_units)[:, None])


def _copy_chunks(src16, t, n_units, src_stride, ctl, to_me, y, s_y_b, s_y_h, c_off, ok, N: tl.constexpr,
                 HN: tl.constexpr, CHUNKS: tl.constexpr, CW: tl.constexpr, BLOCK_R: tl.constexpr,
                 RECV_OFF: tl.constexpr, PULL: tl.constexpr):
    """The gather's finish: source s's rows land at heads [s * HN, (s + 1) * HN) of the output,
    bit for bit; where the call failed (``ok`` false), all-ones words (NaN in every float type)."""
    u, umask, tok, hh, part = _chunk_units(t, n_units, HN, CHUNKS, BLOCK_R)
    omask = umask[:, None]
    for s in tl.static_range(N):
        dst = y + tok[:, None] * s_y_b + (s * HN + hh)[:, None] * s_y_h + (part * CW)[:, None] + c_off[None, :]
        if ok:
            src = _source(s, src16, src_stride, ctl, to_me, RECV_OFF, PULL)
            tl.store(dst, tl.load(src + u[:, None] * CW + c_off[None, :], mask=omask), mask=omask)
        else:
            tl.store(dst, tl.full([BLOCK_R, CW], -1, tl.int16), mask=omask)


def _source(s, src16, src_stride, ctl, to_me, RECV_OFF: tl.constexpr, PULL: tl.constexpr):
    """Where source s's rows of this call start (16-bit words): ``src_stride`` words apart from
    ``src16`` in this rank's slot (pushed, and the NCCL path's buffer), or, pulled, in s's own
    region, ``to_me`` words into its receive area."""
    if PULL:
        return tl.multiple_of(tl.load(ctl + s).to(tl.pointer_type(tl.int16)), 16) + (RECV_OFF // 2 + to_me)
    return src16 + s * src_stride


def _source_flags(s, flags, ctl, slot, N: tl.constexpr, TILES_MAX: tl.constexpr, FLAG_OFF: tl.constexpr,
                  PULL: tl.constexpr):
    """Source s's flags of this slot: in this rank's region (pushed) or in s's own (pulled)."""
    if PULL:
        return (tl.load(ctl + s) + FLAG_OFF).to(tl.pointer_type(tl.int64)) + (slot * N + s) * TILES_MAX
    return flags + s * TILES_MAX


def _load_lse(src, row, rmask, ROW: tl.constexpr, LSE_OFF: tl.constexpr):
    """The fp32 LSE of packed rows; NaN and +inf count as -inf (that rank saw no keys)."""
    lv = tl.load((src + row * ROW + LSE_OFF).to(tl.pointer_type(tl.float32), bitcast=True), mask=rmask,
                 other=float("-inf"))
    return tl.where((lv != lv) | (lv == float("inf")), float("-inf"), lv)


def _combine_rows(src16, row0, src_stride, ctl, to_me, own16, own, y_ptrs, yl_ptrs, rmask, c_off, cmask,
                  write_lse, log2_scale, N: tl.constexpr, BLOCK_R: tl.constexpr, DP: tl.constexpr, ROW: tl.constexpr,
                  LSE_OFF: tl.constexpr, RECV_OFF: tl.constexpr, PULL: tl.constexpr, OWN_ALIGNED: tl.constexpr):
    """LSE-weighted combine of rows ``row0`` of N sources (``_source``: where each one's are; the
    values of source ``own`` at the 16-bit word pointers ``own16``, the rows of the input, 16-byte
    aligned where OWN_ALIGNED: the row pointer is picked per source, and Triton 3.8 and 3.9 prove
    no alignment for the pick, so without the hint every source's loads lose their vectors).

    Source by source in [BLOCK_R, DP] blocks, in the layout of the output: a reduction over a peer
    axis would go through shared memory. The loads do not depend on each other, so they overlap.
    Each source's weight is normalized (divided by the weight sum) before it scales the values, so
    the fp32 sum never exceeds the largest value (values near the dtype's maximum stay finite). A
    source of weight 0 contributes nothing even if its values are NaN or inf; where every source is
    empty the result is 0 and the LSE -inf. The LSEs are read three times (max, sum, weights): a
    few words per row, from cache.
    """
    out_ty = y_ptrs.dtype.element_ty
    row = row0
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in tl.static_range(N):
        m = tl.maximum(m, _load_lse(_source(s, src16, src_stride, ctl, to_me, RECV_OFF, PULL), row, rmask, ROW,
                                    LSE_OFF))
    m = tl.where(m == float("-inf"), 0.0, m)
    wsum = tl.full([BLOCK_R], 0.0, tl.float32)
    for s in tl.static_range(N):
        lv = _load_lse(_source(s, src16, src_stride, ctl, to_me, RECV_OFF, PULL), row, rmask, ROW, LSE_OFF)
        wsum += tl.exp2((lv - m) * log2_scale)
    inv = tl.where(wsum > 0, 1.0 / wsum, 0.0)
    acc = tl.full([BLOCK_R, DP], 0.0, tl.float32)
    omask = rmask[:, None] & cmask[None, :]
    for s in tl.static_range(N):
        src = _source(s, src16, src_stride, ctl, to_me, RECV_OFF, PULL)
        w = tl.exp2((_load_lse(src, row, rmask, ROW, LSE_OFF) - m) * log2_scale) * inv
        vrow = tl.where(s == own, own16, src + row * ROW)
        if out_ty == tl.float32:  # two 16-bit words a value
            vrow = vrow.to(tl.pointer_type(tl.float32), bitcast=True)
        if OWN_ALIGNED:
            vrow = tl.multiple_of(vrow, 16)
        ov = tl.load(vrow[:, None] + c_off[None, :], mask=omask, other=0)
        if out_ty != tl.float32:
            ov = ov.to(out_ty, bitcast=True)
        acc += tl.where(w[:, None] > 0, w[:, None] * ov.to(tl.float32), 0.0)
    tl.store(y_ptrs, _round_to(acc, out_ty), mask=omask)
    if write_lse != 0:
        tl.store(yl_ptrs, tl.where(wsum > 0, tl.log2(wsum) / log2_scale + m, float("-inf")), mask=rmask)


def _finish_combine(src16, row0, src_stride, ctl, to_me, own16, own, y_ptrs, yl_ptrs, rmask, c_off, cmask, ok,
                    write_lse, log2_scale, N: tl.constexpr, BLOCK_R: tl.constexpr, DP: tl.constexpr, ROW: tl.constexpr,
                    LSE_OFF: tl.constexpr, RECV_OFF: tl.constexpr, PULL: tl.constexpr, OWN_ALIGNED: tl.constexpr):
    """The combine's finish; where the call failed, never leave stale rows: they read as NaN."""
    if ok:
        _combine_rows(src16, row0, src_stride, ctl, to_me, own16, own, y_ptrs, yl_ptrs, rmask, c_off, cmask, write_lse,
                      log2_scale, N, BLOCK_R, DP, ROW, LSE_OFF, RECV_OFF, PULL, OWN_ALIGNED)
    else:
        tl.store(y_ptrs, tl.full([BLOCK_R, DP], float("nan"), tl.float32).to(y_ptrs.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])
        if write_lse != 0:
            tl.store(yl_ptrs, tl.full([BLOCK_R], float("nan"), tl.float32), mask=rmask)


def _stamp(x, TRACE: tl.constexpr):
    """The device time for the opt-in trace; compiled out without it."""
    if TRACE:
        return _now(x)
    return tl.full([], 0, tl.int64)


def _scale_strides(a, b, c, d, ALIGNED: tl.constexpr):
    """Strides come divided by 8 when rows are 16-byte aligned: the product proves it."""
    if ALIGNED:
        return a * 8, b * 8, c * 8, d * 8
    return a, b, c, d


# --- the fused kernel ----------------------------------------------------------------------------

def lse_alltoall_kernel(
    po, lse, y, y_lse, ctl, seq_lens, qsl, tmask,
    n_tokens, call_tag, rank,
    s_po_b, s_po_h, s_lse_b, s_lse_h, s_y_b, s_y_h, s_yl_b, s_yl_h,
    write_lse, log2_scale, tok0, num_seqs, s_sl, s_qsl, mask_mode,
    N: tl.constexpr, NP: tl.constexpr, NV: tl.constexpr, HN: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    ROW: tl.constexpr, LSE_OFF: tl.constexpr, BLOCK_R: tl.constexpr, CW: tl.constexpr, CHUNKS: tl.constexpr,
    ROWS_MAX: tl.constexpr, TILES_MAX: tl.constexpr, FLAG_OFF: tl.constexpr, RECV_OFF: tl.constexpr,
    SLOT: tl.constexpr, GATHER: tl.constexpr, ONE_WAIT: tl.constexpr, ALIGNED: tl.constexpr,
    GPU_SCOPE: tl.constexpr, TRACE: tl.constexpr, PDL: tl.constexpr, PULL: tl.constexpr,
):
    """One launch of a call: ``n_tokens`` tokens of this launch, ``call_tag`` the call's tag (its
    kind and total B; TAG_ABORT or TAG_POISONED with no tokens announce a call that moves no data;
    TAG_LOAD only loads the variant).

    The combine (``GATHER`` false): ``po`` [B, H, D] partial outputs and ``lse`` [B, H] in, this
    rank's head chunk ``y`` [B, H/N, D] (and ``y_lse``) out. The query all-gather (``GATHER``):
    ``po`` is this rank's [B, H/N, D] rows and ``y`` the [B, H, D] result, both as 16-bit words
    (D of them per row); ``lse`` and ``y_lse`` are unused.

    ``num_seqs`` >= 0 (combine only): vLLM's batch metadata ``seq_lens`` [num_seqs] and
    ``query_start_loc`` (``qsl``) [num_seqs + 1], int32 with element strides ``s_sl``, ``s_qsl``
    (int64 tensors come as int32 views, stride 2); this launch's tokens start at token ``tok0`` of
    the call. -1: no metadata (the pointers are unused)."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    if call_tag != _TAG_LOAD:
        s_po_b, s_po_h, s_y_b, s_y_h = _scale_strides(s_po_b, s_po_h, s_y_b, s_y_h, ALIGNED)
        local = tl.load(ctl + rank)  # ctl is written once, at construction
        state = local.to(tl.pointer_type(tl.int32))
        if PDL:
            # Launched early (programmatic dependent launch): from here on, everything the
            # previous kernel of the stream wrote (inputs, this channel's epoch) is visible.
            gdc_wait()
        t_start = _stamp(pid, TRACE)
        e = (tl.load(state, volatile=True).to(tl.uint32, bitcast=True) >> _SHIFT).to(tl.int32) + 1
        slot = e & 1
        # A channel whose call failed is poisoned for good: its calls move no data and announce
        # themselves as poisoned, so that every peer's call fails too, and write NaN rows.
        poisoned = (tl.load(state + 1, volatile=True) != 0) | (call_tag == _TAG_POISONED)
        tag = tl.where(poisoned, _TAG_POISONED, call_tag)
        want = (tag.to(tl.int64) << 32) | e.to(tl.int64)
        n_rows = n_tokens * HN * CHUNKS  # a tile's units: rows, or the gather's chunks of rows
        n_push = tl.where(poisoned, 0, n_rows)
        # Tile 0 always exists, even without rows: every call announces itself to every peer.
        n_tiles = tl.maximum((n_rows + BLOCK_R - 1) // BLOCK_R, 1)
        # The flags a call publishes per destination: one per tile, or one per program (ONE_WAIT).
        n_flags = tl.minimum(n_tiles, G) if ONE_WAIT else n_tiles
        c_off = tl.arange(0, CW)
        cmask = c_off < D
        peer = tl.arange(0, NP)
        # Padding peers alias the last real one: only flag words (same value, same address) use
        # these addresses unmasked.
        bases = tl.load(ctl + tl.minimum(peer, N - 1))

        # Push: pack each tile for every destination straight into its receive slot; then one
        # fence for all of them and a relaxed flag per tile (or program) and destination (the release
        # pattern, paid once per program, not per tile or per peer).
        # (The alignment hint goes on the converted base itself: Triton 3.8 rewrites a converted
        # sum into an offset from the converted base and drops a hint placed on the sum.)
        stage = slot.to(tl.int64) * SLOT
        to_slot = stage + rank.to(tl.int64) * (ROWS_MAX * ROW)
        if PULL:  # staged in this rank's own region, destination d's rows at d; one flag per tile
            dst16 = (tl.multiple_of(local.to(tl.pointer_type(tl.int16)), 16) + (RECV_OFF // 2 + stage)
                     + peer.to(tl.int64) * (ROWS_MAX * ROW))
            dst_flags = (local + FLAG_OFF).to(tl.pointer_type(tl.int64)) + (slot * N + rank) * TILES_MAX
        else:
            dst16 = tl.multiple_of(bases.to(tl.pointer_type(tl.int16)), 16) + (RECV_OFF // 2 + to_slot)
            dst_flags = (bases + FLAG_OFF).to(tl.pointer_type(tl.int64)) + (slot * N + rank) * TILES_MAX
        # Tiles pid, pid + G, ... (a while: the interpreter's range needs ints), each loaded one
        # step ahead so that a load is in flight while the previous tile is stored.
        t = pid
        if GATHER:
            vals = _load_chunks(po, t, n_push, c_off, s_po_b, s_po_h, HN, CHUNKS, CW, BLOCK_R)
            while t * BLOCK_R < n_push:
                nvals = _load_chunks(po, t + G, n_push, c_off, s_po_b, s_po_h, HN, CHUNKS, CW, BLOCK_R)
                _store_chunks(ctl, local, to_slot, stage, t, vals, n_push, c_off, N, CW, BLOCK_R, RECV_OFF, PULL)
                vals = nvals
                t += G
        else:
            if NV == NP:  # the values on the peer axis, this rank's own lane masked off
                vpeer = peer
                vok = (peer < N) & (peer != rank)
                vdst16 = dst16
            else:  # on lanes of their own, lane j to rank + 1 + j: their bases, loaded once
                vpeer = (rank + 1 + tl.arange(0, NV)) % N
                vok = tl.arange(0, NV) < N - 1
                if PULL:
                    vdst16 = (tl.multiple_of(local.to(tl.pointer_type(tl.int16)), 16) + (RECV_OFF // 2 + stage)
                              + vpeer.to(tl.int64) * (ROWS_MAX * ROW))
                else:
                    vdst16 = (tl.multiple_of(tl.load(ctl + vpeer).to(tl.pointer_type(tl.int16)), 16)
                              + (RECV_OFF // 2 + to_slot))
            vals, lv, gone = _load_tile(po, lse, t, n_push, peer, vpeer, vok, c_off, cmask, s_po_b, s_po_h, s_lse_b,
                                        s_lse_h, tmask, tok0, mask_mode, N, HN, BLOCK_R)
            top, h1, h2, h3, h4, h5, h6, h7, end = _search_start(qsl, tl.where(mask_mode == _MASK_READ, -1, num_seqs),
                                                                 s_qsl)
            while t * BLOCK_R < n_push:
                nvals, nlv, ngone = _load_tile(po, lse, t + G, n_push, peer, vpeer, vok, c_off, cmask, s_po_b,
                                               s_po_h, s_lse_b, s_lse_h, tmask, tok0, mask_mode, N, HN, BLOCK_R)
                _store_tile(dst16, vdst16, t, vals, lv, gone, n_push, peer, vok, c_off, cmask, tok0, seq_lens, qsl,
                            num_seqs, s_sl, s_qsl, tmask, mask_mode, top, h1, h2, h3, h4, h5, h6, h7, end, N, HN,
                            BLOCK_R, ROW, LSE_OFF)
                vals, lv, gone = nvals, nlv, ngone
                t += G
        tl.debug_barrier()
        _fence(e, GPU_SCOPE)
        t = pid
        while t < n_flags:
            _store_relaxed(dst_flags + t, want, GPU_SCOPE)
            t += G
        # Refresh, round robin, one flag of this slot that this call does not publish, so that no
        # flag is older than 2 * TILES_MAX calls: one left from an epoch period ago would carry a
        # later call's very epoch and tag, and match before its source had pushed.
        fresh = (e >> 1) % TILES_MAX
        if (pid == 0) & (fresh >= n_flags):
            _store_relaxed(dst_flags + fresh, want, GPU_SCOPE)
        t_pushed = _stamp(t, TRACE)

        # Wait: a bounded spin on each tile's flags from every source (relaxed loads), then one
        # fence for all of them (the acquire pattern). Source by source: the interpreter cannot run
        # Triton's reductions. A tile has arrived once every source's flag carries this epoch; it
        # is good only if every flag also carries this call's tag.
        flags = (local + FLAG_OFF).to(tl.pointer_type(tl.int64)) + slot * N * TILES_MAX
        recv16 = tl.multiple_of(local.to(tl.pointer_type(tl.int16)), 16) + (RECV_OFF // 2 + slot.to(tl.int64) * SLOT)
        # Pulled, source s's rows for this rank are in s's region: the gather's at its slot's start,
        # the combine's at this rank's index there.
        to_me = stage if GATHER else to_slot
        t_arrived = t_pushed
        code = tl.where(poisoned, _MISMATCH, 0)  # > 0 once a tile failed: its rows are then NaN
        missed = code * 0  # bit s: source s had not arrived at this program's first failed tile
        # (read here, not with ``local``: kept live across the push they cost a register spill)
        status = tl.load(ctl + _CTL_STATUS).to(tl.pointer_type(tl.int32))
        timeout = tl.where(poisoned, 0, tl.load(ctl + _CTL_TIMEOUT)).to(tl.int64)
        t = pid
        while t < n_tiles:
            if _waits_for(t, pid, ONE_WAIT):  # each tile, or (ONE_WAIT) the program's first only
                # Once a program of this call has given up, the others give up at once too.
                timeout = tl.where(_call_failed(status, e), 0, timeout).to(tl.int64)
                start = _now(t)
                tile_code = 0
                absent = code * 0  # bit s: source s's flag of this tile does not carry this epoch (yet)
                while tile_code == 0:
                    absent = code * 0
                    n_same = 0
                    n_gave_up = 0
                    for s in tl.static_range(N):
                        got = _load_relaxed(_source_flags(s, flags, ctl, slot, N, TILES_MAX, FLAG_OFF, PULL) + t,
                                            GPU_SCOPE)
                        absent |= ((got & 0xFFFFFFFF) != e).to(tl.int32) << s
                        n_same += (got == want).to(tl.int32)
                        n_gave_up += _gave_up(got, e).to(tl.int32)
                    waited = _now(t) - start
                    # (a source that gave up on this call fails it at once, as a timeout)
                    tile_code = tl.where(n_same == N, -1, tl.where(n_gave_up > 0, _TIMEOUT, tl.where(
                        absent == 0, _MISMATCH, tl.where(waited > timeout, _TIMEOUT, 0))))
                    # A sender of another call (another B, or a call that moves no data) may never
                    # publish this tile; its tile 0 always exists, so it shows there. Looked at only
                    # once the wait is not short, so the fast spin reads nothing else.
                    # A source whose channel is poisoned never takes part again, whatever the epoch;
                    # one that gave up on this call after a timeout fails it as a timeout here too.
                    if (tile_code == 0) & (waited > _MISMATCH_AFTER_NS):
                        for s in tl.static_range(N):
                            first = _load_relaxed(_source_flags(s, flags, ctl, slot, N, TILES_MAX, FLAG_OFF, PULL),
                                                  GPU_SCOPE)
                            if _gave_up(first, e):
                                tile_code = tl.where(tile_code == _MISMATCH, _MISMATCH, _TIMEOUT)
                            elif (((first & 0xFFFFFFFF) == e) & (first != want)) | ((first >> 32) == _TAG_POISONED):
                                tile_code = _MISMATCH
                    _pause()
                if (tile_code > 0) & (code <= 0):  # (code is -1 once a tile arrived)
                    # Missing: the sources absent at the wait's last read (read again, a late one
                    # that arrived since would be named by nobody); also for the retraction.
                    _record_failure(status, flags, ctl, slot, t, e, tag, tile_code, absent, N, TILES_MAX, FLAG_OFF,
                                    GPU_SCOPE, PULL)
                    missed = absent
                code = tl.where(code > 0, code, tile_code)
                # After one failed wait the call is lost: later tiles look once and give up.
                timeout = tl.where(code > 0, 0, timeout).to(tl.int64)
                t_arrived = _stamp(t, TRACE)
                if PDL:
                    if _last_wait(t, G, n_tiles, ONE_WAIT):
                        # The next call may now be scheduled: every peer's programs are resident (their
                        # tiles arrived), and its programs wait (above) only for this grid, which needs
                        # nothing more from other ranks, so the SM slots they hold cannot keep a peer's
                        # call from finishing.
                        tl.debug_barrier()
                        gdc_launch_dependents()
                # The rows are made visible by an acquire load of each source's flag once the relaxed
                # poll saw them all (a poll of acquire loads would invalidate the SM's L1 at every
                # read; a fence per tile measured up to 8% slower), each pairing with its source's
                # fence before its flag.
                for s in tl.static_range(N):
                    _load_acquire(_source_flags(s, flags, ctl, slot, N, TILES_MAX, FLAG_OFF, PULL) + t, GPU_SCOPE)
            # Finish this tile at once, from local memory, while later tiles may still be on their
            # way (unless ONE_WAIT): combine, or copy out (gather).
            if t * BLOCK_R < n_rows:
                if GATHER:
                    _copy_chunks(recv16, t, n_rows, ROWS_MAX * ROW, ctl, to_me, y, s_y_b, s_y_h, c_off, code < 0, N,
                                 HN, CHUNKS, CW, BLOCK_R, RECV_OFF, PULL)
                else:
                    rows, rmask, tok, hh = _tile_rows(t, n_rows, HN, BLOCK_R)
                    y_ptrs = y + tok[:, None] * s_y_b + hh[:, None] * s_y_h + c_off[None, :]
                    yl_ptrs = y_lse + tok * s_yl_b + hh * s_yl_h
                    # This rank's own rows are never pushed: the combine reads them from the input.
                    own_off = tok * s_po_b + (rank * HN + hh) * s_po_h
                    if po.dtype.element_ty == tl.float32:
                        own_off *= 2
                    own16 = po.to(tl.pointer_type(tl.int16), bitcast=True) + own_off
                    _finish_combine(recv16, rows.to(tl.int64), ROWS_MAX * ROW, ctl, to_me, own16, rank, y_ptrs,
                                    yl_ptrs, rmask, c_off, cmask, code < 0, write_lse, log2_scale, N, BLOCK_R, DP,
                                    ROW, LSE_OFF, RECV_OFF, PULL, ALIGNED)
            t += G
        if (code == _TIMEOUT) & (tag != _TAG_POISONED):
            # Retract this program's flags of the timed-out call: a peer that comes late (it may
            # have skipped a call) must find a call given up, not rows it would take for its own
            # call, and learn whom this rank waited for. (After a mismatch the flags stay: the
            # late peer sees the difference itself.)
            retracted = ((tl.full([], _TAG_GAVE_UP, tl.int64) - missed.to(tl.int64)) << 32) | e.to(tl.int64)
            _fence(e, GPU_SCOPE)
            t = pid
            while t < n_flags:
                _store_relaxed(dst_flags + t, retracted, GPU_SCOPE)
                t += G
        t_combined = _stamp(t, TRACE)
        if code > 0:
            tl.store(state + 1, 1)  # poison the channel: read by the next call, after this grid ends

        # Advance the epoch: the programs add EPOCH_STRIDE to the state word together, so its
        # epoch bits move only once every program of this call has read them. Nobody waits on it.
        tl.atomic_add(state, tl.where(pid == 0, _STRIDE - (G - 1), 1), sem="relaxed", scope="gpu")
        if TRACE:
            if pid < _TRACE_PROGRAMS:
                rec = tl.load(ctl + _CTL_TRACE).to(tl.pointer_type(tl.int64)) + (
                    (e % _TRACE_CALLS) * _TRACE_PROGRAMS + pid) * _TRACE_WORDS
                tl.store(rec + 1, t_start)
                tl.store(rec + 2, t_pushed)
                tl.store(rec + 3, t_arrived)
                tl.store(rec + 4, t_combined)
                tl.store(rec, e.to(tl.int64))


def _waits_for(t, pid, ONE_WAIT: tl.constexpr):
    """Whether a program waits for tile t's flags: for every tile, or (ONE_WAIT) only for its first,
    whose flag, at its own index, covers all its tiles. (``t == t``: true, folded at compile time.)"""
    if ONE_WAIT:
        return t == pid
    return t == t


def _last_wait(t, G, n_tiles, ONE_WAIT: tl.constexpr):
    """Whether the wait for tile t is the program's last (its only one under ONE_WAIT)."""
    if ONE_WAIT:
        return t == t
    return t + G >= n_tiles


def _gave_up(flag, e):
    """Whether a flag is a retraction of call ``e`` by a rank whose wait timed out."""
    g = flag >> 32
    return ((flag & 0xFFFFFFFF) == e) & (g <= _TAG_GAVE_UP) & (g > _TAG_GAVE_UP - 256)


def _record_failure(status, flags, ctl, slot, t, e, tag, code, absent, N: tl.constexpr, TILES_MAX: tl.constexpr,
                    FLAG_OFF: tl.constexpr, GPU_SCOPE: tl.constexpr, PULL: tl.constexpr):
    """Leave the first failure of a channel where the host reads it: which sources were missing at
    tile t (``absent``, bit s: source s, as the wait last read them), and the tag each announced
    (read now; TAG_NONE: nothing of this call arrived from it).

    Programs that fail at once may each find the channel unrecorded and write here together (no
    atomic reaches host-mapped memory on every fabric). So a source's word is only ever set, never
    cleared (the words start at 0 and a channel fails once): the record names every source any of
    them missed, never none; its other words are the last writer's."""
    if tl.load(status, volatile=True) == 0:  # the first failure is kept: the channel is poisoned
        tl.store(status + 1, e)
        tl.store(status + 2, t)
        tl.store(status + 3, tag)
        for s in tl.static_range(N):
            src_flags = _source_flags(s, flags, ctl, slot, N, TILES_MAX, FLAG_OFF, PULL)
            got = _load_relaxed(src_flags + t, GPU_SCOPE)
            first = _load_relaxed(src_flags, GPU_SCOPE)
            got_now = (got & 0xFFFFFFFF) == e
            tl.store(status + 4 + s, 1, mask=((absent >> s) & 1) != 0)
            first_now = ((first & 0xFFFFFFFF) == e) | ((first >> 32) == _TAG_POISONED)
            announced = tl.where(got_now, got >> 32, tl.where(first_now, first >> 32, _TAG_NONE))
            tl.store(status + 12 + s, announced.to(tl.int32))
        tl.store(status, code)


# --- the NCCL reference path ---------------------------------------------------------------------

def pack_kernel(po, lse, send, seq_lens, qsl, tmask, n_tokens, s_po_b, s_po_h, s_lse_b, s_lse_h, tok0, num_seqs, s_sl,
                s_qsl, mask_mode, N: tl.constexpr, NP: tl.constexpr, HN: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                ROW: tl.constexpr, LSE_OFF: tl.constexpr, BLOCK_R: tl.constexpr, ALIGNED: tl.constexpr):
    """Pack the chunk of every destination d into send[d, :B * HN] (rows of ROW int16); the batch
    metadata as in the fused kernel."""
    s_po_b, s_po_h, _, _ = _scale_strides(s_po_b, s_po_h, 0, 0, ALIGNED)
    n_rows = n_tokens * HN
    c_off = tl.arange(0, DP)
    peer = tl.arange(0, NP)
    dst16 = tl.multiple_of(send.to(tl.pointer_type(tl.int16), bitcast=True), 16) + (peer * n_rows).to(tl.int64) * ROW
    vals, lv, gone = _load_tile(po, lse, tl.program_id(0), n_rows, peer, peer, peer < N, c_off, c_off < D, s_po_b,
                                s_po_h, s_lse_b, s_lse_h, tmask, tok0, mask_mode, N, HN, BLOCK_R)
    top, h1, h2, h3, h4, h5, h6, h7, end = _search_start(qsl, tl.where(mask_mode == _MASK_READ, -1, num_seqs), s_qsl)
    _store_tile(dst16, dst16, tl.program_id(0), vals, lv, gone, n_rows, peer, peer < N, c_off, c_off < D, tok0,
                seq_lens, qsl, num_seqs, s_sl, s_qsl, tmask, mask_mode, top, h1, h2, h3, h4, h5, h6, h7, end, N, HN,
                BLOCK_R, ROW, LSE_OFF)


def combine_kernel(recv, y, y_lse, n_tokens, s_y_b, s_y_h, s_yl_b, s_yl_h, write_lse, log2_scale,
                   N: tl.constexpr, NP: tl.constexpr, HN: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                   ROW: tl.constexpr, LSE_OFF: tl.constexpr, BLOCK_R: tl.constexpr, ALIGNED: tl.constexpr):
    """Combine recv[s, :B * HN] over the N sources into this rank's head chunk."""
    s_y_b, s_y_h, _, _ = _scale_strides(s_y_b, s_y_h, 0, 0, ALIGNED)
    n_rows = n_tokens * HN
    rows, rmask, tok, hh = _tile_rows(tl.program_id(0), n_rows, HN, BLOCK_R)
    c_off = tl.arange(0, DP)
    recv16 = tl.multiple_of(recv.to(tl.pointer_type(tl.int16), bitcast=True), 16)
    _combine_rows(recv16, rows.to(tl.int64), n_rows.to(tl.int64) * ROW, recv, 0, recv16 + rows.to(tl.int64) * ROW, -1,
                  y + tok[:, None] * s_y_b + hh[:, None] * s_y_h + c_off[None, :],
                  y_lse + tok * s_yl_b + hh * s_yl_h, rmask, c_off, c_off < D, write_lse, log2_scale,
                  N, BLOCK_R, DP, ROW, LSE_OFF, 0, False, True)


def clock_kernel(out, n):
    """Stores the device clock (ns) in the next of out's ``n`` slots; ``out[n]`` counts the launches.

    The benchmark queues one between timed steps (under MPS a CUDA event recorded there costs more
    device time than a small call). The slot comes from the device, so a graph may hold the mark."""
    i = tl.atomic_add(out + n, 1, sem="relaxed")
    tl.store(out + i, _now(i.to(tl.int32)), mask=i < n)


# --- helpers that differ by execution mode -------------------------------------------------------

def _load_relaxed_gpu(ptr, GPU_SCOPE: tl.constexpr):
    return tl.inline_asm_elementwise("ld.relaxed." + ("gpu" if GPU_SCOPE else "sys") + ".global.b64 $0, [$1];", "=l,l",
                                     [ptr], dtype=tl.int64, is_pure=False, pack=1)


def _store_relaxed_gpu(ptr, val, GPU_SCOPE: tl.constexpr):
    tl.inline_asm_elementwise("st.relaxed." + ("gpu" if GPU_SCOPE else "sys")
                              + ".global.b64 [$1], $2;\n\tmov.u32 $0, 0;",
                              "=r,l,l", [ptr, val], dtype=tl.int32, is_pure=False, pack=1)


def _fence_gpu(x, GPU_SCOPE: tl.constexpr):
    tl.inline_asm_elementwise("fence.acq_rel." + ("gpu" if GPU_SCOPE else "sys") + ";\n\tmov.u32 $0, 0;", "=r,r", [x],
                              dtype=tl.int32, is_pure=False, pack=1)


def _load_acquire_gpu(ptr, GPU_SCOPE: tl.constexpr):
    return tl.inline_asm_elementwise("ld.acquire." + ("gpu" if GPU_SCOPE else "sys") + ".global.b64 $0, [$1];", "=l,l",
                                     [ptr], dtype=tl.int64, is_pure=False, pack=1)


def _now_gpu(x):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x],
                                     dtype=tl.int64, is_pure=False, pack=1)


def _pause_gpu():
    pass


def _round_to_gpu(acc, out_ty: tl.constexpr):
    # (the native cvt.rn: bf16 by integer rounding cost 96 more instructions a B = 1 combine, and
    # 1-6% of the combine's time on one H200: docs/design.md, section 5.1)
    return acc.to(out_ty, fp_downcast_rounding="rtne")


def _call_failed_gpu(status, e):
    return e != e  # programs wait concurrently on a GPU: no need to read host memory per tile


def _load_relaxed_cpu(ptr, GPU_SCOPE):
    return tl.load(ptr, volatile=True)


def _load_acquire_cpu(ptr, GPU_SCOPE):
    return tl.load(ptr, volatile=True)


def _store_relaxed_cpu(ptr, val, GPU_SCOPE):
    tl.atomic_xchg(ptr, val)


def _fence_cpu(x, GPU_SCOPE):
    pass  # the interpreter runs each program's operations in order on x86 (TSO)


def _now_cpu(x):
    return tl.full((), time.monotonic_ns(), tl.int64)


def _round_to_cpu(acc, out_ty: tl.constexpr):
    # Rounded to nearest even as on the GPU; bf16 by integer arithmetic: Triton 3.6's interpreter
    # truncates an fp32-to-bf16 cast whatever rounding it is asked for.
    if out_ty == tl.bfloat16:
        bits = acc.to(tl.uint32, bitcast=True)
        hi = tl.where(acc != acc, 0x7FC0, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
        return hi.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return acc.to(out_ty, fp_downcast_rounding="rtne")


def _pause_cpu():
    # Gives up the GIL as well as the core: os.sched_yield() kept the GIL, and on an idle 2-core
    # host another thread of the process then waited up to 21 s for it (a peer's call timed out).
    time.sleep(0)


def _call_failed_cpu(status, e):
    # The interpreter runs programs one after another: without this, each would wait the timeout.
    return (tl.load(status, volatile=True) != 0) & (tl.load(status + 1, volatile=True) == e)


_MODE_HELPERS = ("_load_relaxed", "_load_acquire", "_store_relaxed", "_fence", "_now", "_pause", "_call_failed",
                 "_round_to")
_SHARED_HELPERS = (_tile_rows, _search_start, _empty_rows, _load_tile, _store_tile, _chunk_units, _load_chunks,
                   _store_chunks, _copy_chunks, _source, _source_flags, _load_lse, _combine_rows,
                   _finish_combine, _stamp, _scale_strides, _waits_for, _last_wait, _gave_up, _record_failure)
_INT_ARGS = ["n_tokens", "call_tag", "rank", "s_po_b", "s_po_h", "s_lse_b", "s_lse_h", "s_y_b", "s_y_h",
             "s_yl_b", "s_yl_h", "write_lse", "tok0", "num_seqs", "s_sl", "s_qsl", "mask_mode"]
_built: dict = {}


def build_kernels(interpret: bool) -> types.SimpleNamespace:
    """The kernels for CUDA tensors (compiled) or CPU tensors (Triton's interpreter).

    Built from one source with helpers bound into their globals per mode, so that the choice does
    not depend on ``TRITON_INTERPRET`` at import time (Triton fixes it when ``jit`` decorates).
    """
    if interpret in _built:
        return _built[interpret]
    from triton.runtime.interpreter import InterpretedFunction

    scope = dict(globals())

    def rebind(fn, name):
        copy = types.FunctionType(fn.__code__, scope, name)
        copy.__annotations__ = dict(fn.__annotations__)  # constexpr parameters
        copy.__module__, copy.__qualname__ = __name__, name
        return copy

    def wrap(fn, **kwargs):
        return InterpretedFunction(fn, **kwargs) if interpret else triton.jit(fn, **kwargs)

    suffix = "_cpu" if interpret else "_gpu"
    for name in _MODE_HELPERS:
        helper = rebind(globals()[name + suffix], name)
        scope[name] = helper if interpret else triton.jit(helper)
    for fn in _SHARED_HELPERS:
        helper = rebind(fn, fn.__name__)
        scope[fn.__name__] = helper if interpret else triton.jit(helper)
    kernels = types.SimpleNamespace(
        fused=wrap(rebind(lse_alltoall_kernel, "lse_alltoall_kernel"), do_not_specialize=_INT_ARGS,
                   do_not_specialize_on_alignment=["lse", "y_lse", "ctl", "seq_lens", "qsl", "tmask"]),
        pack=wrap(rebind(pack_kernel, "pack_kernel"), do_not_specialize=_INT_ARGS,
                  do_not_specialize_on_alignment=["lse", "seq_lens", "qsl", "tmask"]),
        combine=wrap(rebind(combine_kernel, "combine_kernel"), do_not_specialize=_INT_ARGS,
                     do_not_specialize_on_alignment=["y_lse"]),
        clock=wrap(rebind(clock_kernel, "clock_kernel"), do_not_specialize=["n"]),
    )
    _built[interpret] = kernels
    return kernels
