"""CPU tier: the real kernels under Triton's interpreter, one process per rank, host shared memory."""

import numpy as np
import pytest

from tests import rank_cases as rc
from tests.conftest import fresh_seed
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


def test_small_and_large_call_tilings_alternate(worlds):
    """Calls from LARGE_CALL_TOKENS up run with larger tiles than smaller ones; consecutive calls of
    either kind (and the chunks of one call) share the slots and flags."""
    w = worlds(3)
    seed = fresh_seed()
    w.run(rc.make_comm, "tiles", max_tokens=LARGE_CALL_TOKENS + 8, num_heads=3, head_dim=128)
    lay = ChannelLayout(world=3, heads_per_rank=1, head_dim=128, max_tokens=LARGE_CALL_TOKENS + 8)
    assert len(set(lay.tilings.values())) == 2
    # programmatic launch (GPU only) for the small calls' tiling, or for the one a user fixes
    assert [lay.launches_early(w) for w in sorted(lay.tilings)] == [True, False]
    assert ChannelLayout(3, 1, 128, 512, num_warps=16).launches_early(16)
    # what the communicator reports for each size (interpreted: no programmatic launch); a chunked
    # call runs in launches of max_tokens
    got = w.run(rc.tilings, "tiles", [1, LARGE_CALL_TOKENS - 1, LARGE_CALL_TOKENS, 10 ** 6, 0])
    assert got == [[(8, False), (8, False), (16, False), (16, False),
                    "n_tokens: expected a positive integer, got 0"]] * 3
    w.run(rc.make_comm, "nccl", max_tokens=LARGE_CALL_TOKENS + 8, num_heads=3, head_dim=128, backend="nccl")
    assert w.run(rc.tilings, "nccl", [1, LARGE_CALL_TOKENS]) == [[(8, False)] * 2] * 3  # one tiling
    w.run(rc.close_comm, "nccl")
    sizes = [LARGE_CALL_TOKENS, 5, LARGE_CALL_TOKENS + 8, 2 * LARGE_CALL_TOKENS + 30, 1]  # the fourth is chunked
    for i, B in enumerate(sizes):
        w.run(rc.lse_case, "tiles", seed + i, B=B, use_out=True, special=i % 2 == 0)
    w.run(rc.close_comm, "tiles")


def test_bad_calls_raise_clear_errors(worlds):
    w = worlds(3)
    w.run(rc.make_comm, "err", max_tokens=2, num_heads=6, head_dim=16)
    messages = w.run(rc.bad_calls, "err")
    assert all(len(m) == len(messages[0]) for m in messages)
    w.run(rc.close_comm, "err")
    msg = w.run(rc.call_after_close)
    assert all("closed" in m for m in msg)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_tokens=2, num_heads=7, head_dim=16), "num_heads"),
    (dict(max_tokens=2, num_heads=6, head_dim=12), "head_dim"),
    (dict(max_tokens=2, num_heads=6, head_dim=2048), "head_dim"),
    (dict(max_tokens=0, num_heads=6, head_dim=16), "max_tokens"),
    (dict(max_tokens=2, num_heads=6, head_dim=16, num_warps=3), "num_warps"),
    (dict(max_tokens=2, num_heads=6, head_dim=16, pdl=True), "pdl"),  # CPU: no programmatic launch
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


def test_rank_errors_are_reported(worlds):
    with pytest.raises(RankError):
        worlds(2).run(rc.lse_case, "missing-key", 0, B=1)


def test_trace_records_every_call_in_order(worlds):
    """The opt-in trace: one record per call and program, stamps in protocol order; the bench's
    phase split reads them."""
    from bench.trace import PHASES, phases

    calls, B = 5, 40
    recs = worlds(3).run(rc.traced_calls, fresh_seed(), B=B, calls=calls)
    lay = ChannelLayout(world=3, heads_per_rank=2, head_dim=16, max_tokens=B)
    programs = min(lay.tiles(B, lay.warps_for(B)), 4)  # tiles, at most the CPU's 4 programs
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
