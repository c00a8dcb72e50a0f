"""GPU tier: N processes on one GPU (or one per GPU) sharing buffers by CUDA IPC."""

import pytest
import torch

from tests import rank_cases as rc
from tests.conftest import fresh_seed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MAX_TOKENS = 32


@pytest.mark.parametrize("n", [2, 3, 6])
def test_lse_reduce_matches_reference_gpu(worlds, n):
    w = worlds(n, "cuda")
    seed = fresh_seed()
    for d in (512, 128):
        w.run(rc.make_comm, "bf16", device="cuda", max_tokens=MAX_TOKENS, num_heads=16 * n, head_dim=d)
        cases = [
            dict(B=1), dict(B=MAX_TOKENS, base_e=False, use_out=True),
            dict(B=2 * MAX_TOKENS + 1, return_lse=False, special=True),
            dict(B=7, strided=True, lse_dtype="bfloat16", use_out=True),
            dict(B=MAX_TOKENS, special=True, base_e=False, use_out=True),
            dict(B=3, lse_dtype="float16", return_lse=False),
        ]
        for i, case in enumerate(cases):
            w.run(rc.lse_case, "bf16", seed + i, **case)
    w.run(rc.make_comm, "fp16", device="cuda", max_tokens=MAX_TOKENS, num_heads=8 * n, head_dim=96,
          dtype="float16")
    for i in range(5):
        w.run(rc.lse_case, "fp16", seed + 50 + i, B=[1, 9, 40, 2, 32][i], special=i % 2 == 1,
              strided=i == 2, use_out=i > 2)
    assert w.run(rc.bad_calls, "fp16")
    w.run(rc.close_comm, "bf16")
    w.run(rc.close_comm, "fp16")


def test_one_launch_per_call(worlds):
    w = worlds(3, "cuda")
    w.run(rc.make_comm, "launch", device="cuda", max_tokens=16, num_heads=48, head_dim=128)
    for B in (1, 16):
        names = w.run(rc.count_launches, "launch", B)
        assert all(len(k) == 1 and "lse_alltoall" in k[0] for k in names), names
    names = w.run(rc.count_launches, "launch", 40)  # above max_tokens: one launch per chunk
    assert all(len(k) == 3 for k in names), names
    w.run(rc.close_comm, "launch")


@pytest.mark.parametrize("n", [3, 6])
def test_graphs_replayed_in_any_order(worlds, n):
    w = worlds(n, "cuda")
    # few programs: each walks several tiles
    w.run(rc.make_comm, "graphs", device="cuda", max_tokens=64, num_heads=4 * n, head_dim=128,
          max_programs=3)
    sizes = [1, 2, 3, 8, 17, 64, 100, 512]
    res = w.run(rc.graph_case, "graphs", fresh_seed(), sizes=sizes, calls_per_graph=3, replays=24,
                timeout=600)
    for r in res:
        assert all(d == 0 for d in r["alloc_deltas"]), r["alloc_deltas"]
    msgs = w.run(rc.capture_before_warmup, "graphs")
    assert all("warmup" in m for m in msgs)
    w.run(rc.close_comm, "graphs")
