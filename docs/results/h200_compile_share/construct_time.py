"""Seconds a DcpAllToAll constructor takes per rank, with a cold Triton cache and then with the cache
the first world left on disk (a restarted server), in fresh rank processes each time.

    PYTHONPATH=<tree> python3 construct_time.py --world-size 3 [--max-tokens 512 --head-dim 512]

Runs the tree on PYTHONPATH (this script only times its constructor), ranks under MPS on one GPU.
"""

import argparse
import tempfile
import time

import torch.distributed as dist


def construct(state, **kwargs) -> float:
    import torch
    from dcp import DcpAllToAll

    dist.barrier()
    t0 = time.perf_counter()
    comm = DcpAllToAll(dist.group.WORLD, device="cuda", **kwargs)
    seconds = time.perf_counter() - t0
    tilings = sorted({comm.tiling(b)[0] for b in range(1, comm.max_tokens + 1)})
    comm.close()
    torch.cuda.synchronize()
    return seconds, tilings


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world-size", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--head-dim", type=int, default=512)
    args = p.parse_args()
    from dcp import __file__ as tree
    from dcp.spawn import World

    cache = tempfile.mkdtemp(prefix="triton-cache-")
    kwargs = dict(max_tokens=args.max_tokens, num_heads=16 * args.world_size, head_dim=args.head_dim)
    for label in ("cold cache", "warm cache"):
        w = World(args.world_size, "cuda", env={"TRITON_CACHE_DIR": cache})
        try:
            res = w.run(construct, timeout=500, **kwargs)
        finally:
            w.close()
        per_rank = " ".join(f"{s:6.1f}" for s, _ in res)
        print(f"{tree}  N={args.world_size} B_max={args.max_tokens} D={args.head_dim} tilings={res[0][1]} "
              f"{label}: s per rank {per_rank}  slowest {max(s for s, _ in res):.1f}", flush=True)


if __name__ == "__main__":
    main()
