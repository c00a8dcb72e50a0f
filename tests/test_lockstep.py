"""Never a silent wrong result (CPU tier): every call stays collective, whatever one rank does.

Each test is a case of docs/design.md's lockstep rule: a call returns normally only if every row it
wrote is the exact result of the same call on every rank; otherwise every rank of that call raises,
or the next call on the channel raises on every rank, until the communicator is rebuilt.
"""

import math

import pytest

from dcp.protocol import POISONED_NOTE
from dcp.spawn import World
from tests import lockstep_cases as lc
from tests import rank_cases as rc
from tests.conftest import fresh_seed

TIMEOUT_S = 30.0  # long: these failures must be found at once, not by a timeout
FAST_S = 10.0


def _comm(w, key="ls", **kw):
    n = w.n
    kw = dict(dict(max_tokens=4, num_heads=2 * n, head_dim=16, timeout_s=TIMEOUT_S), **kw)
    w.run(rc.make_comm, key, **kw)


def _poisoned_everywhere(results):
    for r in results:
        assert POISONED_NOTE in r["next"], r["next"]


@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_rejecting_its_call_fails_the_call_everywhere(worlds, n):
    w = worlds(n)
    _comm(w)
    res = w.run(lc.rejecting_rank, "ls", fresh_seed(), bad_rank=n - 1)
    assert res[-1]["first"].startswith("TypeError")
    for r in res[:-1]:
        assert f"rank {n - 1} rejected its call before launch" in r["first"], r["first"]
        assert r["elapsed"] < FAST_S, r  # told at once, not after the timeout
    _poisoned_everywhere(res)
    w.run(rc.close_comm, "ls")


def test_a_rank_rejecting_its_batch_metadata_fails_the_call_everywhere(worlds):
    w = worlds(2)
    _comm(w)
    res = w.run(lc.rejecting_rank, "ls", fresh_seed(), bad_rank=0, how="metadata")
    assert res[0]["first"] == "ValueError: query_start_loc must contain one boundary per sequence", res[0]
    assert "rank 0 rejected its call before launch" in res[1]["first"] and res[1]["elapsed"] < FAST_S, res[1]
    _poisoned_everywhere(res)
    w.run(rc.close_comm, "ls")


def test_a_call_every_rank_rejects_leaves_the_channel_in_step(worlds):
    w = worlds(3)
    _comm(w)
    assert all(e <= rc.TOL[rc.DTYPES["bfloat16"]] for e in w.run(lc.every_rank_rejects, "ls", fresh_seed()))
    w.run(rc.close_comm, "ls")


@pytest.mark.parametrize("rejecting", [[0], [0, 1, 2]])
def test_a_call_rejected_on_the_nccl_path_leaves_the_rank_raising(worlds, rejecting):
    """The NCCL path cannot announce a rejected call: instead of pairing its peers' call with its
    next one, the rejecting rank raises at every later call (on every channel), even where every
    rank rejected the same call."""
    w = worlds(3)
    w.run(rc.make_comm, "nccl", max_tokens=2, num_heads=6, head_dim=16, backend="nccl", channels=2)
    for r, res in enumerate(w.run(lc.nccl_rejects, "nccl", fresh_seed(), rejecting)):
        assert res["err"] <= rc.TOL[rc.DTYPES["bfloat16"]], res
        if r in rejecting:
            assert "overlaps partial_out" in res["rejected"], res
            for msg in res["next"] + [res["gather"], res["check"]]:
                assert "poisoned: a call on channel 0 was rejected on this rank, and on the NCCL path" in msg, res
        else:
            assert set(res) == {"err"}, res
    w.run(rc.close_comm, "nccl")


def test_a_busy_channel_on_the_nccl_path_poisons_every_channel(worlds):
    w = worlds(2)
    w.run(rc.make_comm, "nccl", max_tokens=2, num_heads=4, head_dim=16, backend="nccl", channels=2)
    res = w.run(lc.nccl_busy_channel, "nccl", fresh_seed())
    assert all(r["first"] <= rc.TOL[rc.DTYPES["bfloat16"]] for r in res), res
    assert "busy" in res[0]["refused"], res[0]
    assert "channel 1 is poisoned: two threads called on channel 0 at once" in res[0]["ch1"], res[0]
    w.run(rc.close_comm, "nccl")


@pytest.mark.parametrize("n", [2, 3])
def test_b_zero_on_one_rank_fails_the_call_everywhere(worlds, n):
    w = worlds(n)
    _comm(w)
    res = w.run(lc.rank_sizes, "ls", fresh_seed(), sizes=[0] + [2] * (n - 1))
    assert "this rank ran a combine of B=0" in res[0]["first"], res[0]
    assert all("rank 0 " in r["first"] and "B=0" in r["first"] for r in res[1:]), res
    assert all(r["elapsed"] < FAST_S for r in res), res
    _poisoned_everywhere(res)
    _comm(w)
    assert all(e == 0 or e <= rc.TOL[rc.DTYPES["bfloat16"]] for e in w.run(lc.everyone_empty, "ls", fresh_seed()))
    w.run(rc.close_comm, "ls")


def test_sizes_differing_by_whole_chunks_are_told(worlds):
    """B = 8 against B = 4 with max_tokens = 4: the first launches match in size, not in call."""
    w = worlds(2)
    _comm(w)
    res = w.run(lc.rank_sizes, "ls", fresh_seed(), sizes=[8, 4])
    assert "B=8" in res[0]["first"] and "rank 1 ran a combine of B=4" in res[0]["first"], res
    assert "B=4" in res[1]["first"] and "rank 0 ran a combine of B=8" in res[1]["first"], res
    _poisoned_everywhere(res)
    w.run(rc.close_comm, "ls")


def test_ranks_with_lses_of_different_bases_are_told(worlds):
    w = worlds(2)
    _comm(w)
    res = w.run(lc.lse_bases, "ls", fresh_seed(), [True, False])
    assert "combine of B=2 (LSE base e); rank 1 ran a combine of B=2 (LSE base 2)" in res[0]["first"], res
    assert "combine of B=2 (LSE base 2); rank 0 ran a combine of B=2 (LSE base e)" in res[1]["first"], res
    _poisoned_everywhere(res)
    w.run(rc.close_comm, "ls")


def test_two_threads_on_one_channel(worlds):
    w = worlds(2)
    _comm(w)
    res = w.run(lc.two_threads_one_channel, "ls", fresh_seed())
    assert "busy" in res[0]["refused"], res[0]
    assert all(r["first"] <= rc.TOL[rc.DTYPES["bfloat16"]] for r in res)
    _poisoned_everywhere(res)
    w.run(rc.close_comm, "ls")


def test_two_threads_on_two_channels_on_the_cpu(worlds):
    w = worlds(2)
    _comm(w, channels=2)
    res = w.run(lc.two_threads_two_channels_cpu, "ls", fresh_seed())
    assert "interpreter" in res[0]["refused"], res[0]
    assert "poisoned" in res[0]["ch1"] and "rank 0 had already failed" in res[1]["ch1"], res
    assert all(r["first"] <= rc.TOL[rc.DTYPES["bfloat16"]] for r in res)
    assert all(r["ch0_after"] <= rc.TOL[rc.DTYPES["bfloat16"]] for r in res)
    w.run(rc.close_comm, "ls")


def test_outputs_overlapping_inputs_are_refused(worlds):
    """(and bad_calls in test_cpu_tier covers out aliasing partial_out, out_lse aliasing partial_lse)"""
    w = worlds(2)
    _comm(w, max_tokens=2)  # the shifted alias spans several launches
    w.run(lc.every_rank_rejects, "ls", fresh_seed())
    w.run(rc.close_comm, "ls")


@pytest.mark.parametrize("n", [2, 3])
def test_bf16_near_its_maximum_stays_finite(worlds, n):
    w = worlds(n)
    _comm(w)
    for r in w.run(lc.near_dtype_max, "ls", fresh_seed()):
        assert r["ref_finite"] and r["finite"] and r["err"] <= rc.TOL[rc.DTYPES["bfloat16"]], r
    w.run(rc.close_comm, "ls")


def test_close_from_another_thread_waits_for_the_call(worlds):
    w = worlds(2)
    _comm(w)
    res = w.run(lc.close_while_calling, "ls", fresh_seed())
    assert all(r["closed"] and r["err"] <= rc.TOL[rc.DTYPES["bfloat16"]] for r in res), res
    assert w.run(rc.shm_segments, ranks=[0]) == [[]]


def test_close_from_the_watchdogs_on_error(worlds):
    res = worlds(3).run(lc.close_from_on_error, 1.0)[0]
    assert res["seen"] and "timed out" in res["seen"][0], res
    assert res["errors"] == [] and res["closed"] and res["released"], res


def test_a_rank_dying_during_construction_leaves_no_segment():
    w = World(2)
    try:
        for r in range(2):
            w.conns[r].send((lc.construct_dying.__module__, "construct_dying", (1,), {}))
        w.procs[1].join(60)
        assert w.procs[1].exitcode == 17
        res = w._collect([0], 120)[0]
        assert res["message"].startswith("DcpPeerLostError: host shared memory setup: a peer failed or left"), res
        assert res["segments"] == [], res
    finally:
        w.close(timeout=30)


@pytest.mark.parametrize("bad", [math.nan, math.inf, 1e12, "abc", 0, -1.0, True])
def test_a_bad_timeout_on_one_rank_fails_on_every_rank(worlds, bad):
    msgs = worlds(2).run(lc.construct_per_rank, {1: dict(timeout_s=bad)}, max_tokens=4, num_heads=4,
                         head_dim=16, timeout_s=5.0)
    assert len(set(msgs)) == 1 and "rank 1: timeout_s" in msgs[0], msgs


@pytest.mark.parametrize("per_rank, needle", [
    ({1: dict(device="meta")}, "rank 1: device must be cuda or cpu"),
    ({0: dict(device="no-such-device")}, "rank 0: device"),
    ({1: dict(max_tokens="4")}, "rank 1: max_tokens must be an integer"),
    ({2: dict(head_dim=16.0)}, "rank 2: head_dim must be an integer"),
    ({2: dict(channels=0)}, "rank 2: channels"),
    ({0: dict(backend="bogus")}, "rank 0: backend"),
])
def test_a_bad_argument_on_one_rank_fails_on_every_rank(worlds, per_rank, needle):
    msgs = worlds(3).run(lc.construct_per_rank, per_rank, max_tokens=4, num_heads=6, head_dim=16)
    assert len(set(msgs)) == 1 and needle in msgs[0], msgs


def test_integer_like_arguments_are_integers(worlds):
    assert all(e <= rc.TOL[rc.DTYPES["bfloat16"]] for e in worlds(2).run(lc.integer_like_arguments, fresh_seed()))


def test_a_rank_outside_the_subgroup_is_told(worlds):
    res = worlds(3).run(lc.outside_the_subgroup, fresh_seed())
    assert res[0].startswith("ok") and res[1].startswith("ok"), res
    assert "not a member" in res[2], res


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_outputs_round_to_nearest_even_as_on_the_gpu(worlds, dtype):
    w = worlds(2)
    _comm(w, dtype=dtype)
    assert all(w.run(lc.rounding_case, "ls", fresh_seed()))
    w.run(rc.close_comm, "ls")
