"""Probe: why NCCL's graph rows do not hold their queue on two GPUs (`held` NO in every sweep).

Per rank, a graph of one B = 8 call (D = 512, 16 heads per rank), of the bare
`all_to_all_single` of NCCL's path, or of two torch ops with and without an event record and wait
between them, is replayed 400 times behind a 200 ms sleeping kernel; each
replay's host time says whether launches block before the sleep ends. The graphs' node types come
from cudaGraphGetNodes (and a DOT dump of each graph). Run from the repository root on two GPUs:
`PYTHONPATH=. python3 docs/results/h200x2_nccl_graph/probe.py $OUT`.
"""
import collections
import ctypes
import statistics
import sys
import time

import torch
import torch.distributed as dist

from bench import ranks
from dcp import DcpAllToAll, cudart
from dcp.reference import make_inputs
from dcp.spawn import World

REPLAYS = 400
HOLD_US = 200_000
# cudaGraphNodeType values, in order
NODE_TYPES = ("kernel", "memcpy", "memset", "host", "child graph", "empty", "wait event", "event record",
              "ext semaphore signal", "ext semaphore wait", "mem alloc", "mem free", "batch mem op", "conditional")


def _node_types(handle: int, dot: str) -> dict:
    """The captured graph's node types (cudaGraphGetNodes), and its DOT dump for the record."""
    lib, graph = cudart._cudart(), ctypes.c_void_p(handle)
    count = ctypes.c_size_t(0)
    cudart._check(lib.cudaGraphGetNodes(graph, None, ctypes.byref(count)), "cudaGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    cudart._check(lib.cudaGraphGetNodes(graph, nodes, ctypes.byref(count)), "cudaGraphGetNodes")
    types = collections.Counter()
    for node in nodes:
        kind = ctypes.c_int(-1)
        cudart._check(lib.cudaGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cudaGraphNodeGetType")
        types[NODE_TYPES[kind.value] if 0 <= kind.value < len(NODE_TYPES) else str(kind.value)] += 1
    cudart._check(lib.cudaGraphDebugDotPrint(graph, dot.encode(), ctypes.c_uint(1)), "cudaGraphDebugDotPrint")
    return dict(types)


def _replays(state, replay) -> dict:
    """Host us per replay, queued behind the sleep; the replay at which the sleep had ended."""
    first = torch.cuda.Event()
    dist.barrier()
    torch.cuda._sleep(int(state["cycles_per_us"] * HOLD_US))
    first.record()
    host, ended = [], None
    for i in range(REPLAYS):
        t0 = time.perf_counter()
        replay()
        host.append((time.perf_counter() - t0) * 1e6)
        if ended is None and first.query():
            ended = i
    torch.cuda.synchronize()
    blocked = [i for i, h in enumerate(host) if h > 1000]
    return dict(first_blocked=blocked[0] if blocked else None, blocked=len(blocked), hold_ended_at=ended,
                median_us=round(statistics.median(host), 1), max_us=round(max(host)),
                total_ms=round(sum(host) / 1e3, 1))


def _captured(fn, dot: str):
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        fn()
    nodes = _node_types(g.raw_cuda_graph(), dot)
    g.instantiate()
    g.replay()
    torch.cuda.synchronize()
    return g, nodes


def probe(state, out: str) -> dict:
    ranks.calibrate(state)
    res = {}
    x, ev = torch.zeros(1, device="cuda"), torch.cuda.Event(external=True)
    rank = dist.get_rank()

    def with_events() -> None:  # as torch's process group joins its NCCL stream: event nodes
        x.add_(1)
        ev.record()
        torch.cuda.current_stream().wait_event(ev)
        x.add_(1)

    for name, fn in (("two torch add_", lambda: (x.add_(1), x.add_(1))),
                     ("two torch add_ around an event record and wait", with_events)):
        g, nodes = _captured(fn, f"{out}/{name.replace(' ', '_')}_rank{rank}.dot")
        res[name] = dict(nodes=nodes, **_replays(state, g.replay))
        del g
    for backend in ("triton", "nccl"):
        comm = DcpAllToAll(dist.group.WORLD, max_tokens=8, num_heads=32, head_dim=512, backend=backend)
        outs, lses = make_inputs(1, 2, 8, 32, 512, comm.dtype)
        po, pl = outs[comm.rank].cuda(), lses[comm.rank].cuda()
        y = torch.empty((8, 16, 512), dtype=comm.dtype, device="cuda")
        g, nodes = _captured(lambda: comm.lse_reduce(po, pl, out=y), f"{out}/{backend}_rank{comm.rank}.dot")
        res[f"{backend} call"] = dict(nodes=nodes, **_replays(state, g.replay))
        if backend == "nccl":
            send, recv = comm._transport.send[0][:4096], comm._transport.recv[0][:4096]
            g2, nodes = _captured(lambda: dist.all_to_all_single(recv, send), f"{out}/a2a_rank{comm.rank}.dot")
            res["bare all_to_all_single"] = dict(nodes=nodes, **_replays(state, g2.replay))
            del g2
        del g
        comm.check()
        comm.close()
    return res


if __name__ == "__main__":
    w = World(2, "cuda", pg_backend="nccl")
    try:
        for r, res in enumerate(w.run(probe, sys.argv[1], timeout=300)):
            for k, v in res.items():
                print(f"rank {r} {k}: {v}", flush=True)
    finally:
        w.close()
