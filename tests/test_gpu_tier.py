"""GPU tier: N processes on one GPU (or one per GPU) sharing buffers by CUDA IPC."""

import os

import pytest
import torch

from dcp.protocol import LARGE_CALL_TOKENS, POISONED_NOTE
from dcp.spawn import World
from dcp.constants import EPOCH_PERIOD

from tests import gather_cases as gc
from tests import lockstep_cases as lc
from tests import rank_cases as rc
from tests import vllm_cases as vc
from tests.conftest import fresh_seed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MAX_TOKENS = 32
# The protocol cases need every rank's calls on one transport (auto may send two sizes to two
# transports, and a mismatch across them shows as a timeout: tests/test_auto.py): the one
# DCP_A2A_BACKEND names, else the push. The other tests run under the default, auto's plan.
ONE_TRANSPORT = {"backend": os.environ.get("DCP_A2A_BACKEND", "triton").replace("auto", "triton")}


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
            dict(B=2, subclass=True),  # the slow argument check, then the same launch
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


@pytest.mark.parametrize("n", [2, 3, 6])
def test_large_calls_match_reference_gpu(worlds, n):
    """Calls from LARGE_CALL_TOKENS up take the 16-warp tiling, whose push tiles at N = 2 and 3 hold
    the other ranks' values only (``ChannelLayout.value_lanes``): both transports, vLLM's shape."""
    w = worlds(n, "cuda")
    seed = fresh_seed()
    cases = [dict(B=LARGE_CALL_TOKENS, use_out=True, special=True),
             dict(B=LARGE_CALL_TOKENS + 3, use_out=True, base_e=False),  # a 16-warp launch, then a small one
             dict(B=LARGE_CALL_TOKENS, return_lse=False, strided=True)]
    for i, backend in enumerate(("push", "pull")):
        w.run(rc.make_comm, backend, device="cuda", max_tokens=LARGE_CALL_TOKENS, num_heads=16 * n,
              head_dim=512, backend=backend)
        assert w.run(rc.tilings, backend, [LARGE_CALL_TOKENS]) == [[(16, False)]] * n
        for j, case in enumerate(cases):
            w.run(rc.lse_case, backend, seed + 10 * i + j, **case)
        w.run(rc.close_comm, backend)


@pytest.mark.parametrize("n", [3, 6])
def test_fp32_outputs_and_batch_metadata_gpu(worlds, n):
    """fp32 partial outputs, and vLLM's seq_lens / query_start_loc masks (int32, int64, strided,
    B above max_tokens), sequences of several tokens and graph padding, 2 to 530 sequences: one to
    four steps of the kernel's 8-way search; a model step's calls (``step=``) eager and in graphs
    (the later calls of a captured step read its first call's verdicts)."""
    w = worlds(n, "cuda")
    seed = fresh_seed()
    w.run(rc.make_comm, "fp32", device="cuda", max_tokens=MAX_TOKENS, num_heads=16 * n, head_dim=512,
          dtype="float32")
    for i, case in enumerate([dict(B=1), dict(B=2 * MAX_TOKENS + 1, special=True, use_out=True),
                              dict(B=7, strided=True, base_e=False)]):
        w.run(rc.lse_case, "fp32", seed + i, **case)
    w.run(rc.make_comm, "meta", device="cuda", max_tokens=MAX_TOKENS, num_heads=16 * n, head_dim=512)
    many = list(range(121)) + [122 + 2 * i for i in range(8)] + [137]
    for i, case in enumerate([dict(B=6, query_start_loc=[0, 1, 2, 3, 4]),
                              dict(B=11, query_start_loc=[0, 3, 4, 7, 9], layout="int64", use_out=True),
                              dict(B=5, query_start_loc=[0, 1, 1, 4], layout="strided"),
                              dict(B=140, query_start_loc=many, layout="int64_strided"),
                              dict(B=600, query_start_loc=list(range(501)) + [502 + 2 * i for i in range(30)])]):
        w.run(rc.metadata_case, "meta", seed + 10 + i, **case)
    w.run(rc.metadata_case, "meta", seed + 20, B=9, query_start_loc=[0, 2, 3, 5, 8], steps=2)  # step=
    w.run(rc.step_graph_case, "meta", seed + 30)
    w.run(rc.step_graph_reads_case, "meta", seed + 40)
    w.run(rc.close_comm, "fp32")
    w.run(rc.close_comm, "meta")


@pytest.mark.parametrize("n", [2, 3, 6])
def test_gather_is_bit_exact_gpu(worlds, n):
    w = worlds(n, "cuda")
    seed = fresh_seed()
    for qdt, dq in (("bfloat16", 576), ("float8_e4m3fn", 576), ("float32", 64), ("float16", 128)):
        w.run(rc.make_comm, "g", device="cuda", max_tokens=MAX_TOKENS, num_heads=16 * n, head_dim=512,
              query_dim=dq, query_dtype=gc.QUERY_DTYPES[qdt])
        cases = [dict(B=1), dict(B=MAX_TOKENS, use_out=True), dict(B=2 * MAX_TOKENS + 1, strided=True, padded_out=True),
                 dict(B=7, strided=True)]
        for i, case in enumerate(cases):
            w.run(gc.gather_case, "g", seed + i, **case)
        assert w.run(gc.empty_gather, "g") == [(0, 16 * n, dq)] * n
    assert w.run(gc.interleaved, "g", seed + 10, 12) == [12] * n
    assert w.run(gc.bad_gathers, "g", seed + 20)
    w.run(rc.close_comm, "g")


def test_layer_graphs_gpu(worlds):
    """Graphs of 4 whole layers (gather, attention stand-in, combine), several batch sizes, replayed
    in random order with eager calls between: every output checked, nothing allocated in capture,
    one launch per gather."""
    for n in (3, 6):
        w = worlds(n, "cuda")
        w.run(rc.make_comm, "layer", device="cuda", max_tokens=64, num_heads=16 * n, head_dim=512,
              query_dim=576, query_dtype=torch.bfloat16)
        if os.environ.get("DCP_A2A_BACKEND", "auto") == "auto":  # the seeds' scenario under auto's plan
            assert all(r.startswith("measured") for r in w.run(rc.backend_reason, "layer")), "auto did not measure"
        names = w.run(gc.count_gather_launches, "layer", 8)
        assert all(len(k) == 1 and "lse_alltoall" in k[0] for k in names), names
        res = w.run(gc.layer_graphs, "layer", fresh_seed(), sizes=[1, 8, 64], layers=4, replays=8, timeout=600)
        assert all(all(a == 0 for a in r["allocs"]) for r in res), res
        w.run(rc.close_comm, "layer")


def test_one_launch_per_call(worlds):
    w = worlds(3, "cuda")
    w.run(rc.make_comm, "launch", device="cuda", max_tokens=16, num_heads=48, head_dim=128)
    for B in (1, 16):
        names = w.run(rc.count_launches, "launch", B)
        assert all(len(k) == 1 and "lse_alltoall" in k[0] for k in names), names
    names = w.run(rc.count_launches, "launch", 40)  # above max_tokens: one launch per chunk
    assert all(len(k) == 3 for k in names), names
    w.run(rc.close_comm, "launch")


@pytest.mark.parametrize("n,pdl", [(3, None), (3, False), (6, None)])
def test_graphs_replayed_in_any_order(worlds, n, pdl):
    w = worlds(n, "cuda")
    # few programs: each walks several tiles
    reprs = w.run(rc.make_comm, "graphs", device="cuda", max_tokens=64, num_heads=4 * n, head_dim=128,
                  max_programs=3, pdl=pdl)
    # programmatic dependent launch by default on Hopper; off when asked
    assert all(f"pdl={pdl is None}" in r for r in reprs), reprs
    sizes = [1, 2, 3, 8, 17, 64, 100, 512]
    res = w.run(rc.graph_case, "graphs", fresh_seed(), sizes=sizes, calls_per_graph=3, replays=24,
                timeout=600)
    for r in res:
        assert all(d == 0 for d in r["alloc_deltas"]), r["alloc_deltas"]
    msgs = w.run(rc.capture_before_warmup, "graphs")
    assert all("warmup" in m for m in msgs)
    w.run(rc.close_comm, "graphs")


def test_two_channels_from_two_streams_and_epoch_wrap(worlds):
    for n in (3, 6):
        w = worlds(n, "cuda")
        w.run(rc.make_comm, "ch", device="cuda", max_tokens=8, num_heads=4 * n, head_dim=128, channels=2)
        w.run(rc.set_epoch, "ch", 0, EPOCH_PERIOD - 3)
        w.run(rc.set_epoch, "ch", 1, EPOCH_PERIOD - 4)
        w.run(rc.two_streams, "ch", fresh_seed(), 6)  # both channels cross the wrap
        w.run(rc.channel_mix, "ch", fresh_seed(), [0, 1, 1, 0, 0, 0, 1])
        w.run(rc.close_comm, "ch")


def test_timeouts_mismatch_and_watchdog_gpu(worlds):
    w = worlds(3, "cuda")
    w.run(rc.make_comm, "to", device="cuda", max_tokens=4, num_heads=12, head_dim=64, timeout_s=1.0, **ONE_TRANSPORT)
    for r, B in enumerate([3, 2, 3]):
        w.conns[r].send((rc.expect_mismatch.__module__, "expect_mismatch", ("to", B), {}))
    assert all("entered the same DCP call differently" in m for m in w._collect(range(3), 120))
    w.run(rc.close_comm, "to")
    w.run(rc.make_comm, "to", device="cuda", max_tokens=4, num_heads=12, head_dim=64, timeout_s=1.0, **ONE_TRANSPORT)
    res = w.run(rc.expect_timeout, "to", ranks=[0], timeout=120)[0]
    assert res["missing"] == [1, 2] and res["elapsed"] < 1.0 + 2.0, res
    w.run(rc.make_comm, "to", device="cuda", max_tokens=4, num_heads=12, head_dim=64, timeout_s=1.0, **ONE_TRANSPORT)
    assert "timed out" in w.run(rc.watchdog_sees_timeout, "to", ranks=[0], timeout=120)[0]
    w.run(rc.close_comm, "to")


def test_lockstep_cases_gpu(worlds):
    """The protocol cases of tests/test_lockstep.py on N processes of the GPU: a rank rejecting its
    call, B = 0 on one rank, sizes differing by whole chunks; each fails every rank at once and
    poisons the channel; a call every rank rejects, and B = 0 everywhere, leave it in step."""
    w = worlds(3, "cuda")
    make = lambda: w.run(rc.make_comm, "ls", device="cuda", max_tokens=4, num_heads=12, head_dim=64,
                         timeout_s=30.0, **ONE_TRANSPORT)
    for sizes in ([0, 2, 2], [8, 4, 4]):
        make()
        res = w.run(lc.rank_sizes, "ls", fresh_seed(), sizes=sizes)
        assert all("entered the same DCP call differently" in r["first"] and r["elapsed"] < 10 for r in res), res
        assert all(POISONED_NOTE in r["next"] for r in res), res
    make()
    res = w.run(lc.rejecting_rank, "ls", fresh_seed(), bad_rank=1)
    assert res[1]["first"].startswith("TypeError")
    assert all("rank 1 rejected its call before launch" in r["first"] and r["elapsed"] < 10 for r in (res[0], res[2]))
    make()
    assert all(e <= rc.TOL[torch.bfloat16] for e in w.run(lc.every_rank_rejects, "ls", fresh_seed()))
    assert all(e <= rc.TOL[torch.bfloat16] for e in w.run(lc.everyone_empty, "ls", fresh_seed()))
    assert all(r["finite"] for r in w.run(lc.near_dtype_max, "ls", fresh_seed()))
    res = w.run(lc.graph_after_poison, "ls", fresh_seed())
    assert all(r["nan_after"] and r["recorded"] for r in res), res
    w.run(rc.close_comm, "ls")


def test_peer_death_gpu():
    w = World(3, "cuda")
    try:
        w.run(rc.make_comm, "dead", device="cuda", max_tokens=4, num_heads=12, head_dim=64, timeout_s=1.0)
        w.conns[2].send((rc.exit_now.__module__, "exit_now", (), {}))
        w.procs[2].join(30)
        res = w.run(rc.expect_timeout, "dead", ranks=[0, 1], timeout=120)
        assert all(2 in r["missing"] and r["elapsed"] < 1.0 + 2.0 for r in res), res
        w.run(rc.close_comm, "dead", ranks=[0, 1], timeout=120)
    finally:
        w.close(timeout=30)


def test_vllm_dropin_triton_gpu(worlds):
    assert all(e <= rc.TOL[torch.bfloat16] for e in worlds(3, "cuda").run(vc.vllm_dropin, fresh_seed(),
                                                                          device="cuda"))


def test_vllm_plugin_layer_in_a_cuda_graph_gpu(worlds):
    """The plugin inside the stand-in vLLM: both collectives of an MLA layer's decode captured in one
    graph (fp8 queries, seq_lens masking, B above max_tokens), none of vLLM's own transports."""
    for r in worlds(3, "cuda").run(vc.graphed_layer, fresh_seed()):
        assert r["err"] <= rc.TOL[torch.bfloat16] and not r["vllm_calls"], r
        assert r["contiguous"] and r["storage"] >= 11 * (3 * 4 + 4) * 576  # B = 11, room for 16 heads


def test_construct_close_50_times_gpu(worlds):
    worlds(3, "cuda").run(rc.construct_close_loop, 50, device="cuda", max_tokens=256, heads_per_rank=16,
                          head_dim=512, timeout=600)


def test_soak_gpu(worlds):
    """100,000 calls under MPS (ranks run concurrently); a short soak when time-sliced."""
    calls = 100_000 if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else 2_000
    w = worlds(3, "cuda")
    w.run(rc.make_comm, "soak", device="cuda", max_tokens=16, num_heads=48, head_dim=128, channels=2)
    w.run(rc.set_epoch, "soak", 0, EPOCH_PERIOD - 1000)
    w.run(rc.set_epoch, "soak", 1, EPOCH_PERIOD - 1001)
    res = w.run(rc.soak, "soak", fresh_seed(), calls=calls, check_every=1000, timeout=900)
    print("soak", res)
    assert all(r["calls"] == calls and r["checked"] == calls // 1000 for r in res)
    w.run(rc.close_comm, "soak")


@pytest.mark.parametrize("n", [2, 3, 6])
def test_nccl_backend_matches_triton_gpu(n):
    """The NCCL reference path needs one GPU per rank (NCCL refuses two ranks on one GPU)."""
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, found {torch.cuda.device_count()}")
    w = World(n, "cuda", pg_backend="nccl")
    try:
        seed = fresh_seed()
        outputs = {}
        for backend in ("triton", "nccl"):
            w.run(rc.make_comm, backend, device="cuda", max_tokens=16, num_heads=16 * n, head_dim=128,
                  backend=backend)
            outputs[backend] = [w.run(rc.lse_case, backend, seed + i, return_output=True, **case)
                                for i, case in enumerate([dict(B=5, special=True), dict(B=40, base_e=False)])]
            w.run(rc.close_comm, backend)
        for case_t, case_n in zip(outputs["triton"], outputs["nccl"]):
            for (yt, lt), (yn, ln) in zip(case_t, case_n):
                assert torch.equal(yt, yn) and torch.equal(lt, ln)
    finally:
        w.close()
