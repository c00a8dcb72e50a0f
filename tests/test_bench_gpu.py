"""The benchmark's per-step marks on a GPU: both timers agree on a kernel of known length, and a
clock mark held by a graph times its replays."""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("timer", ["clock", "events"])
def test_marks_time_a_sleep(timer):
    from bench.ranks import Marks

    marks = Marks(timer, 3)
    marks.mark()  # compiles the clock kernel
    marks.mark()  # the first launch through its own launcher
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(10 ** 7)  # about 5 ms: the marks below are queued before any of them runs
    marks.restart()
    marks.mark()
    a.record()
    torch.cuda._sleep(2 * 10 ** 6)
    b.record()
    for _ in range(3):
        marks.mark()
    torch.cuda.synchronize()
    slept, (first, *rest) = a.elapsed_time(b) * 1e3, marks.intervals()
    print(f"{timer}: slept {slept:.1f} us, marks {first:.1f}, {rest}")
    assert slept > 500 and slept - 2 < first < slept + 60
    assert all(0 < t < 60 for t in rest)
    marks.mark()
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="5 marks ran where 4 were expected"):
        marks.intervals()


def test_clock_mark_in_a_graph_times_its_replays():
    from bench.ranks import Marks

    marks = Marks("clock", 3)
    marks.mark()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        marks.mark()
        torch.cuda._sleep(10 ** 6)
    graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    graph.replay()
    b.record()
    torch.cuda.synchronize()
    replay = a.elapsed_time(b) * 1e3
    torch.cuda._sleep(10 ** 6)
    marks.restart()
    for _ in range(3):
        graph.replay()
    marks.mark()
    torch.cuda.synchronize()
    steps = marks.intervals()
    print(f"replay {replay:.1f} us, steps {steps}")
    assert replay > 300 and all(replay - 20 < t < replay + 60 for t in steps)
