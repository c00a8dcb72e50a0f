"""What every rank runs during a benchmark: check one point against the reference, then time it.

On a GPU the timed calls are queued behind a sleeping kernel long enough for the host to enqueue
all of them (nvbench's blocking kernel), so that device times are of the calls back to back rather
than of the Python loop that launches them; host time per call is measured separately. A point
whose queue ran dry before the host finished (the first timed call had already started) is
reported as not held. Where launches blocked on a full queue (CUDA lets only some tens of replays
of NCCL's captured graphs wait in a stream), the steps are queued in chunks that fit, each behind a
hold of its own (``steps_per_hold``). Two loops: a mark between consecutive steps (median, p10,
p90 of the time from one mark to the next), then, as nccl-tests does, one pair of events around
all steps (``loop_us``, the mean per call with nothing between the steps: in graph modes it replays
graphs captured without the mark); its host time per call (``host_loop_us``) is the launch rate
with nothing queued between calls.

A mark is a one-thread kernel that stores the GPU's clock (``timer="clock"``, the default) or a
CUDA event (``"events"``). Under MPS on one H200 an event between steps read up to 13 us more per
step than the clock kernel (N = 6, B = 8, eager; docs/design.md, section 6), more than a small
call takes. A step's time includes one mark, whose own cost (marks back to back with nothing
between) is reported as ``mark_us``. In graph modes the clock mark is the graph's first node, so
that a step is one replay, as a model replays its graphs, and not a replay plus a launch of its own.
"""

import statistics
import time
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from dcp import DcpAllToAll
from dcp.reference import (chunk_reference, decode_metadata, make_inputs, make_queries, mask_by_metadata,
                           max_rel_error)
from dcp.constants import KIND_GATHER
from dcp.kernels import build_kernels

MARK_PROBES = 100  # marks timed back to back in setup: what one costs


def _percentiles(xs: list) -> dict:
    xs = sorted(xs)
    q = lambda p: xs[min(len(xs) - 1, int(p * len(xs)))]
    return {"median_us": statistics.median(xs), "p10_us": q(0.1), "p90_us": q(0.9)}


def setup(state, heads_per_rank: int, head_dim: int, max_tokens: int, device: str, backend: str,
          num_warps=None, pdl=None, timer: str = "clock", dtype: str = "bfloat16", query_dim: int = 0,
          query_dtype: str = "bfloat16") -> dict:
    """Build this rank's communicator; returns, by op, the tiling of each call size from 1 to
    ``max_tokens`` (warps per program, programmatic dependent launch: ``DcpAllToAll.tiling``), and
    ``auto``'s plan (None for the other backends), and whether each size's gather is
    pulled (its floor counts fewer bytes)."""
    if "comm" in state:
        state.pop("comm").close()
    n = dist.get_world_size()
    state["comm"] = comm = DcpAllToAll(dist.group.WORLD, max_tokens=max_tokens, num_heads=heads_per_rank * n,
                                       head_dim=head_dim, dtype=getattr(torch, dtype), device=device, backend=backend,
                                       num_warps=num_warps, pdl=pdl, query_dim=query_dim or head_dim,
                                       query_dtype=getattr(torch, query_dtype))
    if comm.device.type == "cuda":
        calibrate(state)
        state["timer"] = timer
        # What a mark costs with nothing between two of them (each timed step includes one).
        probe = Marks(timer, MARK_PROBES)
        probe.mark()  # compiles the clock kernel outside the hold (and before any capture)
        torch.cuda.synchronize()
        timed = held_steps(state, probe, probe.mark, MARK_PROBES, MARK_PROBES * 100)
        state["mark_us"] = max(gather(statistics.median(timed.step_us))) if timed.held else float("nan")
    combine = [comm.tiling(b) for b in range(1, max_tokens + 1)]
    sizes = range(1, max_tokens + 1)
    pulled = [(comm.plan.transport(KIND_GATHER, b) if comm.plan else comm.backend) == "pull" for b in sizes]
    return {"combine": combine, "gather": [comm.tiling(b, gather=True) for b in sizes], "layer": combine,
            "plan": comm.plan, "gather_pulled": pulled, "backend": comm.backend, "reason": comm.backend_reason}


def calibrate(state) -> None:
    """Sleep cycles per microsecond, for ``_hold``."""
    if "cycles_per_us" in state:
        return
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(10 ** 7)
    b.record()
    b.synchronize()
    # One rate for all ranks (the fastest clock seen), so that equal holds last equally long:
    # a rank that calibrated while the GPU idled at a low clock would otherwise start late.
    state["cycles_per_us"] = max(gather(10 ** 7 / (a.elapsed_time(b) * 1e3)))


# A launch that took longer than this waited for a full queue to drain: CUDA lets only some tens of
# replays of NCCL's captured graphs wait in a stream (docs/design.md, section 6).
BLOCKED_US = 500


def held_run(state, hold_us: float, enqueue, tries: int = 3) -> tuple:
    """Queue ``enqueue()``'s work behind a sleeping kernel of ``hold_us``; while some rank's queue
    ran dry (its first queued work had started before its host finished), redo it with a 4x longer
    hold, ``tries`` times in all. ``enqueue()`` returns the index of its first launch that blocked,
    or None; where launches blocked in two attempts in a row, a longer hold cannot help (a host
    that stalled once would not block twice), and it stops. Returns whether every rank's queue
    held, the last attempt, and the earliest blocked launch of any rank in it (or None)."""
    before = None
    for attempt in range(tries):
        first = torch.cuda.Event()
        _hold(state, hold_us * 4 ** attempt)
        first.record()
        blocked = enqueue()
        held = not first.query()
        torch.cuda.synchronize()
        seen = gather((held, blocked))
        blocked = min((b for _, b in seen if b is not None), default=None)
        if all(h for h, _ in seen):
            return True, attempt, blocked
        if blocked is not None and before is not None:
            break
        before = blocked
    return False, attempt, blocked


class HeldSteps(NamedTuple):
    held: bool  # every rank's queue held, in every chunk
    attempt: int  # of the last chunk's hold (held_run)
    host_us: list  # each step's host time, marks left out
    step_us: list  # device time between consecutive marks
    chunk: int  # steps queued behind one hold


def held_steps(state, marks: "Marks", step, steps: int, hold_us: float, mark_each: bool = False) -> HeldSteps:
    """Queue ``steps`` steps, then the mark that ends the last, behind a hold (``held_run``); with
    ``mark_each`` a mark before each step, else the step is or holds its own marks. Where launches
    blocked on a full queue (``held_run``), start over in chunks of half the steps that fitted, each
    chunk behind a hold of its own (its share of ``hold_us``) and timed between its own marks."""
    chunk = steps
    while True:
        host, times = [], []
        for first in range(0, steps, chunk):
            n = min(chunk, steps - first)
            part: list = []

            def enqueue() -> Optional[int]:
                marks.restart()
                part.clear()
                for _ in range(n):
                    if mark_each:
                        marks.mark()
                    t0 = time.perf_counter()
                    step()
                    part.append((time.perf_counter() - t0) * 1e6)
                marks.mark()
                return next((i for i, t in enumerate(part) if t > BLOCKED_US), None)

            held, attempt, blocked = held_run(state, hold_us * n / steps, enqueue)
            host += part
            if not held:
                break
            times += marks.intervals(n + 1)
        if held or blocked is None or chunk == 1:
            return HeldSteps(held, attempt, host, times, chunk)
        chunk = max(1, blocked // 2)


class Marks:
    """Marks between timed steps: ``mark()`` queues the next of ``steps + 1``; ``intervals()`` gives
    the device microseconds between consecutive marks once they have run, and raises unless exactly
    the expected number ran since ``restart()``. A clock mark takes its slot from a counter on the
    device, so a CUDA graph may hold it (``capturable``); an event is recorded by the host."""

    def __init__(self, timer: str, steps: int):
        self.steps, self.capturable, self.count = steps, timer == "clock", 0
        if self.capturable:
            self.stamps = torch.zeros(steps + 2, dtype=torch.int64, device="cuda")  # the last: marks run
            self.clock = build_kernels(interpret=False).clock
            self.launch = None
        else:
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]

    def mark(self) -> None:
        if self.capturable:
            # After the first launch, the compiled kernel's own launcher: Triton's JIT entry rebinds
            # the arguments and recomputes the kernel's key on every launch, between timed calls.
            if self.launch is None:
                self.launch = self.clock[(1,)](self.stamps, self.steps + 1, enable_fp_fusion=True)[(1, 1, 1)]
            else:
                self.launch(self.stamps, self.steps + 1)
            return
        if self.count <= self.steps:  # marks beyond the last are counted, for intervals() to raise
            self.events[self.count].record()
        self.count += 1

    def restart(self) -> None:
        """Start over with the first mark (for clock marks: queued, as their counter lives on the device)."""
        self.count = 0
        if self.capturable:
            self.stamps[-1].zero_()

    def intervals(self, count: Optional[int] = None) -> list:
        """``count``: the marks expected since ``restart()``, at most (and by default) ``steps + 1``."""
        count = self.steps + 1 if count is None else count
        if self.capturable:
            stamps = self.stamps.tolist()
            self.count = stamps.pop()
        if self.count != count or count > self.steps + 1:
            raise RuntimeError(f"{self.count} marks ran where {count} were expected")
        if self.capturable:
            return [(b - a) / 1e3 for a, b in zip(stamps[:count], stamps[1:count])]
        return [a.elapsed_time(b) * 1e3 for a, b in zip(self.events[:count], self.events[1:count])]


def gather(value) -> list:
    """Every rank's value, on every rank."""
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, value)
    return seen


def _hold(state, us: float) -> None:
    """Queue a sleeping kernel of about ``us`` microseconds (at least 1 ms) after a barrier."""
    dist.barrier()
    torch.cuda._sleep(int(state["cycles_per_us"] * (us + 1000)))


def run_point(state, B: int, mode: str, iters: int, seed: int, op: str = "combine", metadata: bool = False) -> dict:
    """mode: eager, graph (one call per graph) or graph8 (eight calls per graph, like layers); op:
    combine (``lse_reduce``), gather (``all_gather_heads``) or layer (a gather, then a combine).
    ``metadata``: every combine gets a decode batch's ``seq_lens`` and ``query_start_loc``, as vLLM's
    MLA layers pass them, a step per timed step. Each op's result is checked, first and after the
    timed steps: the combine against float64 (of the LSEs the metadata masks), the gather byte for
    byte."""
    comm: DcpAllToAll = state["comm"]
    dev, n, rank, hn = comm.device, comm.world, comm.rank, comm.heads_per_rank
    H, D = comm.num_heads, comm.head_dim
    outs, lses = make_inputs(seed, n, B, H, D, comm.dtype)
    po, pl = outs[rank].to(dev), lses[rank].to(dev)
    y = torch.full((B, hn, D), float("nan"), dtype=comm.dtype, device=dev)
    qs = make_queries(seed + 1, n, B, hn, comm.query_dim, comm.query_dtype)
    q = qs[rank].to(dev)
    q_all = torch.empty((B, H, comm.query_dim), dtype=comm.query_dtype, device=dev)
    meta = {}
    if metadata:
        lens, qsl = decode_metadata(seed + 2, n, B)
        lses = [mask_by_metadata(l, s, qsl) for l, s in zip(lses, lens)]  # for the reference
        meta = dict(seq_lens=lens[rank].to(dev), query_start_loc=qsl.to(dev))
    # One model step per timed step (a graph, or an eager call), as vLLM's forward context: a graph8
    # step's first combine searches the metadata, the other seven read its verdicts.
    step = [None]
    combine = lambda: comm.lse_reduce(po, pl, out=y, step=step[0], **meta)
    gather_q = lambda: comm.all_gather_heads(q, out=q_all)

    def layer() -> None:
        gather_q()
        combine()

    call = {"combine": combine, "gather": gather_q, "layer": layer}[op]

    def checked(when: str) -> float:
        """The largest relative error of the combine's result (0 for a gather); raises on a wrong one."""
        err = 0.0
        if op != "gather":
            err = max_rel_error(y, chunk_reference(outs, lses, rank, hn)[0])
            assert err < 1.6e-2, f"B={B}: result {when} differs from the reference ({err})"
        if op != "combine":
            want = torch.cat(qs, dim=1).view(torch.uint8)
            assert torch.equal(q_all.cpu().view(torch.uint8), want), f"B={B}: the gather {when} differs"
        return err

    call()
    err = checked("of the first call")
    y.fill_(float("nan"))  # poisoned: the check after the timed steps sees only what they wrote
    q_all.fill_(float("nan"))
    cuda = dev.type == "cuda"
    calls = 8 if mode == "graph8" else 1
    marks = Marks(state["timer"], iters) if cuda else None
    in_graph = cuda and marks.capturable and mode.startswith("graph")

    def captured(with_mark: bool):
        graph = torch.cuda.CUDAGraph()
        step[0] = object()
        with torch.cuda.graph(graph):
            if with_mark:
                marks.mark()
            for _ in range(calls):
                call()
        return graph.replay

    def eager() -> None:
        step[0] = object()
        call()

    if mode.startswith("graph"):
        timed_step = captured(in_graph)
        # The second loop replays graphs without the mark: nothing but the calls between its events.
        plain_step = captured(False) if in_graph else timed_step
    else:
        timed_step = plain_step = eager if metadata else call
    mark = marks.mark if cuda and not in_graph else lambda: None
    t0 = time.perf_counter()
    for _ in range(min(10, iters)):
        mark()
        timed_step()
    warm_us = (time.perf_counter() - t0) * 1e6 / min(10, iters)  # host time per marked step
    if plain_step is not timed_step:
        plain_step()  # a graph's first replay uploads it
    if cuda:
        torch.cuda.synchronize()
    # Every rank holds its queue equally long (the slowest host's estimate), so the ranks start
    # their timed calls together.
    warm_us = max(gather(warm_us))
    times, held, loop, host_loop, chunk = [], True, float("nan"), float("nan"), iters
    if cuda:
        # Held three times the loop's expected host time, longer where that ran dry; the second
        # loop as long as the first's last hold, in the same chunks.
        timed = held_steps(state, marks, timed_step, iters, 3 * iters * warm_us, mark_each=not in_graph)
        held, host, chunk = timed.held, timed.host_us, timed.chunk
        times = [t / calls for t in timed.step_us]
        # nccl-tests' way: one pair of events around the loop (each chunk), none between steps.
        loop_us, host_loop_s = 0.0, 0.0
        for first in range(0, iters, chunk):
            n = min(chunk, iters - first)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

            def plain() -> None:
                nonlocal host_loop_s
                a.record()
                t0 = time.perf_counter()
                for _ in range(n):
                    plain_step()
                host_loop_s += time.perf_counter() - t0
                b.record()

            held = held_run(state, 3 * n * warm_us * 4 ** timed.attempt, plain, tries=1)[0] and held
            loop_us += a.elapsed_time(b) * 1e3
        host_loop = host_loop_s * 1e6 / iters
        loop = loop_us / (iters * calls)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            timed_step()
            times.append((time.perf_counter() - t0) * 1e6)
        host = times
    dist.barrier()
    comm.check()
    err = max(err, checked("of the last timed step"))  # (graph8: a call that read its step's verdicts)
    res = _percentiles(times)
    res["host_us"] = statistics.median(host) / calls
    res["host_loop_us"] = host_loop / calls
    res["held"], res["loop_us"], res["steps_per_hold"] = held, loop, chunk
    res["mark_us"] = state.get("mark_us", float("nan"))
    res["timer"] = (state["timer"] + " in graph" if in_graph else state["timer"]) if cuda else "host"
    res["max_rel_err"] = err
    return res

