"""What every rank runs during a benchmark: check one point against the reference, then time it."""

import statistics
import time

import torch
import torch.distributed as dist

from dcp import DcpAllToAll
from dcp.reference import chunk_reference, make_inputs, max_rel_error


def _percentiles(xs: list) -> dict:
    xs = sorted(xs)
    q = lambda p: xs[min(len(xs) - 1, int(p * len(xs)))]
    return {"median_us": statistics.median(xs), "p10_us": q(0.1), "p90_us": q(0.9)}


def setup(state, heads_per_rank: int, head_dim: int, max_tokens: int, device: str, backend: str,
          num_warps=None) -> str:
    if "comm" in state:
        state.pop("comm").close()
    n = dist.get_world_size()
    state["comm"] = DcpAllToAll(dist.group.WORLD, max_tokens=max_tokens, num_heads=heads_per_rank * n,
                                head_dim=head_dim, dtype=torch.bfloat16, device=device, backend=backend,
                                num_warps=num_warps)
    return repr(state["comm"])


def run_point(state, B: int, mode: str, iters: int, seed: int) -> dict:
    """mode: eager, graph (one call per graph) or graph8 (eight calls per graph, like layers)."""
    comm: DcpAllToAll = state["comm"]
    dev, n, rank, hn = comm.device, comm.world, comm.rank, comm.heads_per_rank
    H, D = comm.num_heads, comm.head_dim
    outs, lses = make_inputs(seed, n, B, H, D, comm.dtype)
    po, pl = outs[rank].to(dev), lses[rank].to(dev)
    y = torch.full((B, hn, D), float("nan"), dtype=comm.dtype, device=dev)
    comm.lse_reduce(po, pl, out=y)
    ref, _ = chunk_reference(outs, lses, rank, hn)
    err = max_rel_error(y, ref)
    assert err < 1.6e-2, f"B={B}: result differs from the reference ({err})"
    cuda = dev.type == "cuda"
    calls = 8 if mode == "graph8" else 1
    if mode.startswith("graph"):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                comm.lse_reduce(po, pl, out=y)
        step = graph.replay
    else:
        step = lambda: comm.lse_reduce(po, pl, out=y)
    for _ in range(min(10, iters)):
        step()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    times, host = [], []
    if cuda:
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for a, b in ev:
            a.record()
            t0 = time.perf_counter()
            step()
            host.append((time.perf_counter() - t0) * 1e6)
            b.record()
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) * 1e3 / calls for a, b in ev]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e6)
        host = times
    dist.barrier()
    comm.check()
    res = _percentiles(times)
    res["host_us"] = statistics.median(host) / calls
    res["max_rel_err"] = err
    return res

