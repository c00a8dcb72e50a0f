"""The query all-gather on the CPU tier: the real kernel under the interpreter, byte-exact checks."""

import pytest
import torch

from tests import gather_cases as gc
from tests import rank_cases as rc
from tests.conftest import fresh_seed

# (N, heads per rank, query dim, query dtype): every group size, every query dtype
GEOMETRY = {2: (3, 40, "bfloat16"), 3: (2, 16, "float8_e4m3fn"), 4: (1, 24, "float32"),
            5: (2, 8, "float16"), 6: (2, 32, "float8_e5m2"), 7: (1, 16, "bfloat16"), 8: (1, 8, "float32")}
MAX_TOKENS = 4


def _comm(w, key, hn, dq, qdt, **kw):
    w.run(rc.make_comm, key, max_tokens=MAX_TOKENS, num_heads=hn * w.n, head_dim=16, query_dim=dq,
          query_dtype=gc.QUERY_DTYPES[qdt], **kw)


@pytest.mark.parametrize("n", sorted(GEOMETRY))
def test_gather_is_bit_exact(worlds, n):
    w = worlds(n)
    hn, dq, qdt = GEOMETRY[n]
    _comm(w, "g", hn, dq, qdt)
    seed = fresh_seed()
    cases = [dict(B=1), dict(B=MAX_TOKENS, use_out=True), dict(B=2 * MAX_TOKENS + 1, strided=True, padded_out=True)]
    for i, case in enumerate(cases):
        w.run(gc.gather_case, "g", seed + i, **case)
    assert w.run(gc.empty_gather, "g") == [(0, hn * n, dq)] * n
    w.run(rc.close_comm, "g")


def test_gathers_and_combines_interleave_on_one_channel(worlds):
    w = worlds(3)
    _comm(w, "mix", 2, 32, "bfloat16", channels=2)
    assert w.run(gc.interleaved, "mix", fresh_seed(), 12) == [12] * 3
    w.run(gc.gather_case, "mix", fresh_seed(), 2, channel=1)
    w.run(rc.close_comm, "mix")


def test_gathers_of_different_sizes_are_told(worlds):
    w = worlds(3)
    for sizes in ([2, 3, 2], [8, 4, 8], [0, 1, 1]):  # sizes differing by whole chunks; B = 0 on one rank
        _comm(w, "gs", 2, 16, "bfloat16", timeout_s=30.0)
        msgs = w.run(gc.gather_sizes, "gs", fresh_seed(), sizes)
        assert all("entered the same DCP call differently" in m for m in msgs), msgs
        assert f"query all-gather of B={sizes[1]}" in msgs[0], msgs
    w.run(rc.close_comm, "gs")


def test_a_gather_missing_a_rank_times_out_naming_it(worlds):
    w = worlds(2)
    _comm(w, "to", 2, 16, "float8_e5m2", timeout_s=2.0)
    assert w.run(gc.lonely_gather, "to", ranks=[0], timeout=120) == [[1]]
    w.run(rc.close_comm, "to")


def test_a_gather_against_a_combine_is_told(worlds):
    w = worlds(2)
    _comm(w, "gc", 2, 16, "float16", timeout_s=30.0)
    res = w.run(gc.gather_against_combine, "gc", fresh_seed())
    assert "this rank ran a query all-gather of B=2; rank 1 ran a combine of B=2" in res[0]["first"], res
    assert "this rank ran a combine of B=2 (LSE base e); rank 0 ran a query all-gather of B=2" in res[1]["first"], res
    assert all("rebuilt" in r["next"] for r in res), res
    w.run(rc.close_comm, "gc")


def test_bad_gathers_raise_clear_errors_and_keep_step(worlds):
    w = worlds(3)
    for qdt in ("bfloat16", "float8_e4m3fn"):
        _comm(w, "bad", 2, 32, qdt)
        msgs = w.run(gc.bad_gathers, "bad", fresh_seed())
        assert all(m == msgs[0] for m in msgs)
        w.run(rc.close_comm, "bad")


@pytest.mark.parametrize("kwargs, needle", [
    (dict(query_dim=8, query_dtype=torch.float8_e4m3fn), "query_dim must be a positive multiple of 16"),
    (dict(query_dim=12), "query_dim must be a positive multiple of 8"),
    (dict(query_dim=1032), "up to 1024"),
    (dict(query_dtype=torch.int8), "query_dtype must be one of"),
])
def test_bad_query_geometry_fails_on_every_rank(worlds, kwargs, needle):
    msgs = worlds(3).run(rc.construct_expect_error, max_tokens=2, num_heads=6, head_dim=16, **kwargs)
    assert len(set(msgs)) == 1 and needle in msgs[0], msgs


def test_buffers_are_sized_for_the_larger_rows(worlds):
    """A query row wider than the combine's packed row sizes the slots; memory_bytes says so."""
    w = worlds(2)
    _comm(w, "small", 2, 16, "bfloat16")
    _comm(w, "wide", 2, 256, "float32")
    small, wide = w.run(gc.memory, "small")[0], w.run(gc.memory, "wide")[0]
    rows = 2 * 2 * MAX_TOKENS * 2  # slots x sources x tokens x heads per rank
    assert wide["per_channel"] > small["per_channel"]
    assert wide["per_channel"] >= rows * 256 * 4  # a 256-dim fp32 query row is 1 KiB
    assert small["per_channel"] >= rows * (16 + 16) * 2  # the combine's row: D values + LSE, padded to 16 lanes
    w.run(gc.gather_case, "wide", fresh_seed(), 2 * MAX_TOKENS)
    w.run(rc.close_comm, "small")
    w.run(rc.close_comm, "wide")
