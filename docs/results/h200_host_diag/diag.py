"""Scratch (not committed): why the bench's eager host column reads above the probe's."""
import statistics, sys, time
import torch, torch.distributed as dist
from dcp.spawn import World
from dcp.reference import make_inputs
from bench import ranks

def _timed(step, n, between=None):
    t = []
    for i in range(n):
        if between: between(i)
        t0 = time.perf_counter(); step(); t.append(time.perf_counter() - t0)
    return statistics.median(t) * 1e6

def diag(state, B, iters):
    ranks.setup(state, 16, 512, 8, "cuda", "triton")
    comm = state["comm"]; n, rank = comm.world, comm.rank
    outs, lses = make_inputs(1, n, B, comm.num_heads, 512, comm.dtype)
    po, pl = outs[rank].cuda(), lses[rank].cuda()
    y = torch.empty((B, 16, 512), dtype=comm.dtype, device="cuda")
    step = lambda: comm.lse_reduce(po, pl, out=y)
    res = {}
    def rec(name, f):
        torch.cuda.synchronize(); dist.barrier(); res[name] = f(); torch.cuda.synchronize()
    rec("run_point eager (bench)", lambda: ranks.run_point(state, B, "eager", iters, 5)["host_us"])
    rec("run_point eager again", lambda: ranks.run_point(state, B, "eager", iters, 6)["host_us"])
    rec("unheld 2000", lambda: _timed(step, 2000))
    rec("unheld 200", lambda: _timed(step, iters))
    mark, _ = ranks.marks("clock", iters)
    out = {}
    def held(name, between=None):
        ranks.held_run(state, iters * 60, lambda: out.__setitem__(name, _timed(step, iters, between)), tries=1)
        res[name] = out[name]
    held("held 200, nothing between")
    held("held 200, clock mark between", mark)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    held("held 200, event between", lambda i: ev[i].record())
    def spin_then():
        t_end = time.perf_counter() + 0.05
        while time.perf_counter() < t_end: pass
        return _timed(step, iters)
    rec("unheld 200 after 50 ms spin", spin_then)
    rec("unheld 200 after 50 ms sleep", lambda: (time.sleep(0.05), _timed(step, iters))[1])
    import os
    res["cpu"] = os.sched_getaffinity(0).__len__()
    comm.check(); state.pop("comm").close()
    return res

if __name__ == "__main__":
    n = int(sys.argv[1]); B = int(sys.argv[2])
    w = World(n, "cuda")
    try:
        res = w.run(diag, B, 200, timeout=300)
    finally:
        w.close()
    print(f"host us per call, median, N={n} B={B}")
    for k in res[0]:
        print(f"{k:34s}" + "".join(f"{r[k]:>8.1f}" for r in res))
