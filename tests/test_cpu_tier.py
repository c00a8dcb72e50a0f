"""CPU tier: the real kernels under Triton's interpreter, one process per rank, host shared memory."""

import numpy as np
import pytest
import torch

from tests import gather_cases as gc
from tests import rank_cases as rc
from tests.conftest import fresh_seed
from dcp.constants import KIND_GATHER
from dcp.protocol import LARGE_CALL_TOKENS, ChannelLayout
from dcp.spawn import RankError

# (N, heads per rank, head dim): odd head counts and a head dim that is not a power of two included.
GEOMETRY = {2: (3, 24), 3: (2, 16), 4: (1, 32), 5: (2, 8), 6: (2, 16), 7: (1, 16), 8: (2, 8)}
MAX_TOKENS = 4


@pytest.mark.parametrize("n", sorted(GEOMETRY))
def test_lse_reduce_matches_reference(worlds, n):
    w = worlds(n)
    hn, d = GEOMETRY[n]
    seed = fresh_seed()
    w.run(rc.make_comm, "bf16", max_tokens=MAX_TOKENS, num_heads=hn * n, head_dim=d, dtype="bfloat16")
    cases = [
        dict(B=1, base_e=True, return_lse=True),
        dict(B=MAX_TOKENS, base_e=False, return_lse=True, use_out=True),
        dict(B=2 * MAX_TOKENS + 1, return_lse=False, special=True),  # chunked inside one call
        dict(B=3, strided=True, lse_dtype="bfloat16", use_out=True),
        dict(B=MAX_TOKENS, special=True, base_e=False, use_out=True),
        dict(B=2, lse_dtype="float16", return_lse=False, misaligned=True),
        dict(B=2, return_lse=True, subclass=True),
    ]
    for i, case in enumerate(cases):  # consecutive calls: both slots, several epochs
        w.run(rc.lse_case, "bf16", seed + i, **case)
    w.run(rc.make_comm, "fp16", max_tokens=MAX_TOKENS, num_heads=hn * n, head_dim=d, dtype="float16")
    w.run(rc.lse_case, "fp16", seed + 100, B=MAX_TOKENS + 1, special=True, use_out=True)
    w.run(rc.lse_case, "fp16", seed + 101, B=2, base_e=False, strided=True)
    w.run(rc.close_comm, "bf16")
    w.run(rc.close_comm, "fp16")
    assert w.run(rc.shm_segments, ranks=[0]) == [[]]


def test_small_calls_take_the_smallest_tiles_one_round_of_the_grid_covers():
    """The tiling rule, at the shapes measured on H200s (docs/design.md, section 5.2): a small
    call takes the fewest warps (and so the fewest rows per tile) whose tiles the grid covers in one
    round, a warp count being skipped where it gives no fewer rows than twice as many; else 8."""
    def warps(world, programs, sizes, **kw):
        lay = ChannelLayout(world=world, heads_per_rank=16, head_dim=512, max_tokens=512, programs=programs, **kw)
        return [lay.warps_for(n) for n in sizes]

    assert warps(2, 132, [1, 16, 17, 33, 34, 66, 67, 127, 128]) == [1, 1, 2, 2, 4, 4, 8, 8, 16]
    assert warps(3, 44, [1, 2, 4, 8, 11, 12, 32, 127]) == [1, 1, 2, 4, 4, 8, 8, 8]
    assert warps(6, 22, [1, 2, 4, 8]) == [2, 4, 8, 8]  # one warp would hold one row, as two do
    assert warps(6, 1, [1, 64]) == [8, 8]  # no tiling fits: the default
    assert warps(2, 132, [1, 512], num_warps=4) == [4, 4]
    lay = ChannelLayout(world=2, heads_per_rank=16, head_dim=512, max_tokens=512, programs=132)
    # (16 warps: the values of the one other rank a tile, 64 rows at most)
    assert lay.tilings == {1: 2, 2: 4, 4: 8, 8: 16, 16: 64}
    assert [lay.value_lanes(w) for w in sorted(lay.tilings)] == [2, 2, 2, 2, 1]
    assert [ChannelLayout(n, 16, 512, 512).value_lanes(16) for n in range(2, 9)] == [1, 2, 4, 4, 8, 8, 8]
    # every launch's tiles fit the flags, and the flags are sized by the most tiles of any launch
    assert lay.tiles_max == max(lay.tiles(n, lay.warps_for(n)) for n in range(1, 513)) == 132
    assert [lay.launches_early(w) for w in sorted(lay.tilings)] == [True] * 4 + [False]
    assert ChannelLayout(3, 1, 128, 512, num_warps=16).launches_early(16)
    # a combine tile of 1 or 2 warps' rows runs on 4x the warps; the gather's and a fixed count as they are
    assert [lay.program_warps(w) for w in sorted(lay.tilings)] == [4, 8, 4, 8, 16]
    gather = ChannelLayout(world=2, heads_per_rank=16, head_dim=576, max_tokens=512, programs=132, lse=False)
    assert [gather.program_warps(w) for w in (1, 2, 4)] == [1, 2, 4]
    assert ChannelLayout(3, 1, 128, 512, num_warps=1).program_warps(1) == 1


def test_small_and_large_call_tilings_alternate(worlds):
    """Small calls take small tiles, calls from LARGE_CALL_TOKENS up larger ones; consecutive calls
    of any tiling (and the chunks of one call) share the slots and flags."""
    w = worlds(3)
    seed = fresh_seed()
    w.run(rc.make_comm, "tiles", max_tokens=LARGE_CALL_TOKENS + 8, num_heads=3, head_dim=128)
    # what the communicator reports for each size (the CPU runs 4 programs; interpreted: no
    # programmatic launch); a chunked call runs in launches of max_tokens
    got = w.run(rc.tilings, "tiles", [1, 5, 17, 40, 100, LARGE_CALL_TOKENS, 10 ** 6, 0])
    # (warps per program: a combine tile of 1 or 2 warps' rows runs on 4x the warps)
    assert got == [[(4, False), (4, False), (8, False), (4, False), (8, False), (16, False), (16, False),
                    "n_tokens: expected a positive integer, got 0"]] * 3
    w.run(rc.make_comm, "nccl", max_tokens=LARGE_CALL_TOKENS + 8, num_heads=3, head_dim=128, backend="nccl")
    assert w.run(rc.tilings, "nccl", [1, LARGE_CALL_TOKENS]) == [[(8, False)] * 2] * 3  # one tiling
    w.run(rc.close_comm, "nccl")
    # tilings 16, 1, 16, 2, 16 (chunks of max_tokens, then 14 tokens: 1), 1, 4, 8
    sizes = [LARGE_CALL_TOKENS, 5, LARGE_CALL_TOKENS + 8, 17, 2 * LARGE_CALL_TOKENS + 30, 1, 40, 100]
    for i, B in enumerate(sizes):
        w.run(rc.lse_case, "tiles", seed + i, B=B, use_out=True, special=i % 2 == 0)
    w.run(rc.close_comm, "tiles")


def test_ranks_with_different_grids_tile_calls_alike(worlds):
    """Each rank may ask for its own grid (``max_programs``), but every rank runs the smallest of
    them and sizes small calls' tiles by it: every rank numbers a call's tiles alike, and a gather,
    whose programs wait for one flag each, finds the same tiles behind each program's flag."""
    w = worlds(3)
    for r in range(3):  # rank-dependent max_programs: sent separately to each rank
        w.conns[r].send((rc.make_comm.__module__, "make_comm", ("grids",),
                         dict(max_tokens=24, num_heads=3, head_dim=128, query_dim=512, max_programs=1 + 2 * r)))
    w._collect(range(3), 120)
    assert w.run(rc.tilings, "grids", [1, 5, 17]) == [[(4, False), (8, False), (8, False)]] * 3
    grids = w.run(rc.fused_grids, "grids")
    assert grids[0] == grids[1] == grids[2] and max(grids[0][KIND_GATHER]) == 1, grids
    seed = fresh_seed()
    for i, B in enumerate([5, 1, 17]):
        w.run(rc.lse_case, "grids", seed + i, B=B, use_out=True)
    assert w.run(rc.gather_tiles, "grids", 17) == [3] * 3  # (one program walks all three)
    w.run(gc.gather_case, "grids", seed, 17, use_out=True)
    w.run(rc.close_comm, "grids")


@pytest.mark.parametrize("n", [2, 3])
def test_fp32_outputs_match_reference(worlds, n):
    """fp32 partial outputs: two 16-bit words a value in the packed rows, the LSE in one fp32 lane."""
    w = worlds(n)
    seed = fresh_seed()
    w.run(rc.make_comm, "fp32", max_tokens=MAX_TOKENS, num_heads=2 * n, head_dim=24, dtype="float32")
    for i, case in enumerate([dict(B=1), dict(B=2 * MAX_TOKENS + 1, special=True, use_out=True),
                              dict(B=3, strided=True, base_e=False), dict(B=2, misaligned=True)]):
        w.run(rc.lse_case, "fp32", seed + i, **case)
    w.run(rc.close_comm, "fp32")


@pytest.mark.parametrize("backend", ["triton", "pull", "nccl"])
def test_batch_metadata_masks_rows_as_vllm_does(worlds, backend):
    """seq_lens / query_start_loc: padding rows and empty local shards get no weight, on the device,
    across chunks (B above max_tokens), with int32, int64 and strided metadata; one sequence of
    several tokens, sequences of 2-4 tokens (speculative decode) and of none, no sequence at all,
    more sequences than max_tokens, and many: the kernel's search of query_start_loc must find each
    token's sequence, not take the token's index for it."""
    w = worlds(3)
    seed = fresh_seed()
    w.run(rc.make_comm, "meta", max_tokens=MAX_TOKENS, num_heads=6, head_dim=16, backend=backend)
    cases = [dict(B=6, query_start_loc=[0, 1, 2, 3, 4]), dict(B=11, query_start_loc=[0, 3, 4, 7, 9], use_out=True),
             dict(B=9, query_start_loc=[0, 2, 9], layout="int64"), dict(B=5, query_start_loc=[0, 3]),
             dict(B=5, query_start_loc=[0, 1, 1, 4], layout="strided"), dict(B=3, query_start_loc=[0]),
             dict(B=7, query_start_loc=[0, 2, 2, 5], layout="int64_strided"),
             dict(B=10, query_start_loc=[0, 2, 5, 9]),
             dict(B=11, query_start_loc=[0, 1, 2, 2, 3, 5, 6, 7, 8, 10]),  # 9 sequences, max_tokens 4
             dict(B=9, query_start_loc=list(range(9))),  # 8 sequences: the search's first step is its last
             dict(B=66, query_start_loc=list(range(64)) + [65]),  # 64: its second step, seq_lens loaded with it
             dict(B=140, query_start_loc=list(range(121)) + [122 + 2 * i for i in range(8)] + [137]),
             # a step's calls (step=): the first searches, the others read its verdicts
             dict(B=4, query_start_loc=[0, 2, 3], steps=2), dict(B=3, query_start_loc=[0, 1, 2, 3], layout="int64",
                                                               steps=2),
             dict(B=11, query_start_loc=[0, 3, 4, 7, 9], steps=2)]  # above max_tokens: searched every call
    for i, case in enumerate(cases):
        w.run(rc.metadata_case, "meta", seed + i, **case)
    w.run(rc.close_comm, "meta")


def test_inconsistent_batch_metadata_is_refused_on_every_rank(worlds):
    w = worlds(2)
    w.run(rc.make_comm, "meta", max_tokens=MAX_TOKENS, num_heads=4, head_dim=16)
    messages = w.run(rc.metadata_errors, "meta")
    assert messages[0] == messages[1]
    together = "ValueError: seq_lens and query_start_loc must be provided together"
    boundary = "ValueError: query_start_loc must contain one boundary per sequence"
    assert messages[0][:4] == [together, together, boundary, boundary], messages[0]
    assert "torch.int32 or torch.int64" in messages[0][4]
    assert messages[0][5].startswith("TypeError: seq_lens: expected a torch.Tensor"), messages[0]
    assert w.run(rc.metadata_errors, "meta", True) == messages  # within a step: refused alike
    w.run(rc.close_comm, "meta")


def test_bad_calls_raise_clear_errors(worlds):
    w = worlds(3)
    w.run(rc.make_comm, "err", max_tokens=2, num_heads=6, head_dim=16)
    messages = w.run(rc.bad_calls, "err")
    assert all(len(m) == len(messages[0]) for m in messages)
    w.run(rc.close_comm, "err")
    msg = w.run(rc.call_after_close)
    assert all("closed" in m for m in msg)


def test_a_channel_and_a_base_of_numpy_types_serve_as_ints_and_bools(worlds):
    """``numpy.int64`` channels and ``numpy.bool_`` bases (what a wrapper may forward) pick the
    channel and base they name; None as the base is refused (in ``bad_calls``)."""
    w = worlds(2)
    w.run(rc.make_comm, "types", max_tokens=2, num_heads=4, head_dim=16, channels=2)
    for channel, base_e in ((np.int64(1), np.False_), (np.int32(0), np.True_)):
        errs = w.run(rc.lse_case, "types", fresh_seed(), 2, channel=channel, base_e=base_e, use_out=True)
        assert max(errs) <= rc.TOL[torch.bfloat16], errs
    w.run(rc.close_comm, "types")


@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_tokens=2, num_heads=7, head_dim=16), "num_heads"),
    (dict(max_tokens=2, num_heads=6, head_dim=12), "head_dim"),
    (dict(max_tokens=2, num_heads=6, head_dim=2048), "head_dim"),
    (dict(max_tokens=0, num_heads=6, head_dim=16), "max_tokens"),
    (dict(max_tokens=2, num_heads=6, head_dim=16, num_warps=3), "num_warps"),
    (dict(max_tokens=2, num_heads=6, head_dim=16, max_programs=0), "max_programs"),
    (dict(max_tokens=2, num_heads=6, head_dim=16, pdl=True), "pdl"),  # CPU: no programmatic launch
    (dict(max_tokens=2, head_dim=16), "num_heads must be given"),  # a careless caller's defaults
    (dict(max_tokens=2), "num_heads and head_dim must be given"),
])
def test_bad_geometry_fails_on_every_rank(worlds, kwargs, needle):
    msgs = worlds(3).run(rc.construct_expect_error, **kwargs)
    assert len(set(msgs)) == 1 and needle in msgs[0]


def test_ranks_disagreeing_on_geometry_fail_together(worlds):
    w = worlds(3)
    # rank-dependent max_tokens: sent separately to each rank
    msgs = []
    for r in range(3):
        w.conns[r].send((rc.construct_expect_error.__module__, "construct_expect_error", (),
                         dict(max_tokens=2 + r, num_heads=6, head_dim=16)))
    msgs = w._collect(range(3), 120)
    assert len(set(msgs)) == 1 and "disagree" in msgs[0]
    assert msgs[0].endswith(": max_tokens: rank 0 has 2, rank 1 has 3, rank 2 has 4"), msgs[0]


def test_a_geometry_mismatch_names_the_fields_that_differ(worlds):
    """Issue 42: each field that differs with each rank's value, not every rank's whole tuple."""
    from tests import lockstep_cases as lc

    msgs = worlds(2).run(lc.construct_per_rank, {0: dict(head_dim=64), 1: dict(head_dim=128, query_dim=96,
                                                                                 query_dtype=torch.float16)},
                         max_tokens=8, num_heads=4)
    assert len(set(msgs)) == 1, msgs
    assert msgs[0] == ("DcpError: ranks disagree on the DcpAllToAll geometry (every rank must construct it alike): "
                       "head_dim: rank 0 has 64, rank 1 has 128; query_dim: rank 0 has 64, rank 1 has 96; "
                       "query_dtype: rank 0 has torch.bfloat16, rank 1 has torch.float16"), msgs[0]


def test_ranks_of_another_wire_revision_fail_together(worlds):
    """A rank running another release of the exchange's layout (its rows would be misread, not
    refused, by the kernels) fails construction on every rank, naming it."""
    from tests import lockstep_cases as lc
    from dcp.constants import WIRE_REVISION

    msgs = worlds(2).run(lc.construct_with_wire_revision, {1: WIRE_REVISION - 1}, max_tokens=8, num_heads=4,
                         head_dim=64)
    assert len(set(msgs)) == 1, msgs
    assert msgs[0].endswith(f": wire_revision: rank 0 has {WIRE_REVISION}, rank 1 has {WIRE_REVISION - 1}"), msgs[0]


def test_geometry_disagreement_groups_ranks_by_value():
    from dcp.checks import geometry_disagreement

    base = dict(max_tokens=8, num_heads=16, head_dim=2, dtype="torch.bfloat16", DCP_A2A_MEASURE=10)
    geometries = [base] * 8
    geometries[3] = dict(base, head_dim=128, DCP_A2A_MEASURE=True)
    text = geometry_disagreement(geometries)
    assert text.endswith(": head_dim: ranks 0-2, 4-7 have 2, rank 3 has 128; "
                         "DCP_A2A_MEASURE: ranks 0-2, 4-7 have 10, rank 3 has True"), text
    # A rank of an older release, whose geometry lacks a field, is named by that field too.
    text = geometry_disagreement([dict(base, wire_revision=2), base])
    assert text.endswith(": wire_revision: rank 0 has 2, rank 1 has None"), text
    text = geometry_disagreement([base, dict(base, wire_revision=2)])  # (the older one at rank 0)
    assert text.endswith(": wire_revision: rank 0 has None, rank 1 has 2"), text


def test_ranks_share_the_constructors_compiles(worlds):
    """Each (LSE dtype, tiling) pair is compiled by exactly one rank first (Triton's disk cache
    then serves the others); the CPU grid gives this layout several tilings."""
    res = worlds(3).run(rc.construct_recording_compiles, max_tokens=200, num_heads=48, head_dim=64, query_dim=96)
    tilings, gather_tilings = res[0][1], res[0][2]
    assert len(tilings) >= 3, tilings
    done = [(lse, w) for loads, _, _ in res for lse, ws in loads for w in ws]
    want = [(t, w) for t in ("torch.float32", "torch.bfloat16", "torch.float16") for w in tilings]
    assert sorted(done) == sorted(want + [("gather", w) for w in gather_tilings])
    assert all(loads for loads, _, _ in res), "a rank compiled nothing"


def test_a_rank_failing_to_compile_fails_construction_everywhere(worlds):
    msgs = worlds(3).run(rc.construct_recording_compiles, fail_rank=1, max_tokens=8, num_heads=6, head_dim=16)
    assert len(set(msgs)) == 1
    assert "compiling the kernels failed on 1 rank(s): rank 1: RuntimeError: injected compile failure" in msgs[0]


def test_rank_errors_are_reported(worlds):
    with pytest.raises(RankError):
        worlds(2).run(rc.lse_case, "missing-key", 0, B=1)


def test_trace_records_every_call_in_order(worlds):
    """The opt-in trace: one record per call and program, stamps in protocol order; the bench's
    phase split reads them."""
    from bench.trace import PHASES, phases

    calls, B = 5, 40
    recs = worlds(3).run(rc.traced_calls, fresh_seed(), B=B, calls=calls)
    lay = ChannelLayout(world=3, heads_per_rank=2, head_dim=16, max_tokens=B, programs=4)  # the CPU's grid
    programs = min(lay.tiles(B, lay.warps_for(B)), 4)  # tiles, at most the grid
    assert programs > 1
    for r in recs:
        assert r.shape[0] == calls and list(r[:, 0, 0]) == list(range(1, calls + 1))
        used = r[..., 1] > 0
        n_used = used.sum(-1)
        assert (n_used == programs).all()
        assert (r[~used] == 0).all(), "a program that did not run left a record"
        stamps = r[used][:, 1:]
        assert (stamps > 0).all() and (stamps[:, 1:] >= stamps[:, :-1]).all(), "stamps out of protocol order"
        assert (r[used][:, 0] == np.repeat(np.arange(1, calls + 1), n_used[0])).all()
    split = phases(recs, calls=calls)  # as if one graph held them all
    assert split["period"] > 0 and all(np.isfinite(split[k]) for k in PHASES)
    assert split["programs"] == programs


def test_the_docstrings_are_enough_to_use_the_api():
    """``help(DcpAllToAll)`` states the limits, defaults and meanings the README also gives."""
    import inspect

    from dcp import DcpAllToAll

    sig = inspect.signature(DcpAllToAll)
    assert sig.parameters["num_heads"].default is None and sig.parameters["head_dim"].default is None
    doc = inspect.getdoc(DcpAllToAll)
    for fact in ("multiple of N", "multiple of 8 up to 1024", "torch.float32", "float8_e4m3fn", "10 s on GPUs",
                 "120 s on the CPU", "backend_reason", "DCP_A2A_BACKEND", "chunks of ``max_tokens``",
                 "different channels", "DcpTimeoutError", "DcpMismatchError"):
        assert fact in " ".join(doc.split()), fact
    reduce_doc = " ".join(inspect.getdoc(DcpAllToAll.lse_reduce).split())
    for fact in ("is_lse_base_on_e", "base e", "base 2", "every rank must agree", "NaN or +inf counts as -inf",
                 "seq_lens", "query_start_loc", "fp32"):
        assert fact in reduce_doc, fact
    gather_doc = " ".join(inspect.getdoc(DcpAllToAll.all_gather_heads).split())
    assert "bit for bit" in gather_doc and "head-sliced view" in gather_doc


def test_every_tiling_is_a_power_of_two_of_whole_units():
    """tl.arange needs powers of two: rows per tile (the combine) and chunks per tile (the gather),
    for every group size, row width (16-bit words, multiples of 8), warps and max_tokens; a
    gather chunk is a power of two of at least 8 words that divides its row."""
    from dcp.protocol import ChannelLayout

    for n in range(2, 9):
        for words in range(8, 1025, 8):
            for max_tokens in (1, 4, 64, 512):
                for lse in (True, False):
                    lay = ChannelLayout(n, 16, words, max_tokens, lse=lse)
                    for w in (1, 2, 4, 8, 16):
                        units = lay.rows_per_tile(w)
                        assert units & (units - 1) == 0, (n, words, max_tokens, lse, w, units)
                    cw = lay.chunk_words  # the combine: one padded block a row; the gather: whole chunks
                    assert cw & (cw - 1) == 0 and (cw >= words if lse else words % cw == 0 and cw >= 8), (words, cw)


def _wire_layout() -> str:
    """What ranks exchange, as numbers: each collective's rows and tiling (and which tilings publish a
    flag per program) and the channel's offsets at a spread of geometries, and the flags' encoding
    (epoch and tag fields)."""
    import hashlib
    from dcp import constants as k
    from dcp.protocol import STATE_BYTES, ChannelLayout, ChannelRegion

    facts = [k.EPOCH_SHIFT, k.TAG_KIND_SHIFT, k.TAG_BASE2, k.TAG_ABORT, k.TAG_POISONED, k.TAG_NONE, k.TAG_LOAD,
             k.TAG_GAVE_UP, k.KIND_COMBINE, k.KIND_GATHER, STATE_BYTES]
    for world, hpr, dim, value_words, qwords, tokens, warps, programs in [
            (2, 16, 512, 1, 576, 1, None, 132), (3, 16, 512, 1, 576, 512, None, 132), (6, 8, 128, 2, 96, 64, None, 78),
            (8, 4, 64, 1, 64, 300, 4, 16), (5, 3, 24, 2, 40, 7, None, 1)]:
        combine = ChannelLayout(world, hpr, dim, tokens, warps, programs, value_words=value_words)
        gather = ChannelLayout(world, hpr, qwords, tokens, warps, programs, lse=False)
        region = ChannelRegion((combine, gather))
        facts.append((region.flag_offset, region.recv_offset, region.slot_elems, region.nbytes, region.tiles_max))
        for lay in (combine, gather):
            facts.append((lay.row_elems, lay.lse_offset, lay.chunk_words, lay.chunks, lay.warps_by_size,
                          sorted(lay.tilings.items()), lay.tiles_max, [lay.one_wait(w) for w in sorted(lay.tilings)]))
    return hashlib.sha256(repr(facts).encode()).hexdigest()[:16]


# WIRE_REVISION -> _wire_layout() of that revision (append one with each new revision). 1: the
# layout of the releases before it was agreed (16-byte combine rows; computed at cc3b5b7's parent).
WIRE_LAYOUTS = {1: "7aea1fecde3e3966", 2: "6972127726354fe8", 3: "280d601dea346f9a", 4: "e88d4d2a4b9c833c"}


def test_a_change_to_the_wire_layout_raises_the_wire_revision():
    """Ranks of two releases pair only if their layouts agree, and construction compares
    ``WIRE_REVISION`` alone: a layout change that leaves it as it was would be misread, not refused."""
    from dcp.constants import WIRE_REVISION

    assert WIRE_REVISION in WIRE_LAYOUTS, f"record WIRE_LAYOUTS[{WIRE_REVISION}] = {_wire_layout()!r}"
    assert _wire_layout() == WIRE_LAYOUTS[WIRE_REVISION], (
        f"the wire layout changed ({_wire_layout()!r}) but WIRE_REVISION is still {WIRE_REVISION}: raise it in "
        "dcp/constants.py and record the new layout in WIRE_LAYOUTS")
    assert len(set(WIRE_LAYOUTS.values())) == len(WIRE_LAYOUTS), "two revisions with one layout"


def _bytes(t: torch.Tensor) -> set:
    """Every byte address a tensor's elements occupy."""
    idx = torch.zeros(t.shape, dtype=torch.int64)
    for dim, (n, st) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.dim()
        shape[dim] = n
        idx = idx + (torch.arange(n) * st).view(shape)
    first = t.data_ptr() + idx.flatten() * t.element_size()
    return {a + k for a in first.tolist() for k in range(t.element_size())}


def test_outputs_apart_passes_only_outputs_that_share_no_byte():
    """The call's quick overlap test (``outputs_apart``; where it fails, the exact checks run): on
    random views of one allocation (bf16 rows and LSEs of each dtype, offsets, token and head strides,
    some of them too small or 0, with and without ``out_lse``) it may say "apart" only where no output
    byte is an input's, the other output's or its own other element's, and it must for tensors of
    their own."""
    from dcp.launch import launch_operands, outputs_apart

    g = torch.Generator().manual_seed(fresh_seed())
    hn, h, d = 2, 4, 8
    geometry = (hn, h, d, torch.device("cpu"), torch.bfloat16)
    memory = torch.empty(4096, dtype=torch.uint8).untyped_storage()

    def draw(n):
        return int(torch.randint(0, n, (1,), generator=g))

    def pick(usual, rare):  # mostly strides that clear a row, now and then one that does not
        return (rare if draw(4) == 0 else usual)[draw(2)]

    def view(dtype, B, heads, width=None):
        unit = width or 1
        s_h = pick((unit, unit + 8), (0, unit // 2))
        s_b = pick((heads * s_h, heads * s_h + 8), (0, s_h))
        off = draw(1200 // dtype.itemsize)
        if width and draw(2):
            off -= off % 8  # 16-byte aligned rows: the variant whose strides go divided by 8
        shape, strides = ((B, heads, width), (s_b, s_h, 1)) if width else ((B, heads), (s_b, s_h))
        return torch.empty(0, dtype=dtype).set_(memory, off, shape, strides)

    def shares(a: set, t: torch.Tensor) -> bool:
        return len(a) < t.numel() * t.element_size()  # (an element sharing bytes with another)

    seen = {"apart": 0, "shared": 0, "aligned": 0, "self": 0}
    for trial in range(800):
        B = draw(4)
        po, y = view(torch.bfloat16, B, h, d), view(torch.bfloat16, B, hn, d)
        lse = view([torch.float32, torch.bfloat16, torch.float16][trial % 3], B, h)
        y_lse = view(torch.float32, B, hn) if trial % 2 else None
        operands = launch_operands(po, lse, y, y_lse)
        apart = outputs_apart(geometry, B, operands)
        ins, outs = _bytes(po) | _bytes(lse), [(_bytes(t), t) for t in (y, y_lse) if t is not None]
        self_shared = any(shares(b, t) for b, t in outs)
        shared = self_shared or any(b & ins for b, _ in outs) or (len(outs) == 2 and bool(outs[0][0] & outs[1][0]))
        assert not (apart and shared), (trial, B, [(t.storage_offset(), t.stride()) for t in (po, lse, y, y_lse)
                                                   if t is not None])
        seen["apart"] += apart
        seen["shared"] += shared
        seen["self"] += self_shared
        seen["aligned"] += operands[0][1]
    assert min(seen.values()) > 60, seen  # every case was drawn
    po, lse = torch.randn(3, h, d).to(torch.bfloat16), torch.randn(3, h)
    y, y_lse = torch.empty(3, hn, d, dtype=torch.bfloat16), torch.empty(3, hn)
    assert outputs_apart(geometry, 3, launch_operands(po, lse, y, y_lse))


def test_the_self_overlap_checks_agree_with_the_bytes():
    """``rows_disjoint`` (the quick test) says "disjoint" only where no two elements share memory,
    and ``refuse_self_overlap`` (the exact one) raises exactly where two do, on random strides."""
    from dcp.checks import refuse_self_overlap, rows_disjoint

    g = torch.Generator().manual_seed(fresh_seed())
    memory = torch.empty(1 << 14, dtype=torch.float32).untyped_storage()
    counts = {"disjoint": 0, "overlap": 0, "exact_only": 0}
    for _ in range(600):
        n0, n1, width = (int(v) for v in torch.randint(1, 5, (3,), generator=g))
        s0, s1 = (int(v) for v in torch.randint(0, 3 * width * 4, (2,), generator=g))
        t = torch.empty(0).set_(memory, 0, (n0, n1, width), (s0, s1, 1))
        overlap = len(_bytes(t)) < t.numel() * 4
        quick = rows_disjoint(n0, s0, n1, s1, width)
        assert not (quick and overlap), (n0, s0, n1, s1, width)
        try:
            refuse_self_overlap("out", t)
            raised = False
        except ValueError as exc:
            raised = "overlap each other" in str(exc)
        assert raised == overlap, (n0, s0, n1, s1, width)
        counts["disjoint"] += quick
        counts["overlap"] += overlap
        counts["exact_only"] += not quick and not overlap
    assert min(counts.values()) > 30, counts
