"""This package's Python path of an eager call, on a machine without a GPU: a 2-rank CPU
communicator whose loaded-variant entry point is replaced by a no-op, so every call takes the path a
GPU call takes (checks, operands, the transport, the launcher) but launches nothing; no rank runs a
kernel, so the ranks stay in step. Medians of 20,000 calls per rank (the second of two passes).

    PYTHONPATH=<tree> python docs/results/cpu/host_probe.py [--profile]
"""
import cProfile, io, pstats, statistics, sys, time, types
import torch, torch.distributed as dist
from dcp import DcpAllToAll
from dcp.reference import make_inputs
from dcp.spawn import World

def med(step, iters):
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter(); step(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6

def probe(state, B, iters, prof_on):
    n, rank = dist.get_world_size(), dist.get_rank()
    comm = DcpAllToAll(dist.group.WORLD, max_tokens=B, num_heads=16 * n, head_dim=512, dtype=torch.bfloat16,
                       device="cpu", backend="triton")
    outs, lses = make_inputs(rank, n, B, comm.num_heads, 512, comm.dtype)
    po, pl = outs[rank], lses[rank]
    y = torch.empty((B, comm.heads_per_rank, 512), dtype=comm.dtype)
    comm.lse_reduce(po, pl, out=y)
    t = comm._transport
    calls = []
    fn = types.SimpleNamespace(function=0)
    def entry(*a):
        if len(calls) < 1: calls.append(len(a))
    for fused in t.fused.values():
        fused.raw_stream = lambda i: 0
        fused.compiled[(pl.dtype, True, True, True)] = (fn, entry, (0, 0, None, None), (None,))
    sl = torch.ones(B, dtype=torch.int32); qsl = torch.arange(B + 1, dtype=torch.int32); step = object()
    one = torch.zeros(1)
    steps = {"out=": lambda: comm.lse_reduce(po, pl, out=y),
             "out=, metadata, a step": lambda: comm.lse_reduce(po, pl, out=y, seq_lens=sl, query_start_loc=qsl, step=step),
             "out=, metadata": lambda: comm.lse_reduce(po, pl, out=y, seq_lens=sl, query_start_loc=qsl),
             "allocates out": lambda: comm.lse_reduce(po, pl),
             "entry stub": lambda: entry(*range(30)),
             "add_ (cpu)": lambda: one.add_(1)}
    res = {k: med(f, iters) for k, f in steps.items()}
    res = {k: med(f, iters) for k, f in steps.items()}
    if prof_on and rank == 0:
        pr = cProfile.Profile(); pr.enable()
        for _ in range(5000): comm.lse_reduce(po, pl, out=y)
        pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); res["prof"] = s.getvalue()
    res["entry_args"] = calls[:1]
    comm.close()
    return res

if __name__ == "__main__":
    w = World(2, "cpu")
    try:
        r = w.run(probe, 8, 20000, "--profile" in sys.argv, timeout=600)
    finally:
        w.close()
    for k in r[0]:
        if k != "prof": print(k, [round(x[k], 2) if isinstance(x[k], float) else x[k] for x in r])
    print(r[0].get("prof", ""))
