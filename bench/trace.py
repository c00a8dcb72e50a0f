"""Where the time of a lock-step call goes, from timestamps the kernel takes itself.

    python -m bench.trace [--world-size 3 6] [--batch 1 8 64 512] [--head-dim 512] [--heads-per-rank 16]
                          [--calls 8]

Every rank replays a CUDA graph of ``--calls`` calls (like a model's layers) with the trace compiled
in (``DCP_A2A_TRACE=1``). Device times (``%globaltimer``, one clock for all ranks of one GPU) split
each call of each rank into: the gap since its previous call had combined (epoch advance, kernel
exit, next launch; with programmatic launch, until the wait for the previous kernel returns), its
pushes up to the last flag published, the wait for the slowest peer to publish, the time from that
peer's publish until this rank had seen every tile (flag latency), and the combine. ``wait`` is
the peer wait and the flag latency together (this rank's last publish until it had seen every
tile). ``spread`` is how far apart the ranks started the call (the last rank's start minus the
first's): in graphs of one call it shows how long the ranks' graph launches keep the call waiting.
``wait`` needs no clock shared by the ranks, so with ranks on several GPUs (a clock each) read it,
the gap, the push, the combine and the period, not the peer wait, flag and spread columns. The
table gives medians over the calls after the first of each graph and over ranks (with
``--calls 1``, over every call: each is the first of its graph, and ``gap`` is then the first
call's gap).
The trace costs a few timer reads and stores per program: times run slightly above the untraced
benchmark's.
"""

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from dcp import DcpAllToAll
from dcp.reference import make_inputs
from dcp.spawn import World

PHASES = ("period", "gap", "push", "peer_wait", "flag", "wait", "combine", "spread")


def traced_calls(state, B: int, heads_per_rank: int, head_dim: int, calls: int, replays: int, num_warps) -> tuple:
    """Rank side: replay the graph; returns its calls' records, int64 [replays * calls, programs, 5],
    and the warps per program of its tiling."""
    os.environ["DCP_A2A_TRACE"] = "1"
    n, rank = dist.get_world_size(), dist.get_rank()
    if "comm" in state:
        state.pop("comm").close()
    comm = state["comm"] = DcpAllToAll(dist.group.WORLD, max_tokens=max(B, 1), num_heads=heads_per_rank * n,
                                       head_dim=head_dim, dtype=torch.bfloat16, backend="triton",
                                       num_warps=num_warps)
    outs, lses = make_inputs(B, n, B, comm.num_heads, head_dim, comm.dtype)
    po, pl = outs[rank].to(comm.device), lses[rank].to(comm.device)
    y = torch.empty((B, comm.heads_per_rank, head_dim), dtype=comm.dtype, device=comm.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            comm.lse_reduce(po, pl, out=y)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    for _ in range(replays):
        graph.replay()
    records = comm.trace().numpy()
    comm.check()
    return records[-replays * calls:], comm.tiling(max(B, 1))[0]  # (B = 0 launches B = 1's grid)


def phases(per_rank: list, calls: int) -> dict:
    """Median of each phase (ns) over ranks and over the calls that are not first in their graph
    (over every call in graphs of one call)."""
    recs = np.stack(per_rank)  # [ranks, calls, programs, 5]
    used = recs[..., 1] > 0
    big = np.iinfo(np.int64).max
    start = np.where(used, recs[..., 1], big).min(-1)
    last = lambda i: np.where(used, recs[..., i], 0).max(-1)
    pushed, arrived, combined = last(2), last(3), last(4)
    slowest_push = pushed.max(0, keepdims=True)
    out = {
        "period": start[:, 1:] - start[:, :-1],
        "gap": start[:, 1:] - combined[:, :-1],
        "push": pushed - start,
        "peer_wait": slowest_push - pushed,
        "flag": arrived - np.maximum(pushed, slowest_push),
        "wait": arrived - pushed,
        "combine": combined - arrived,
        "spread": start.max(0, keepdims=True) - start.min(0, keepdims=True),
    }
    first = (np.arange(recs.shape[1]) % calls) == 0  # first calls of their graph
    inner = ~first if calls > 1 else first
    med = lambda v: float(np.median(v)) if v.size else float("nan")
    res = {k: med(v[:, inner[1:] if v.shape[1] < recs.shape[1] else inner]) for k, v in out.items()}
    res["first_call_gap"] = med(out["gap"][:, first[1:]])
    res["programs"] = int(used[0, -1].sum())
    stamps = np.unique(recs[..., 1:][recs[..., 1:] > 0])
    res["timer_step"] = float(np.diff(stamps).min()) if len(stamps) > 1 else float("nan")
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.trace", description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, nargs="+", default=[3, 6])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 512],
                   help="tokens per call, a row per value (0: a call of no work, which still publishes and "
                        "waits for its peers' flags)")
    p.add_argument("--head-dim", type=int, default=512)
    p.add_argument("--heads-per-rank", type=int, default=16)
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--num-warps", type=int, default=None, help="fixed warps per program (default: by size)")
    p.add_argument("--out", default="results")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.trace needs a GPU (the trace reads the GPU's clock)")
    if args.replays * args.calls > 512:
        raise SystemExit("--replays x --calls must fit the trace ring of 512 calls")
    rows = []
    for n in args.world_size:
        w = World(n, "cuda", pg_backend="gloo")
        try:
            for B in args.batch:
                res = w.run(traced_calls, B, args.heads_per_rank, args.head_dim, args.calls, args.replays,
                            args.num_warps, timeout=300)
                rows.append(dict(world=n, B=B, heads_per_rank=args.heads_per_rank, head_dim=args.head_dim,
                                 num_warps=res[0][1],
                                 **phases([recs for recs, _ in res], args.calls)))
        finally:
            w.close()
    print("median us per call (graph of %d calls, %d heads per rank, D = %d)"
          % (args.calls, args.heads_per_rank, args.head_dim))
    print(f"{'N':>2} {'B':>4} {'warps':>5} {'progs':>5} " + " ".join(f"{k:>9}" for k in PHASES)
          + f" {'1st gap':>8} {'tick':>5}")
    for r in rows:
        print(f"{r['world']:>2} {r['B']:>4} {r['num_warps']:>5} {r['programs']:>5} "
              + " ".join(f"{r[k] / 1e3:>9.2f}" for k in PHASES)
              + f" {r['first_call_gap'] / 1e3:>8.2f} {r['timer_step']:>5.0f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "trace.json"), "a") as f:
        f.write(json.dumps({"command": "python -m bench.trace " + " ".join(sys.argv[1:] if argv is None else argv),
                            "git_commit": os.environ.get("DCP_GIT_COMMIT", "unknown"), "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
