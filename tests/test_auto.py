"""``backend="auto"``: the measured plan (``dcp.plan``) on the CPU tier. The routing and agreement
use made-up tables (the interpreter's timings say nothing about a fabric); some tests time for real,
some make a candidate fail while measured."""

import re

import pytest
import torch

from dcp.constants import KIND_COMBINE, KIND_GATHER
from dcp.protocol import POISONED_NOTE
from dcp.plan import COMBINE_META, LAYER, LAYER_META, HostTimer, Plan, choose, ladder, layer_points, measure, op_points
from tests import auto_cases as ac
from tests import gather_cases as gc
from tests import lockstep_cases as lc
from tests import rank_cases as rc
from tests.conftest import fresh_seed

CANDIDATES = ["triton", "pull"]  # never NCCL: it pairs calls by order, without the announcements


def _table(times: dict) -> list:
    """{(kind, size): (triton, pull) us} as a rank's table (pairs, to cross to the ranks)."""
    return [((name, kind, b), t[i]) for (kind, b), t in times.items() for i, name in enumerate(CANDIDATES)]


def _layers(times: dict, key: str = LAYER) -> list:
    """{size: (mixed, triton alone, pull alone) us} as a rank's layer times at the sizes MIXED mixes
    (``key``: LAYER_META for those with metadata)."""
    mixed = {1: ("triton", "pull"), 2: ("pull", "triton")}
    return [((key, *pair, b), t[i]) for b, t in times.items()
            for i, pair in enumerate((mixed[b], ("triton", "triton"), ("pull", "pull")))]


def _both(times: dict) -> list:
    """The same layer times without and with metadata."""
    return _layers(times) + _layers(times, LAYER_META)


# Each candidate wins somewhere: combine B = 1 pull, B = 2 push; gather B = 1 push, B = 2 pull;
# so each size's layer mixes them, and its layer times (made up too) keep the mix.
MIXED = _table({(KIND_COMBINE, 1): (10, 5), (KIND_COMBINE, 2): (10, 30),
                (KIND_GATHER, 1): (10, 20), (KIND_GATHER, 2): (50, 40)}) + _both({1: (15, 30, 25), 2: (70, 80, 90)})


def test_ladder_and_plan_rules():
    assert ladder(1) == [1] and ladder(2) == [1, 2] and ladder(6) == [1, 2, 4, 6] and ladder(8) == [1, 2, 4, 8]
    t = {(n, k, b): 100.0 for n in CANDIDATES for k in (KIND_COMBINE, KIND_GATHER) for b in (1, 2, 4)}
    # a tie within 1% goes to the earlier candidate; the slowest rank decides
    fast = t | {("pull", KIND_COMBINE, 4): 99.1, ("pull", KIND_GATHER, 2): 50.0}
    slow_rank = t | {("pull", KIND_COMBINE, 4): 99.1, ("pull", KIND_GATHER, 2): 110.0}
    plan = choose([fast, slow_rank], CANDIDATES, [1, 2, 4], {"x": "why"}, 4, 0.1)
    assert plan.by_size[KIND_COMBINE] == ["triton"] * 5
    assert plan.by_size[KIND_GATHER] == ["triton"] * 5
    # 1.2% (and 1.2 us) behind on every rank: no tie
    behind = {("pull", KIND_COMBINE, 4): 98.8}
    plan = choose([fast | behind, slow_rank | behind], CANDIDATES, [1, 2, 4], {}, 4, 0.1)
    assert plan.by_size[KIND_COMBINE] == ["triton"] * 3 + ["pull"] * 2, plan.by_size
    # and so does one within 0.3 us (small calls): 0.25 us of 5 ties, 0.35 does not
    small = {(n, k, b): 5.0 for n in CANDIDATES for k in (KIND_COMBINE, KIND_GATHER) for b in (1, 2, 4)}
    plan = choose([small | {("pull", KIND_COMBINE, 1): 4.75, ("pull", KIND_GATHER, 1): 4.65}], CANDIDATES, [1, 2, 4],
                  {}, 4, 0.1)
    assert plan.by_size[KIND_COMBINE][1] == "triton" and plan.by_size[KIND_GATHER][1] == "pull", plan.by_size
    plan = choose([t | {("pull", KIND_COMBINE, 4): 90.0}], CANDIDATES, [1, 2, 4], {}, 4, 0.1)
    assert plan.by_size[KIND_COMBINE] == ["triton", "triton", "triton", "pull", "pull"]
    assert plan.transport(KIND_COMBINE, 3) == "pull" and plan.transport(KIND_COMBINE, 1000) == "pull"
    assert plan.transport(KIND_COMBINE, 0) == "triton" and plan.transports == ["triton", "pull"]
    routes = [(r.kind, r.lo, r.hi, r.transport) for r in plan.routes]
    assert routes == [("combine", 1, 2, "triton"), ("combine", 3, None, "pull"), ("gather", 1, None, "triton")]
    text = str(plan)
    assert "combine B 3-" not in text and "B >= 3" in text and "pull 90.0" in text, text
    assert isinstance(plan, Plan) and "combine B 1-2: triton" in plan.summary()


def test_a_layer_decides_where_the_collectives_mix():
    """Where a size's gather and combine go to different transports, a layer is timed on each
    alone and that way (``layer_points``). The mix stands where it ties with the fastest layer
    (within 1% or 0.3 us: each collective called alone keeps its faster transport); else the fastest
    layer (slowest rank's; ties to a transport alone, the push first) serves both."""
    ops = dict(MIXED[:8])
    plan = choose([ops], CANDIDATES, [1, 2], {}, 2, 0.1)
    assert plan.mixed_sizes() == [1, 2] and not plan.layers and not plan.overruled
    points = layer_points(plan)
    assert points[:3] == [
        ((LAYER, "triton", "triton"), (("triton", KIND_GATHER), ("triton", KIND_COMBINE)), 1),
        ((LAYER, "pull", "pull"), (("pull", KIND_GATHER), ("pull", KIND_COMBINE)), 1),
        ((LAYER, "triton", "pull"), (("triton", KIND_GATHER), ("pull", KIND_COMBINE)), 1)] and len(points) == 12
    assert points[3:6] == [  # the same layers, their combines with a decode batch's metadata
        ((LAYER_META, "triton", "triton"), (("triton", KIND_GATHER), ("triton", COMBINE_META)), 1),
        ((LAYER_META, "pull", "pull"), (("pull", KIND_GATHER), ("pull", COMBINE_META)), 1),
        ((LAYER_META, "triton", "pull"), (("triton", KIND_GATHER), ("pull", COMBINE_META)), 1)], points
    # B = 1: the pull alone beats the mix on the slowest rank; B = 2: the push alone is within 1% of
    # the mix, which is the fastest: the mix stands
    fast = dict(_layers({1: (20, 30, 10), 2: (100, 101, 90)}))
    slow = dict(_layers({1: (20, 30, 12), 2: (100, 101, 120)}))
    checked = choose([ops, ops], CANDIDATES, [1, 2], {}, 2, 0.2, [fast, slow])
    assert checked.by_size[KIND_COMBINE] == ["pull", "pull", "triton"], checked.by_size
    assert checked.by_size[KIND_GATHER] == ["pull", "pull", "pull"], checked.by_size
    assert checked.mixed_sizes() == [2] and set(checked.layers) == {1, 2} and checked.transports == CANDIDATES
    assert checked.overruled == {(KIND_GATHER, 1)}, checked.overruled
    assert checked.layers[1] == {("triton", "pull"): 20, ("triton", "triton"): 30, ("pull", "pull"): 12}
    assert checked.as_dict()["layers"][2] == {"pull+triton": 100, "triton": 101, "pull": 120}
    # B = 2: the mix more than 1% behind the push alone (and the pull alone as fast as the push): the push
    alone = choose([ops], CANDIDATES, [1, 2], {}, 2, 0.2, [fast | dict(_layers({2: (101.1, 100, 100)}))])
    assert not alone.mixed_sizes() and alone.overruled == {(KIND_GATHER, 1), (KIND_GATHER, 2)}, alone.by_size
    assert alone.by_size[KIND_GATHER] == ["pull", "pull", "triton"], alone.by_size
    # within 0.3 us of the fastest layer (though 2.5% behind it), the mix stands too; 0.35 us behind, not
    small = dict(_layers({1: (20, 30, 10), 2: (10.25, 10, 12)}))
    assert choose([ops], CANDIDATES, [1, 2], {}, 2, 0.2, [small]).mixed_sizes() == [2]
    small[(LAYER, "pull", "triton", 2)] = 10.35
    assert not choose([ops], CANDIDATES, [1, 2], {}, 2, 0.2, [small]).mixed_sizes()
    # within 1% of a transport alone, though not the fastest: the mix stands
    near = choose([ops], CANDIDATES, [1, 2], {}, 2, 0.2, [fast | dict(_layers({2: (100.9, 100, 110)}))])
    assert near.mixed_sizes() == [2] and near.overruled == {(KIND_GATHER, 1)}, near.by_size
    text = str(near)
    assert "layer   B = 1        pull" in text and "triton+pull 20.0" in text and "pull 10.0" in text, text
    assert "gather  B >= 1       pull    (B = 2: triton 50.0  pull 40.0; a layer decided)" in text, text
    assert "combine B 1-1        pull    (B = 1: triton 10.0  pull 5.0)" in text, text
    assert "combine B >= 2       triton  (B = 2: triton 10.0  pull 30.0)" in text, text
    assert "layer   B = 2        pull+triton (triton 100.0  pull 110.0  pull+triton 100.9)" in text, text
    # the times a benchmark sets beside its medians: at the size that routes each of its sizes
    # (clamped; the chosen transport marked, a layer's overruled gather too), and the layers there
    assert near.times_at([0, 2, 5]).split("\n") == [
        "  combine B = 0 (at 1): triton 10.0  pull* 5.0; B = 2, 5 (at 2): triton* 10.0  pull 30.0",
        "  gather  B = 0 (at 1): triton 10.0  pull* 20.0; B = 2, 5 (at 2): triton 50.0  pull* 40.0",
        "  layer   B = 0 (at 1): triton 30.0  pull* 10.0  triton+pull 20.0; "
        "B = 2, 5 (at 2): triton 100.0  pull 110.0  pull+triton* 100.9"], near.times_at([0, 2, 5])
    assert near.times_at([2]).startswith("  combine B = 2: triton* 10.0") and near.times_at([]) == ""
    # every layer overruled to the pull, the combine alone pushed at B = 2: the push stays in use
    pulled = choose([ops], CANDIDATES, [1, 2], {}, 2, 0.2, [dict(_layers({1: (20, 30, 10), 2: (90, 80, 70)}))])
    assert pulled.by_size == {KIND_COMBINE: ["pull"] * 3, KIND_GATHER: ["pull"] * 3}, pulled.by_size
    assert pulled.combine_alone == ["pull", "pull", "triton"] and pulled.transports == CANDIDATES
    assert ("combine alone", 2, None, "triton") in [(r.kind, r.lo, r.hi, r.transport) for r in pulled.routes]
    # the times a benchmark sets beside a combine alone mark its own route, the layers theirs
    assert pulled.times_at([2]).split("\n")[0] == "  combine B = 2: triton* 10.0  pull 30.0", pulled.times_at([2])
    assert "  layer   B = 2: triton 80.0  pull* 70.0  pull+triton 90.0" in pulled.times_at([2]), pulled.times_at([2])
    # every line's sizes start in one column, the combine alone's too
    route_lines = str(pulled).splitlines()[1:]
    assert len({line.index(" B ") for line in route_lines}) == 1 and "  combine alone B >= 2 " in str(pulled), \
        str(pulled)
    # no layer times for a size (or none on one rank): its two choices stand
    assert choose([ops], CANDIDATES, [1, 2], {}, 2, 0.1, [dict(_layers({2: (1, 2, 3)}))]).mixed_sizes() == [1, 2]
    assert choose([ops, ops], CANDIDATES, [1, 2], {}, 2, 0.1, [fast, {}]).mixed_sizes() == [1, 2]


def test_layers_with_metadata_decide_too():
    """Layers are timed without and with metadata (vLLM's MLA layers pass it, SGLang's do not): the
    mix stands only where it ties with the fastest layer both ways; else the first layer that does
    (the push alone first) serves both, or where none does, the one least behind at its worst."""
    ops = dict(MIXED[:8])
    plain = dict(_layers({1: (20, 30, 10), 2: (27.8, 28.9, 28.0)}))  # B = 2: the mix fastest, the pull ties
    meta = dict(_layers({1: (20, 30, 10), 2: (29.0, 29.8, 28.2)}, LAYER_META))  # with metadata only the pull
    plan = choose([ops], CANDIDATES, [1, 2], {}, 2, 0.2, [plain | meta])
    assert plan.by_size[KIND_GATHER][2] == plan.by_size[KIND_COMBINE][2] == "pull", plan.by_size
    assert (KIND_COMBINE, 2) in plan.overruled and plan.combine_alone[2] == "triton", plan.overruled
    assert plan.layers[2][("pull", "triton", "metadata")] == 29.0 and plan.layers[2][("pull", "triton")] == 27.8
    text = str(plan)
    assert "B = 2        pull        (triton 28.9  pull 28.0  pull+triton 27.8  triton meta 29.8  " \
           "pull meta 28.2  pull+triton meta 29.0)" in text, text
    assert "pull+triton meta 29.0" in plan.times_at([2]) and "pull* 28.0" in plan.times_at([2]), plan.times_at([2])
    # the mix ties both ways: it stands; without the metadata times, the plain ones alone decide
    tied = dict(_layers({1: (20, 30, 10), 2: (28.1, 29.8, 28.2)}, LAYER_META))
    assert choose([ops], CANDIDATES, [1, 2], {}, 2, 0.2, [plain | tied]).mixed_sizes() == [2]
    assert choose([ops], CANDIDATES, [1, 2], {}, 2, 0.2, [plain]).mixed_sizes() == [2]
    # no layer ties both ways: the least behind at its worst (push 1.04 / 1.00, pull 1.00 / 1.10)
    apart = dict(_layers({1: (20, 30, 10), 2: (120, 104, 100)})) | dict(
        _layers({1: (20, 30, 10), 2: (120, 100, 110)}, LAYER_META))
    plan = choose([ops], CANDIDATES, [1, 2], {}, 2, 0.2, [apart])
    assert plan.by_size[KIND_GATHER][2] == plan.by_size[KIND_COMBINE][2] == "triton", plan.by_size


def test_measure_runs_a_first_step_before_the_timer_and_survives_a_refused_timing():
    """``measure``: each point's first warm step runs before the timer sees it (a raise then
    happens outside any capture), the timer gets the rest of the warm steps; a timer that raises
    (a capture refused) leaves that point's candidates out, and the other points are still timed."""
    calls = []

    class Timer:
        def best(self, step, warm, reps, rounds):
            calls.append(("timer", warm, reps, rounds))
            if len([c for c in calls if c[0] == "timer"]) == 2:
                raise RuntimeError("capture refused")
            for _ in range(warm + reps):
                step()
            return 7.0

    runs = {name: (lambda name: lambda kind, b: calls.append((name, kind, b)))(name) for name in CANDIDATES}
    table, failed = measure(runs, lambda name: None, op_points(CANDIDATES, [1]), Timer(), warm=3, reps=4, rounds=5)
    assert calls[0] == ("triton", KIND_COMBINE, 1) and calls[1] == ("timer", 2, 4, 5), calls[:2]
    assert list(failed) == ["triton"] and "timing: RuntimeError: capture refused" in failed["triton"], failed
    # the pull's two points: one eager step each, then the timer's 2 + 4
    assert [c for c in calls if c[0] == "pull"] == [("pull", KIND_COMBINE, 1)] * 7 + [("pull", KIND_GATHER, 1)] * 7
    assert table == {("triton", KIND_COMBINE, 1): 7.0, ("pull", KIND_COMBINE, 1): 7.0,
                     ("pull", KIND_GATHER, 1): 7.0}, table


def test_timers_refuse_counts_below_one():
    """A careless count is refused before anything is timed (a replay count of 0 would divide by
    zero; reps or rounds of 0 would return infinity)."""
    from dcp.plan import GraphTimer

    with pytest.raises(ValueError, match="replays"):
        GraphTimer(torch.device("cpu"), replays=0)
    for reps, rounds in ((0, 1), (1, 0)):
        with pytest.raises(ValueError, match="reps and rounds"):
            HostTimer().best(lambda: None, 0, reps, rounds)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_timer_replays_what_it_captured_and_times_it():
    """``GraphTimer``: the step runs on the host only while captured (warm + reps times), every
    round replays the warm graph once and the timed one ``replays`` times (a counter on the
    device), and a step of known length times as such (against events around the same sleep run
    eagerly)."""
    from dcp.plan import GraphTimer

    dev = torch.device("cuda", torch.cuda.current_device())
    timer, x, host = GraphTimer(dev, replays=3), torch.zeros(1, device=dev), [0]
    cycles = 1 << 18

    def step():
        host[0] += 1
        x.add_(1)
        torch.cuda._sleep(cycles)
    with pytest.raises(ValueError, match="reps and rounds"):
        timer.best(step, 2, 0, 3)
    assert host[0] == 0  # refused before anything was captured
    us = timer.best(step, 2, 4, 3)
    torch.cuda.synchronize()
    assert host[0] == 2 + 4 and x.item() == (2 + 4 * 3) * 3, (host, x.item())
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1 << 22)  # the host queues the four steps before they run
    a.record()
    for _ in range(4):
        step()
    b.record()
    b.synchronize()
    eager = a.elapsed_time(b) * 1e3 / 4
    print(f"graph {us:.1f} us per step, eager {eager:.1f}")
    assert eager > 20 and 0.8 * eager < us < 1.1 * eager, (us, eager)


def test_measure_keeps_the_other_candidates_calls_when_one_fails():
    """``measure``: a candidate raising mid-step is not called again, while every step still issues
    the others' calls, in the same order as on a rank where nothing failed; its failure is said."""
    def record(fail_at):  # (at the pull's fail_at-th call)
        calls, n = [], [0]

        def run(name):
            def call(kind, b):
                n[0] += name == "pull"
                if name == "pull" and n[0] == fail_at:
                    raise RuntimeError("boom")
                calls.append((name, kind, b))
            return call
        runs = {name: run(name) for name in CANDIDATES}
        table, failed = measure(runs, lambda name: None, op_points(CANDIDATES, [1, 2]) + layer_points(
            choose([dict(MIXED[:8])], CANDIDATES, [1, 2], {}, 2, 0.1)), HostTimer(), warm=1, reps=2, rounds=1)
        return [c for c in calls if c[0] == "triton"], failed, table

    healthy, none, table = record(-1)
    broken, failed, _ = record(5)  # the pull's 5th call: within its own steps
    assert healthy == broken and not none and list(failed) == ["pull"] and "boom" in failed["pull"], failed
    assert len(healthy) == 3 * 4 + 2 * 3 * 2 * 3 and (LAYER, "triton", "pull", 1) in table
    assert (LAYER_META, "triton", "pull", 1) in table and ("triton", COMBINE_META, 1) in healthy
    later, failed, _ = record(3 * 4 + 4)  # a call of the pull within the layers
    assert later == healthy and list(failed) == ["pull"], failed


def test_auto_routes_each_size_to_its_transport(worlds):
    """Every rank sends a call of a given size to the plan's transport, above max_tokens too, and
    every result is the reference's; a rank rejecting a call fails its peers at once on its route."""
    n = 3
    w = worlds(n)
    res = w.run(ac.make_auto, "a", tables=[MIXED] * n, max_tokens=2, num_heads=2 * n, head_dim=16, query_dim=24)
    assert all(r == res[0] for r in res) and res[0]["backend"] == "auto", res
    assert res[0]["in_use"] == CANDIDATES and "measured" in res[0]["reason"] and res[0]["phases"] == 2, res[0]
    assert res[0]["by_size"][KIND_COMBINE] == ["pull", "pull", "triton"], res[0]
    assert res[0]["by_size"][KIND_GATHER] == ["triton", "triton", "pull"], res[0]
    seed = fresh_seed()
    w.run(ac.counts, "a")  # (the constructor's loads)
    for i, (B, route) in enumerate([(1, "pull"), (2, "triton"), (5, "triton")]):
        w.run(rc.lse_case, "a", seed + i, B=B, special=B == 5, return_lse=True)
        launches = w.run(ac.counts, "a")
        assert all(c == {name: (B + 1) // 2 if name == route else 0 for name in CANDIDATES} for c in launches), \
            (B, launches)
    for i, (B, route) in enumerate([(1, "triton"), (2, "pull"), (5, "pull")]):
        w.run(gc.gather_case, "a", seed + 10 + i, B=B)
        launches = w.run(ac.counts, "a")
        assert all(c[route] == (B + 1) // 2 and sum(c.values()) == c[route] for c in launches), (B, launches)
    # a rejected call of B = 1 announces itself on the pull, where its peers' call went
    out = w.run(lc.rejecting_rank, "a", seed + 20, bad_rank=2, B=1)
    assert all("rank 2 rejected its call before launch" in r["first"] for r in out[:2]), out
    w.run(rc.close_comm, "a")
    assert w.run(rc.shm_segments, ranks=[0]) == [[]]


def test_a_combine_alone_keeps_its_own_transport_where_a_layer_overruled_it(worlds):
    """B = 2: the combine alone is faster pushed, the gather pulled, and the pull alone is the
    fastest layer, so within a layer both go to the pull (a combine right after a gather), and a
    combine after anything else keeps the push: on every rank alike, rejected calls included (of
    whatever B), every result the reference's."""
    n = 3
    w = worlds(n)
    tables = _table({(KIND_COMBINE, 1): (10, 5), (KIND_COMBINE, 2): (10, 30), (KIND_GATHER, 1): (10, 20),
                     (KIND_GATHER, 2): (50, 40)}) + _both({1: (15, 30, 25), 2: (90, 80, 70)})
    res = w.run(ac.make_auto, "a", tables=[tables] * n, max_tokens=2, num_heads=2 * n, head_dim=16, query_dim=24)
    assert all(r == res[0] for r in res) and res[0]["in_use"] == CANDIDATES, res
    assert res[0]["by_size"][KIND_COMBINE] == ["pull", "pull", "pull"], res[0]
    assert res[0]["by_size"][KIND_GATHER] == ["triton", "triton", "pull"], res[0]
    assert "combine alone B >= 2       triton  (B = 2: triton 10.0  pull 30.0)" in res[0]["text"], res[0]["text"]
    assert ("combine alone", 2, None, "triton") in [(r["kind"], r["lo"], r["hi"], r["transport"])
                                                   for r in res[0]["plan"]["routes"]], res[0]["plan"]
    seed = fresh_seed()
    w.run(ac.counts, "a")  # (the constructor's loads)
    steps = [("combine", 2, "triton"), ("gather", 2, "pull"), ("combine", 2, "pull"), ("combine", 2, "triton"),
             ("gather", 1, "triton"), ("combine", 2, "pull"), ("combine", 2, "triton"), ("gather", 2, "pull"),
             ("gather", 2, "pull"), ("combine", 2, "pull"), ("combine", 1, "pull")]
    for i, (op, B, route) in enumerate(steps):
        if op == "gather":
            w.run(gc.gather_case, "a", seed + i, B=B)
        else:
            w.run(rc.lse_case, "a", seed + i, B=B, return_lse=True)
        launches = w.run(ac.counts, "a")
        assert all(c == {name: int(name == route) for name in CANDIDATES} for c in launches), (i, op, B, launches)
    # a combine rejected on one rank right after a gather of its size announces itself on the
    # layer's route, where its peers' call went: they fail at once, naming it
    w.run(gc.gather_case, "a", seed + 20, B=2)
    out = w.run(lc.rejecting_rank, "a", seed + 21, bad_rank=2, B=2)
    assert all("rank 2 rejected its call before launch" in r["first"] for r in out[:2]), out
    w.run(rc.close_comm, "a")
    # a gather rejected on one rank still counts as a gather: the combine after it routes as its
    # peers' does, so it fails at once on their poisoned channels, not on the timeout
    w.run(ac.make_auto, "b", tables=[tables] * n, max_tokens=2, num_heads=2 * n, head_dim=16, query_dim=24,
          timeout_s=60.0)
    out = w.run(ac.rejected_gather_then_combine, "b", seed + 30, bad_rank=1, B=2)
    assert all("rank 1 rejected its call before launch" in r["first"] for r in (out[0], out[2])), out
    assert "Timeout" not in out[1]["second"] and out[1]["elapsed"] < 30, out
    w.run(rc.close_comm, "b")
    assert w.run(rc.shm_segments, ranks=[0]) == [[]]


def test_layers_timed_for_real_can_overrule_the_collectives(worlds):
    """The collectives' times made up (mixed at B = 1, 2), the layers' at B = 1 too (the push
    alone wins, with metadata too), B = 2's timed for real, both ways: every rank has the same plan,
    B = 1 goes to the push for both collectives, and every route's result is the reference's."""
    n = 3
    w = worlds(n)
    made = MIXED[:8] + _both({1: (20, 10, 30)})
    res = w.run(ac.make_auto, "a", tables=[made] * n, max_tokens=2, num_heads=2 * n, head_dim=16, query_dim=24)
    assert all(r == res[0] for r in res) and res[0]["phases"] == 2, res
    by_size, layers = res[0]["by_size"], res[0]["plan"]["layers"]
    assert by_size[KIND_COMBINE][:2] == by_size[KIND_GATHER][:2] == ["triton", "triton"], res[0]
    assert set(layers) == {1, 2} and set(layers[2]) == {"pull+triton", "triton", "pull", "pull+triton meta",
                                                         "triton meta", "pull meta"}, layers
    assert all(us > 0 for us in layers[2].values()) and re.search(r"\n  layer +B = 2 ", res[0]["text"]), res[0]["text"]
    seed = fresh_seed()
    for i, B in enumerate((1, 2, 3)):
        w.run(rc.lse_case, "a", seed + i, B=B)
        w.run(gc.gather_case, "a", seed + 10 + i, B=B)
    w.run(rc.close_comm, "a")


def test_sizes_routed_apart_fail_on_the_timeout_on_every_rank(worlds):
    """Ranks calling with sizes the plan sends to different transports cannot see each other's
    call: each fails naming the ranks that went elsewhere, on the timeout (README, Reliability)."""
    w = worlds(3)
    w.run(ac.make_auto, "a", tables=[MIXED] * 3, max_tokens=2, num_heads=6, head_dim=16, timeout_s=5.0)
    res = w.run(ac.sizes_on_two_routes, "a", fresh_seed(), sizes=[1, 2, 2])
    assert "DcpTimeoutError: DCP all-to-all timed out waiting for rank(s) [1, 2]" in res[0]["first"], res[0]
    # Ranks 1 and 2 name rank 0: timed out waiting for it (on a loaded machine one may also miss the
    # other), or, where rank 0 timed out first, seeing its next call announce its failure.
    for r in res[1:]:
        waited = re.search(r"timed out waiting for rank\(s\) \[([\d, ]+)\] \(rank [12],", r["first"])
        assert (waited and "0" in waited.group(1).split(", ")) or (
            r["first"].startswith("DcpMismatchError") and "rank 0 had already failed" in r["first"]), r
    # and the next call raises too (the recorded failure), writing nothing but NaN (_then_poisoned)
    assert all(POISONED_NOTE in r["next"] for r in res), res
    w.run(rc.close_comm, "a")


def test_ranks_that_measure_differently_agree(worlds):
    """Rank 0 alone would pick the push, rank 1 alone nothing faster than the pull: the slowest
    rank's time decides, on both; the transports the plan does not use are closed."""
    rank0 = _table({(k, b): (10, 20) for k in (KIND_COMBINE, KIND_GATHER) for b in (1, 2, 4)})
    rank1 = _table({(k, b): (30, 20) for k in (KIND_COMBINE, KIND_GATHER) for b in (1, 2, 4)})
    w = worlds(2)
    res = w.run(ac.make_auto, "a", tables=[rank0, rank1], max_tokens=4, num_heads=4, head_dim=16)
    assert res[0] == res[1] and res[0]["backend"] == "pull" and res[0]["in_use"] == ["pull"], res
    assert all(r["transport"] == "pull" and r["times_us"] == {"triton": 30, "pull": 20}
               for r in res[0]["plan"]["routes"]), res[0]
    w.run(rc.lse_case, "a", fresh_seed(), B=3)
    w.run(rc.close_comm, "a")


def test_measuring_off(worlds):
    w = worlds(2)
    res = w.run(ac.make_auto, "a", measure="0", max_tokens=2, num_heads=4, head_dim=16)
    assert all(r["backend"] == "triton" and r["plan"] is None and "not measured" in r["reason"] for r in res), res
    w.run(rc.close_comm, "a")


@pytest.mark.parametrize("n", range(2, 9))
def test_auto_measured_for_real_matches_the_reference(worlds, n):
    """Timed on this machine (interpreted): whatever the plan, every rank has the same one, it
    says what it measured, and both collectives match the reference around max_tokens."""
    w = worlds(n)
    res = w.run(ac.make_auto, "a", max_tokens=2, num_heads=2 * n, head_dim=8, query_dim=16)
    assert all(r["plan"] == res[0]["plan"] for r in res), res
    routes = res[0]["plan"]["routes"]
    assert routes and all(set(r["times_us"]) == set(CANDIDATES) for r in routes), res[0]
    assert "auto plan (measured in" in res[0]["text"], res[0]["text"]
    seed = fresh_seed()
    for i, B in enumerate((1, 2, 3)):
        w.run(rc.lse_case, "a", seed + i, B=B, base_e=B != 2)
        w.run(gc.gather_case, "a", seed + 10 + i, B=B)
    w.run(rc.close_comm, "a")


def test_a_candidate_whose_buffers_fail_is_left_out(worlds):
    """The pull's buffer setup fails on rank 1: every rank keeps the push, says why."""
    w = worlds(2)
    res = w.run(ac.make_auto, "a", second_open_fails_on=1, max_tokens=2, num_heads=4, head_dim=8)
    assert all(r["backend"] == "triton" and r["plan"] is None and "pull left out: buffer setup failed" in r["reason"]
               and "injected failure" in r["reason"] for r in res), res
    w.run(rc.lse_case, "a", fresh_seed(), B=3)
    w.run(rc.close_comm, "a")
    assert w.run(rc.shm_segments, ranks=[0]) == [[]]


@pytest.mark.parametrize("fail, phase", [("pull", 0), ("triton", 0), ("pull", 1), ("triton", 1)])
def test_a_candidate_failing_while_measured_is_left_out(worlds, fail, phase):
    """A candidate's launches raise on rank 1 (phase 0: from its first measured call; phase 1: in
    the layers, after a mixed plan from made-up times): rank 1 announces the failed call, so its
    peers' call fails at once naming it (on the timeout, their next calls on the other candidate
    would miss rank 1's); rank 1 calls it no more, every rank leaves it out, says why, and the other
    serves, matching the reference."""
    w = worlds(3)
    res = w.run(ac.make_auto, "a", tables=[MIXED[:8]] * 3 if phase else None, fail_on=1, fail=fail,
                fail_phase=phase, max_tokens=2, num_heads=6, head_dim=8, timeout_s=30.0)
    assert all(r["plan"] == res[0]["plan"] for r in res) and res[0]["phases"] == phase + 1, res
    other = next(name for name in CANDIDATES if name != fail)
    left = res[0]["plan"]["left_out"]
    assert list(left) == [fail] and res[0]["in_use"] == [other] and f"{fail} left out" in res[0]["reason"], res[0]
    assert re.fullmatch(r"failed on rank 0 while measured: ranks entered the same DCP call differently: "
                        r".*rank 1 .*", left[fail], re.S), left[fail]
    w.run(rc.lse_case, "a", fresh_seed(), B=3)
    w.run(gc.gather_case, "a", fresh_seed(), B=3)
    w.run(rc.close_comm, "a")
    assert w.run(rc.shm_segments, ranks=[0]) == [[]]
