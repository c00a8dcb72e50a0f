"""The pull transport on the CPU tier: each rank stages its packed rows in its own buffer and reads
its rows from its peers'. The same kernel and protocol as the push (``test_cpu_tier``,
``test_gather``, ``test_lockstep``), so these are the same checks with ``backend="pull"``."""

import pytest

from tests import gather_cases as gc
from tests import lockstep_cases as lc
from tests import rank_cases as rc
from tests.conftest import fresh_seed
from tests.test_cpu_tier import GEOMETRY, MAX_TOKENS
from tests.test_gather import GEOMETRY as QUERIES


def _backend(state, key: str) -> str:
    return state[key].backend


@pytest.mark.parametrize("n", sorted(GEOMETRY))
def test_pull_combine_and_gather_match_the_reference(worlds, n):
    """Every group size: combines (chunked above max_tokens, base 2, strided, NaN specials) against
    the float64 reference and gathers byte for byte, interleaved on one channel."""
    w = worlds(n)
    hn, d = GEOMETRY[n]
    _, dq, qdt = QUERIES[n]
    seed = fresh_seed()
    w.run(rc.make_comm, "pull", max_tokens=MAX_TOKENS, num_heads=hn * n, head_dim=d, query_dim=dq,
          query_dtype=gc.QUERY_DTYPES[qdt], backend="pull")
    assert w.run(_backend, "pull") == ["pull"] * n
    cases = [dict(B=1, base_e=True, return_lse=True), dict(B=2 * MAX_TOKENS + 1, return_lse=False, special=True),
             dict(B=3, strided=True, lse_dtype="bfloat16", use_out=True, base_e=False)]
    for i, case in enumerate(cases):
        w.run(rc.lse_case, "pull", seed + i, **case)
        w.run(gc.gather_case, "pull", seed + 10 + i, B=case["B"], use_out=i == 1, strided=i == 2)
    w.run(rc.close_comm, "pull")
    assert w.run(rc.shm_segments, ranks=[0]) == [[]]


def test_pull_lockstep_failures_are_told_on_every_rank(worlds):
    """A rank rejecting its call, B = 0 on one rank, sizes that differ: every rank fails the call
    at once naming the rank that caused it, as with the push."""
    w = worlds(3)
    w.run(rc.make_comm, "ls", max_tokens=4, num_heads=6, head_dim=16, backend="pull")
    res = w.run(lc.rejecting_rank, "ls", fresh_seed(), bad_rank=2)
    assert all("rank 2 rejected its call before launch" in r["first"] for r in res[:2]), res
    w.run(rc.make_comm, "ls", max_tokens=4, num_heads=6, head_dim=16, backend="pull")
    res = w.run(lc.rank_sizes, "ls", fresh_seed(), sizes=[0, 2, 2])
    assert all("rank 0 ran a combine of B=0" in r["first"] for r in res[1:]), res
    w.run(rc.make_comm, "ls", max_tokens=4, num_heads=6, head_dim=16, backend="pull")
    res = w.run(lc.rank_sizes, "ls", fresh_seed(), sizes=[8, 4, 4])
    # Rank 0 fails as soon as one peer's B=4 shows (the other may not have sent yet: CI saw "rank 1
    # sent nothing of this call; rank 2 ran a combine of B=4"); the peers wait for rank 0's B=8.
    told = {r: f"rank {r} ran a combine of B=4" in res[0]["first"] for r in (1, 2)}
    assert any(told.values()) and all(told[r] or f"rank {r} sent nothing of this call" in res[0]["first"]
                                      for r in (1, 2)), res[0]
    assert all("rank 0 ran a combine of B=8" in r["first"] for r in res[1:]), res
    w.run(rc.close_comm, "ls")


def test_pull_timeout_names_the_missing_rank_on_every_rank(worlds):
    w = worlds(3)
    w.run(rc.make_comm, "to", max_tokens=4, num_heads=6, head_dim=16, timeout_s=2.0, backend="pull")
    res = w.run(rc.expect_timeout, "to", ranks=[0, 1], timeout=120) + w.run(rc.expect_timeout, "to", ranks=[2],
                                                                             timeout=120)
    for rank, r in enumerate(res):
        assert r["message"].startswith(f"DCP all-to-all timed out waiting for rank(s) [2] (rank {rank}, "), r
    w.run(rc.close_comm, "to")


def test_ranks_asking_for_different_transports_fail_construction_together(worlds):
    """push (another name of triton) on one rank, pull on the others: refused on every rank."""
    w = worlds(3)
    for r in range(3):
        w.conns[r].send((rc.construct_expect_error.__module__, "construct_expect_error", (),
                         dict(max_tokens=2, num_heads=6, head_dim=16, backend="push" if r == 0 else "pull")))
    msgs = w._collect(range(3), 120)
    assert len(set(msgs)) == 1 and msgs[0].endswith(": backend: rank 0 has triton, ranks 1, 2 have pull"), msgs
    w.run(rc.make_comm, "alias", max_tokens=2, num_heads=6, head_dim=16, backend="push")
    assert w.run(_backend, "alias") == ["triton"] * 3
    w.run(rc.close_comm, "alias")
