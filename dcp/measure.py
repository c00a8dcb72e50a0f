"""Construction's plan step for ``auto``: time each candidate transport through the ``Transport``
interface over the ladder of call sizes, and agree on the plan (``dcp.plan`` decides from the
times)."""

import contextlib
import time

import torch
import torch.distributed as dist

from dcp import plan as auto_plan
from dcp.config import Config
from dcp.constants import KIND_COMBINE, KIND_GATHER, MASK_NONE, TAG_ABORT
from dcp.launch import gather_operands, launch_operands, metadata
from dcp.protocol import call_tag
from dcp.rendezvous import agree


def measure_plan(group: dist.ProcessGroup, config: Config, transports: dict, left_out: dict) -> tuple:
    """Collective: time every candidate in ``transports`` over the ladder of call sizes, agree on
    the plan from every rank's times, and where it splits a size's gather from its combine, time
    layers and agree again. Returns ``(plan, why)``; the caller closes the transports it leaves
    unused (every rank has synchronized by then: no kernel still uses them)."""
    t0 = time.perf_counter()
    mt, dev, cuda = config.max_tokens, config.device, config.device.type == "cuda"
    error = None
    try:  # inputs of max_tokens, and the timer; every rank has them before any rank calls
        po = torch.randn((mt, config.num_heads, config.head_dim), device=dev).to(config.dtype)
        lse = torch.randn((mt, config.num_heads), device=dev)
        y = torch.empty((mt, config.heads_per_rank, config.head_dim), dtype=config.dtype, device=dev)
        q16 = torch.randint(-1 << 15, 1 << 15, (mt, config.heads_per_rank, config.query_words), dtype=torch.int16,
                            device=dev)
        y16 = torch.empty((mt, config.num_heads, config.query_words), dtype=torch.int16, device=dev)
        calls = {KIND_COMBINE: (launch_operands(po, lse, y, None), po, lse, y),
                 KIND_GATHER: (gather_operands(q16, lse[:1, :1], y16), q16, lse[:1, :1], y16)}
        calls[auto_plan.COMBINE_META] = calls[KIND_COMBINE]
        # A decode batch's metadata (a token per sequence, none empty) for the layers timed with it.
        ones, starts = torch.ones(mt, dtype=torch.int32, device=dev), torch.arange(mt + 1, dtype=torch.int32, device=dev)
        unused = torch.empty(1, dtype=torch.int8, device=dev)
        metas = {b: metadata(dev, ones[:b], starts[:b + 1], unused, MASK_NONE) for b in auto_plan.ladder(mt)}
        timer = auto_plan.GraphTimer(dev) if cuda else auto_plan.HostTimer()
    except Exception as exc:  # reported to every rank by agree()
        error = f"{type(exc).__name__}: {exc}"
    agree(group, error, "auto: preparing the measurement")

    def runner(transport):
        def run(kind: int, b: int) -> None:
            operands, a, l, out = calls[kind]  # (also those of the [:b] slices launched: the same addresses)
            meta = metas[b] if kind == auto_plan.COMBINE_META else None
            kind = KIND_COMBINE if meta is not None else kind
            try:
                transport.launch(operands=operands, po=a[:b], lse=l if kind == KIND_GATHER else l[:b], y=out[:b],
                                 y_lse=None, n_tokens=b, tag=call_tag(kind, b), channel=0, base_e=True, meta=meta)
            except Exception:
                # The peers' call fails at once, not on the timeout: their next calls, on another
                # candidate, then meet this rank's in time.
                with contextlib.suppress(Exception):
                    transport.announce(0, TAG_ABORT)
                raise
        return run

    def failure(name: str):
        if cuda:
            torch.cuda.synchronize(dev)
        error = transports[name].error(0)
        return None if error is None else str(error)

    sizes, candidates = auto_plan.ladder(mt), list(transports)
    runs = {name: runner(t) for name, t in transports.items()}

    def timed(points: list) -> tuple:
        table, failed = auto_plan.measure(runs, failure, points, timer, warm=2 if cuda else 0,
                                          reps=8 if cuda else 1, rounds=3 if cuda else 1)
        if cuda:
            torch.cuda.synchronize(dev)
        return table, failed, time.perf_counter() - t0

    plan = auto_plan.agree_plan(group, *timed(auto_plan.op_points(candidates, sizes)), candidates, sizes, left_out,
                                mt)
    points = auto_plan.layer_points(plan)  # the same on every rank: so is the plan
    if points:
        plan = auto_plan.agree_plan(group, *timed(points), candidates, sizes, plan.left_out, mt, plan)
    why = f"measured in {plan.seconds:.2f} s: {plan.summary()}" + "".join(
        f"; {name} left out: {why}" for name, why in plan.left_out.items())
    return plan, why
