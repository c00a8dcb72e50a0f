"""Channels, epochs across the wrap, timeouts, peer death, mismatched calls, leaks, soak (CPU tier)."""

import os
import secrets

import pytest

from dcp.buffers import SHM_PREFIX
from dcp.spawn import World
from dcp.constants import EPOCH_PERIOD
from tests import rank_cases as rc
from tests.conftest import check_no_leaks, fresh_seed, pytest_runtest_makereport

SHORT_TIMEOUT_S = 2.0


def test_channels_are_independent_and_odd_call_counts_keep_parity(worlds):
    w = worlds(3)
    w.run(rc.make_comm, "ch", max_tokens=4, num_heads=6, head_dim=16, channels=2)
    # 3 calls on channel 0 for every 1 on channel 1, then the other way round: the two epochs
    # (and slot parities) drift apart while each channel stays correct.
    w.run(rc.channel_mix, "ch", fresh_seed(), [0, 0, 0, 1, 1, 0, 1, 1, 1])
    w.run(rc.close_comm, "ch")


def test_epoch_wraps_around(worlds):
    w = worlds(3)
    w.run(rc.make_comm, "wrap", max_tokens=4, num_heads=6, head_dim=16, channels=2)
    w.run(rc.set_epoch, "wrap", 0, EPOCH_PERIOD - 3)
    w.run(rc.set_epoch, "wrap", 1, EPOCH_PERIOD - 2)
    # 7 calls: channel 0 crosses the wrap after 3 calls, channel 1 after 2, on both slots
    w.run(rc.channel_mix, "wrap", fresh_seed(), [0, 1, 0, 1, 0, 0, 1])
    w.run(rc.close_comm, "wrap")


def test_absent_peers_time_out_naming_them(worlds):
    w = worlds(3)
    w.run(rc.make_comm, "to", max_tokens=4, num_heads=6, head_dim=16, timeout_s=SHORT_TIMEOUT_S)
    res = w.run(rc.expect_timeout, "to", ranks=[0], timeout=120)[0]
    assert res["missing"] == [1, 2] and "[1, 2]" in res["message"]
    assert res["elapsed"] < SHORT_TIMEOUT_S + 5
    # the channel is poisoned now, on every rank: a fresh communicator for the watchdog
    w.run(rc.make_comm, "to", max_tokens=4, num_heads=6, head_dim=16, timeout_s=SHORT_TIMEOUT_S)
    msg = w.run(rc.watchdog_sees_timeout, "to", ranks=[0], timeout=120)[0]
    assert "timed out" in msg
    w.run(rc.close_comm, "to")


def test_the_first_failure_of_a_call_reads_alike_on_every_rank(worlds):
    """Rank 2 skips a call: ranks 0 and 1 both time out naming rank 2 (the first to give up tells
    the other whom it waited for; not "rank 0 had already failed"), and rank 2, coming late to
    that call, names itself."""
    w = worlds(3)
    w.run(rc.make_comm, "alike", max_tokens=4, num_heads=6, head_dim=16, timeout_s=SHORT_TIMEOUT_S)
    res = w.run(rc.expect_timeout, "alike", ranks=[0, 1], timeout=120)
    res += w.run(rc.expect_timeout, "alike", ranks=[2], timeout=120)
    for rank, r in enumerate(res):
        assert r["missing"] == [2], r
        assert r["message"].startswith(f"DCP all-to-all timed out waiting for rank(s) [2] (rank {rank}, "), r
    assert res[2]["elapsed"] < SHORT_TIMEOUT_S, res[2]  # told at once, not after its own timeout
    w.run(rc.close_comm, "alike")


def test_status_texts_name_what_each_rank_did():
    from dcp.constants import STATUS_MISMATCH, STATUS_WORDS, TAG_ABORT, TAG_GAVE_UP
    from dcp.protocol import call_tag, describe_tag, status_error

    words = [0] * STATUS_WORDS
    words[:4] = [STATUS_MISMATCH, 5, 0, TAG_ABORT]
    words[12:14] = [TAG_ABORT, call_tag(0, 3)]
    text = str(status_error(words, 2, 0, 0))
    assert "this rank rejected its call before launch; rank 1 ran a combine of B=3 (LSE base e)" in text, text
    assert describe_tag(TAG_GAVE_UP - 0b101) == "timed out waiting for rank(s) [0, 2]"


def test_a_timeout_names_a_rank_that_announced_another_call_after_the_wait():
    """The words rank 1 recorded in CI (sizes routed apart, test_auto): its wait gave up on rank 0,
    whose next call (announcing its earlier failure) arrived before the kernel recorded the flags,
    and rank 2 retracted the call having seen the same. Rank 0 is named; rank 2, who was there, not."""
    from dcp.constants import STATUS_TIMEOUT, STATUS_WORDS, TAG_GAVE_UP, TAG_NONE, TAG_POISONED
    from dcp.protocol import call_tag, status_error

    own = call_tag(0, 2)
    words = [0] * STATUS_WORDS
    words[:4] = [STATUS_TIMEOUT, 1, 0, own]
    words[12:15] = [TAG_POISONED, own, TAG_GAVE_UP]
    err = status_error(words, 3, 1, 0)
    assert err.missing_ranks == [0] and "waiting for rank(s) [0] (rank 1," in str(err), err
    words[12] = call_tag(0, 3)  # or a call of another size
    assert status_error(words, 3, 1, 0).missing_ranks == [0]
    words[4], words[12] = 1, TAG_NONE  # the plain case: nothing of the call came from rank 0
    assert status_error(words, 3, 1, 0).missing_ranks == [0]


def test_a_timeout_names_a_peer_whose_flag_lands_while_the_failure_is_recorded(worlds):
    """The race of a late peer: its flag, with this call's own tag, lands after the wait's last read
    and before the kernel records the failure (planted in the interpreted kernel). The rank is named
    from what the wait last read, not from a second read that finds it present."""
    w = worlds(2)
    w.run(rc.make_comm, "late", max_tokens=4, num_heads=4, head_dim=16, timeout_s=SHORT_TIMEOUT_S)
    res = w.run(rc.timeout_with_a_late_flag, "late", ranks=[0], timeout=120)[0]
    assert res["missing"] == [1], res
    assert res["message"].startswith("DCP all-to-all timed out waiting for rank(s) [1] (rank 0, "), res
    w.run(rc.close_comm, "late")


def test_programs_recording_one_failure_at_once_name_every_source_either_missed(worlds):
    """Rank 2 skips a call. On rank 0, a second program's record is planted: it gave up on rank 1
    (at its own tile, where rank 1 had not arrived yet) and wrote its words while this program,
    which waited for rank 2, also found the channel unrecorded. Both ranks stay named: a record
    that cleared the other's words could leave no rank named at all."""
    w = worlds(3)
    w.run(rc.make_comm, "race", max_tokens=4, num_heads=6, head_dim=16, timeout_s=SHORT_TIMEOUT_S)
    res = w.run(rc.timeout_with_a_racing_record, "race", ranks=[0, 1], timeout=120)
    res += w.run(rc.expect_timeout, "race", ranks=[2], timeout=120)
    assert res[0]["missing"] == [1, 2], res[0]
    assert res[0]["message"].startswith("DCP all-to-all timed out waiting for rank(s) [1, 2] (rank 0, "), res[0]
    w.run(rc.close_comm, "race")


def test_a_timeout_after_a_tile_that_arrived_is_recorded(worlds):
    """One program walks several tiles; its first arrives, a later one never does (its flag lost on
    rank 1). Every rank must raise naming rank 1: a wait that failed after a good tile was once
    never recorded, so the call returned normally with its rows NaN."""
    w = worlds(2)
    w.run(rc.make_comm, "gap", max_tokens=16, num_heads=8, head_dim=512, timeout_s=SHORT_TIMEOUT_S, max_programs=1)
    res = w.run(rc.timeout_after_a_tile_that_arrived, "gap", 16, 1, timeout=120)
    assert res[1]["flags"] >= 2, res  # rank 1 published more than one tile: the plant took
    assert all(r.get("missing") == [1] for r in res), res
    assert all(", tile 1;" in r["message"] for r in res), res  # (not tile 0: a late rank would fail there)
    w.run(rc.close_comm, "gap")


def test_one_flag_per_program_covers_its_tiles(worlds):
    """In a 16-warp combine a program publishes one flag per destination, after pushing all of its
    tiles, and waits for one flag per source. With one program and four tiles, each rank makes one
    flag store and its rows come out exact on every tile. Then rank 1's flag stores are lost (its
    own included): both ranks raise naming rank 1, their rows NaN."""
    w = worlds(2)
    w.run(rc.make_comm, "one", max_tokens=64, num_heads=8, head_dim=512, timeout_s=SHORT_TIMEOUT_S, max_programs=1,
          num_warps=16)
    seed = fresh_seed()
    for r in w.run(rc.one_wait_flag_lost, "one", seed, 64, -1, timeout=240):
        assert r["one_wait"] and r["grid"] == 1 and r["tiles"] == 4, r
        assert r["flags"] == 1 and r["error"] <= rc.TOL[rc.DTYPES["bfloat16"]], r  # (one flag for 4 tiles)
    for r in w.run(rc.one_wait_flag_lost, "one", seed + 1, 64, 1, timeout=240):
        assert r.get("missing") == [1] and ", tile 0;" in r["message"] and r["nan"], r
        assert 2 <= r["flags"] <= 3, r  # its flag, perhaps a refresh, its retraction
    w.run(rc.close_comm, "one")


@pytest.mark.parametrize("backend,num_warps,B,filler", [("triton", None, 16, 0), ("pull", None, 16, 0),
                                                          ("triton", None, 16, 8), ("triton", 16, 32, 0)])
def test_no_flag_outlives_an_epoch_period(worlds, backend, num_warps, B, filler):
    """A flag at an index that later calls leave alone must not live an epoch period: the next call
    of the same tag at the same epoch would take it for its source's. Rank 1 loses one flag past
    tile 0 in that call: rank 0 raises naming rank 1, where it would otherwise return rows its
    source never published; rank 1 returns, or raises naming itself. The calls between are smaller
    combines, or gathers of more tiles than programs, which publish one flag per program and so
    must refresh the indices past the grid; at 16 warps the call itself publishes one flag per
    program."""
    w = worlds(2)
    w.run(rc.make_comm, "wrap", max_tokens=B, num_heads=8, head_dim=512, timeout_s=SHORT_TIMEOUT_S, max_programs=2,
          backend=backend, num_warps=num_warps)
    if filler:  # more tiles than programs: a gather leaves indices past the grid to its refresh
        assert w.run(rc.gather_tiles, "wrap", filler)[0] > 2
    r0, r1 = w.run(rc.flag_from_a_period_ago, "wrap", fresh_seed(), B, 1, filler, timeout=240)
    assert r1["flags"] >= 2, r1  # rank 1 published more than one tile: the plant took
    assert r0.get("missing") == [1], r0
    assert r1.get("returned") or r1.get("missing") == [1], r1
    w.run(rc.close_comm, "wrap")


def test_peer_death_is_reported_and_survivors_close():
    w = World(3)
    try:
        w.run(rc.make_comm, "dead", max_tokens=4, num_heads=6, head_dim=16, timeout_s=SHORT_TIMEOUT_S)
        w.conns[2].send((rc.exit_now.__module__, "exit_now", (), {}))
        w.procs[2].join(30)
        assert w.procs[2].exitcode == 17
        res = w.run(rc.expect_timeout, "dead", ranks=[0, 1], timeout=120)
        for r in res:
            assert 2 in r["missing"] and r["elapsed"] < SHORT_TIMEOUT_S + 5, r
        w.run(rc.close_comm, "dead", ranks=[0, 1], timeout=120)
        assert w.run(rc.shm_segments, ranks=[0]) == [[]]
    finally:
        w.close(timeout=30)


def test_ranks_with_different_sizes_are_told(worlds):
    w = worlds(3)
    w.run(rc.make_comm, "mm", max_tokens=4, num_heads=6, head_dim=16, timeout_s=SHORT_TIMEOUT_S)
    for r, B in enumerate([3, 2, 3]):
        w.conns[r].send((rc.expect_mismatch.__module__, "expect_mismatch", ("mm", B), {}))
    msgs = w._collect(range(3), 120)
    assert all("entered the same DCP call differently" in m for m in msgs), msgs
    w.run(rc.close_comm, "mm")


def test_leak_checks_ignore_other_users_segments(worlds):
    """A server using the package, or a second test run, on this machine has /dev/shm/dcp-a2a-*
    segments of its own (issue 42): this session's checks count only the segments whose names carry
    its tag, before and after a failed construction, after a good one, and at the end."""
    foreign = [f"{SHM_PREFIX}{secrets.token_hex(12)}-0",  # untagged, as a server's
               f"{SHM_PREFIX}test1x000000-{secrets.token_hex(12)}-1"]  # another test session's
    for path in foreign:
        with open(path, "wb"):
            pass
    try:
        w = worlds(2)
        msgs = w.run(rc.construct_expect_error, max_tokens=2, num_heads=3, head_dim=16)
        assert "num_heads must be a positive multiple" in msgs[0], msgs
        w.run(rc.make_comm, "beside", max_tokens=2, num_heads=4, head_dim=16)
        w.run(rc.close_comm, "beside")
        assert w.run(rc.shm_segments) == [[], []]
        check_no_leaks()
    finally:
        for path in foreign:
            os.unlink(path)


def test_a_leak_of_this_sessions_own_fails_the_check(worlds):
    """The other side: segments this session's ranks leave behind (unlinking turned off) fail it."""
    left = worlds(2).run(rc.leaking_construction)[0]
    try:
        assert len(left) == 2 and all(p.startswith(SHM_PREFIX + os.environ["DCP_A2A_SHM_TAG"] + "-") for p in left)
        with pytest.raises(AssertionError, match="shared-memory segments left behind") as exc:
            check_no_leaks()
        assert all(p in str(exc.value) for p in left)
    finally:
        for path in left:
            os.unlink(path)


def test_a_failed_test_leaves_fresh_worlds_to_the_next(worlds):
    """A failure in one test (its ranks possibly out of step) closes the module's worlds; a skip
    does not."""
    def report(raise_it):
        try:
            raise_it()
        except BaseException:
            call = type("Call", (), {"when": "call", "excinfo": pytest.ExceptionInfo.from_current()})
            pytest_runtest_makereport(None, call)

    def differs():
        raise AssertionError("a rank's result differs")

    first = worlds(2)
    report(lambda: pytest.skip("not this one"))
    assert worlds(2) is first and all(p.is_alive() for p in first.procs)
    report(differs)
    assert not any(p.is_alive() for p in first.procs)
    second = worlds(2)
    assert second is not first and second.run(rc.make_comm, "fresh", max_tokens=2, num_heads=4, head_dim=16)
    second.run(rc.close_comm, "fresh")


def test_construct_close_50_times_leaks_nothing(worlds):
    res = worlds(2).run(rc.construct_close_loop, 50, timeout=300)
    assert all(before == after for before, after in res)


def test_soak_random_sizes_both_channels_across_the_wrap(worlds):
    w = worlds(3)
    w.run(rc.make_comm, "soak", max_tokens=4, num_heads=6, head_dim=16, channels=2)
    w.run(rc.set_epoch, "soak", 0, EPOCH_PERIOD - 20)
    res = w.run(rc.soak, "soak", fresh_seed(), calls=150, check_every=5, timeout=600)
    assert all(r["calls"] == 150 and r["checked"] == 30 for r in res)
    w.run(rc.close_comm, "soak")
