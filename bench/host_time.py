"""Where the host time of an eager call goes: each step of ``lse_reduce`` timed on its own.

    python -m bench.host_time [--world-size 3] [--batch 8] [--head-dim 512] [--iters 2000]

Every rank runs the same sequence (steps that launch the kernel do so on all ranks, so every
launch completes); the table gives the median per rank and step, and a profile of rank 0. The held
step launches behind a sleeping kernel, as the benchmark's timed loops do, and only as many calls
as the benchmark times by default (some thousands of queued launches block until the queue
drains); the others launch into a queue that the GPU keeps up with. On a GPU, the launcher's entry
point called with every argument prepared shows the floor of a Triton launch from Python, and the
reads alone (each tensor's shape, dtype, device, strides and address, all a call must know of
them) what any checked launch from Python adds to it.
"""

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.distributed as dist

from dcp import DcpAllToAll
from dcp.checks import combine_batch
from dcp.launch import launch_operands
from dcp.protocol import call_tag
from dcp.constants import KIND_COMBINE
from dcp.reference import make_inputs
from dcp.spawn import World
from .ranks import Marks, calibrate, held_run

HOLD_US_PER_CALL = 50  # the held step's sleeping kernel: more than a call takes to launch
HELD_CALLS = 200  # the held step's calls: the benchmark's default --iters, which its queues hold
HELD_STEP = "lse_reduce (out=, queue held)"


def _median_us(step, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _reads(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    """What a combine must read of its three tensors, and nothing else (unrolled: a loop costs more
    than some reads): the floor of its checks and operands."""
    a.shape, a.dtype, a.device, a.stride(), a.data_ptr()
    b.shape, b.dtype, b.device, b.stride(), b.data_ptr()
    c.shape, c.dtype, c.device, c.stride(), c.data_ptr()


def probe(state, B: int, head_dim: int, iters: int, device: str) -> dict:
    n, rank = dist.get_world_size(), dist.get_rank()
    comm = DcpAllToAll(dist.group.WORLD, max_tokens=B, num_heads=16 * n, head_dim=head_dim,
                       dtype=torch.bfloat16, device=device, backend="triton")
    outs, lses = make_inputs(rank, n, B, comm.num_heads, head_dim, comm.dtype)
    po, pl = outs[rank].to(comm.device), lses[rank].to(comm.device)
    y = torch.empty((B, comm.heads_per_rank, head_dim), dtype=comm.dtype, device=comm.device)
    t = comm._transport
    operands = launch_operands(po, pl, y, None)
    tag = call_tag(KIND_COMBINE, B)
    one = torch.zeros(1, device=comm.device)
    cuda = comm.device.type == "cuda"
    launch = lambda: t.launch(operands=operands, po=po, lse=pl, y=y, y_lse=None, n_tokens=B, tag=tag, channel=0,
                              base_e=True)
    # The floor of a launch from Python: the loaded variant's entry point with every argument read
    # beforehand (those that transport.launch passes it, caught from one call that launches nothing).
    fused, grid = t.by_size[KIND_COMBINE][B - 1]
    caught = []
    t.by_size[KIND_COMBINE][B - 1] = (lambda *args: caught.append(args), grid)
    try:
        launch()
    finally:
        t.by_size[KIND_COMBINE][B - 1] = (fused, grid)
    entry = fused.bound(*caught[0])  # (None on the CPU: nothing is compiled there)
    # (every rank must run the same steps: a GPU's communicator loads this variant when it is built)
    assert entry is not None or not cuda, "the combine's variant is not loaded"
    sl = torch.ones(B, dtype=torch.int32, device=comm.device)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=comm.device)
    step = object()  # (one step throughout: its calls after the first read the first's verdicts)
    steps = {
        "lse_reduce (out= given)": lambda: comm.lse_reduce(po, pl, out=y),
        "lse_reduce (out=, metadata)": lambda: comm.lse_reduce(po, pl, out=y, seq_lens=sl, query_start_loc=qsl),
        "lse_reduce (out=, metadata, a step)": lambda: comm.lse_reduce(po, pl, out=y, seq_lens=sl,
                                                                       query_start_loc=qsl, step=step),
        HELD_STEP: lambda: comm.lse_reduce(po, pl, out=y),
        "lse_reduce (allocates out)": lambda: comm.lse_reduce(po, pl),
        "  combine_batch (checks)": lambda: combine_batch(comm._geometry, po, pl, y, None),
        "  launch_operands": lambda: launch_operands(po, pl, y, None),
        "  transport.launch": launch,
        **({"    the launcher's entry alone": entry} if entry else {}),
        "  the tensors' reads alone": lambda: _reads(po, pl, y),
        "for scale: a 1-element torch add_": lambda: one.add_(1),
        "empty step (timer only)": lambda: None,
    }
    if cuda:
        steps["for scale: the benchmark's clock mark"] = Marks("clock", 1).mark  # between its eager steps
        calibrate(state)
    res, held = {}, True
    for name, step in steps.items():
        step()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        if name == HELD_STEP and cuda:
            # As in the benchmark: the calls are queued behind a sleeping kernel, not run as launched.
            held = held_run(state, HELD_CALLS * HOLD_US_PER_CALL,
                            lambda: res.__setitem__(name, _median_us(step, min(iters, HELD_CALLS))))[0]
        else:
            res[name] = _median_us(step, iters)
        if cuda:
            torch.cuda.synchronize()
    prof = cProfile.Profile()
    dist.barrier()
    prof.enable()
    for _ in range(iters // 4):
        comm.lse_reduce(po, pl, out=y)
    prof.disable()
    if comm.device.type == "cuda":
        torch.cuda.synchronize()
    comm.check()
    comm.close()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
    res["profile"] = text.getvalue() if rank == 0 else ""
    res["held"] = held
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=512)
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    iters = args.iters if device == "cuda" else min(args.iters, 20)
    w = World(args.world_size, device)
    try:
        res = w.run(probe, args.batch, args.head_dim, iters, device, timeout=600)
    finally:
        w.close()
    print(f"host time per step, median us over {iters} calls (the held step: {min(iters, HELD_CALLS)}; "
          f"N={args.world_size}, B={args.batch}, D={args.head_dim}, {device})")
    print(f"{'step':<36}" + "".join(f"{'rank ' + str(r):>10}" for r in range(len(res))))
    for name in res[0]:
        if name not in ("profile", "held"):
            print(f"{name:<36}" + "".join(f"{r[name]:>10.1f}" for r in res))
    if not all(r["held"] for r in res):
        print("the held step's queue ran dry before its calls were all launched, in every try: its median "
              "mixes held and unheld calls")
    print(res[0]["profile"])


if __name__ == "__main__":
    main()
