"""Scratch: host time of lse_reduce(out=) with programmatic launch on and off (N = 3, B = 1)."""
import statistics, sys, time
import torch, torch.distributed as dist
from dcp import DcpAllToAll
from dcp.spawn import World
from dcp.reference import make_inputs

def probe(state, pdl, iters=2000):
    n, rank = dist.get_world_size(), dist.get_rank()
    comm = DcpAllToAll(dist.group.WORLD, max_tokens=8, num_heads=16 * n, head_dim=512, backend="triton", pdl=pdl)
    outs, lses = make_inputs(1, n, 1, comm.num_heads, 512, comm.dtype)
    po, pl = outs[rank].cuda(), lses[rank].cuda()
    y = torch.empty((1, 16, 512), dtype=comm.dtype, device="cuda")
    comm.lse_reduce(po, pl, out=y); torch.cuda.synchronize(); dist.barrier()
    t = []
    for _ in range(iters):
        t0 = time.perf_counter(); comm.lse_reduce(po, pl, out=y); t.append(time.perf_counter() - t0)
    torch.cuda.synchronize(); comm.check(); comm.close()
    return statistics.median(t) * 1e6, os.sched_getcpu() if hasattr(os, "sched_getcpu") else -1

import os
if __name__ == "__main__":
    w = World(3, "cuda")
    try:
        for pdl in (True, False, True, False):
            print(f"pdl={pdl}: " + " ".join(f"{us:.1f}us(cpu{c})" for us, c in w.run(probe, pdl)))
    finally:
        w.close()
