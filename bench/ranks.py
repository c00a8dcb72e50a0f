"""What every rank runs during a benchmark: check one point against the reference, then time it.

On a GPU the timed calls are queued behind a sleeping kernel long enough for the host to enqueue
all of them (nvbench's blocking kernel), so that device events time the calls back to back rather
than the Python loop that launches them; host time per call is measured separately. A point whose
queue ran dry before the host finished (the first timed call had already started) is reported as
not held. Two loops: events around every step (median, p10, p90), then, as nccl-tests does, one
pair of events around all steps (``loop_us``, the mean per call with nothing between the steps);
its host time per call (``host_loop_us``) is the launch rate with no event recorded between calls.
"""

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
          num_warps=None, pdl=None) -> bool:
    """Build this rank's communicator; returns whether its calls use programmatic dependent launch."""
    if "comm" in state:
        state.pop("comm").close()
    n = dist.get_world_size()
    state["comm"] = comm = DcpAllToAll(dist.group.WORLD, max_tokens=max_tokens, num_heads=heads_per_rank * n,
                                       head_dim=head_dim, dtype=torch.bfloat16, device=device, backend=backend,
                                       num_warps=num_warps, pdl=pdl)
    if comm.device.type == "cuda" and "cycles_per_us" not in state:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(10 ** 7)
        b.record()
        b.synchronize()
        # One rate for all ranks (the fastest clock seen), so that equal holds last equally long:
        # a rank that calibrated while the GPU idled at a low clock would otherwise start late.
        state["cycles_per_us"] = max(gather(10 ** 7 / (a.elapsed_time(b) * 1e3)))
    return comm.pdl and comm.backend == "triton"


def gather(value) -> list:
    """Every rank's value, on every rank."""
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, value)
    return seen


def _hold(state, us: float) -> None:
    """Queue a sleeping kernel of about ``us`` microseconds (at least 1 ms) after a barrier."""
    dist.barrier()
    torch.cuda._sleep(int(state["cycles_per_us"] * (us + 1000)))


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
    t0 = time.perf_counter()
    for _ in range(min(10, iters)):
        step()
    warm_us = (time.perf_counter() - t0) * 1e6 / min(10, iters)  # host time per step
    if cuda:
        torch.cuda.synchronize()
    # Every rank holds its queue equally long (the slowest host's estimate), so the ranks start
    # their timed calls together.
    warm_us = max(gather(warm_us))
    times, host, held, loop, host_loop = [], [], True, float("nan"), float("nan")
    if cuda:
        # Per-step events: hold the queue three times the loop's expected host time (two event
        # records per step); where the GPU clock ran slower than when calibrated, hold longer, redo.
        for attempt in range(3):
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
            host = []
            _hold(state, 3 * iters * (warm_us + 10) * 4 ** attempt)
            for a, b in ev:
                a.record()
                t0 = time.perf_counter()
                step()
                host.append((time.perf_counter() - t0) * 1e6)
                b.record()
            held = not ev[0][0].query()
            torch.cuda.synchronize()
            if all(gather(held)):
                break
        times = [a.elapsed_time(b) * 1e3 / calls for a, b in ev]
        # nccl-tests' way: one pair of events around the whole (held) loop, none between steps.
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _hold(state, 3 * iters * warm_us * 4 ** attempt)
        a.record()
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        host_loop = (time.perf_counter() - t0) * 1e6 / iters
        b.record()
        held = all(gather(not a.query())) and held
        b.synchronize()
        loop = a.elapsed_time(b) * 1e3 / (iters * calls)
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
    res["host_loop_us"] = host_loop / calls
    res["held"], res["loop_us"] = held, loop
    res["max_rel_err"] = err
    return res

