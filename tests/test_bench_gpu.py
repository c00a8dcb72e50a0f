"""The benchmark's per-step marks on a GPU: both timers agree on a kernel of known length."""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("timer", ["clock", "events"])
def test_marks_time_a_sleep(timer):
    from bench.ranks import marks

    mark, intervals = marks(timer, 3)
    mark(0)  # compiles the clock kernel
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(10 ** 6)  # the marks below are queued before any of them runs
    mark(0)
    a.record()
    torch.cuda._sleep(2 * 10 ** 6)
    b.record()
    mark(1)
    mark(2)
    mark(3)
    torch.cuda.synchronize()
    slept, (first, *rest) = a.elapsed_time(b) * 1e3, intervals()
    print(f"{timer}: slept {slept:.1f} us, marks {first:.1f}, {rest}")
    assert slept > 500 and slept - 2 < first < slept + 60
    assert all(0 < t < 60 for t in rest)
