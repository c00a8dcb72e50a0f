"""Probe (session of d800eae): what one step costs N ranks sharing one GPU under MPS when it holds
no exchange at all, beside one that holds a call. Each rank queues 200 steps behind the benchmark's
hold and times them with clock marks; per rank the median us per step, then the slowest rank's.
Run from the repository root under MPS: `PYTHONPATH=. python3 docs/results/h200_graph_floor/floor.py
[N ...]` (default N = 1 2 3 6).
Its loop is `bench.ranks.held_steps` since e83e230 (run again at 09bc65f:
`docs/results/h200_mark_launch/floor.log`).
"""
import statistics
import sys

import torch

from bench import ranks
from dcp.reference import make_inputs
from dcp.spawn import World

STEPS = 200


def _held(state, step, marks) -> list:
    timed = ranks.held_steps(state, marks, step, STEPS, STEPS * 60)
    return timed.step_us if timed.held else []


def _held_pairs(state, replay, pairs) -> list:
    """Steps whose graph holds two marks: ``held_steps`` expects one mark per step."""
    def enqueue() -> None:
        pairs.restart()
        for _ in range(STEPS):
            replay()
        pairs.mark()

    held = ranks.held_run(state, STEPS * 60, enqueue)[0]
    return pairs.intervals(2 * STEPS + 1) if held else []


def _median(xs: list) -> float:
    return statistics.median(xs) if xs else float("nan")


def probe(state, n: int) -> dict:
    ranks.calibrate(state)
    marks = ranks.Marks("clock", STEPS)
    marks.mark()
    torch.cuda.synchronize()
    res = {"clock kernel launched alone": _median(_held(state, marks.mark, marks))}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        marks.mark()
    res["graph: clock kernel"] = _median(_held(state, graph.replay, marks))
    pairs = ranks.Marks("clock", 2 * STEPS)
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph2):
        pairs.mark()
        pairs.mark()
    t = _held_pairs(state, graph2.replay, pairs)
    res["graph: two clock kernels"] = _median([a + b for a, b in zip(t[::2], t[1::2])])
    res["  of which first to second node"] = _median(t[::2])
    if n > 1:
        ranks.setup(state, 16, 512, 8, "cuda", "triton")
        comm = state["comm"]
        for B in (1, 8):
            outs, lses = make_inputs(B, n, B, comm.num_heads, comm.head_dim, comm.dtype)
            po, pl = outs[comm.rank].cuda(), lses[comm.rank].cuda()
            y = torch.empty((B, comm.heads_per_rank, comm.head_dim), dtype=comm.dtype, device="cuda")
            comm.lse_reduce(po, pl, out=y)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                marks.mark()
                comm.lse_reduce(po, pl, out=y)
            res[f"graph: clock kernel and a call, B = {B}"] = _median(_held(state, g.replay, marks))
        comm.check(synchronize=True)
    return res


if __name__ == "__main__":
    sizes = [int(a) for a in sys.argv[1:]] or [1, 2, 3, 6]
    table = {}
    for n in sizes:
        w = World(n, "cuda")
        try:
            for r, res in enumerate(w.run(probe, n, timeout=300)):
                print(f"N={n} rank {r}: " + ", ".join(f"{k}: {v:.2f}" for k, v in res.items()), flush=True)
                for k, v in res.items():
                    prev = table.setdefault(k, {}).get(n, float("-inf"))
                    table[k][n] = v if v != v or prev != prev else max(v, prev)  # nan stays
        finally:
            w.close()
    print("median us per step, slowest rank (nan: a queue did not hold)")
    print(f"{'step':42s}" + "".join(f"{'N=' + str(n):>8s}" for n in sizes))
    for k, row in table.items():
        print(f"{k:42s}" + "".join(f"{row.get(n, float('nan')):8.2f}" for n in sizes))
