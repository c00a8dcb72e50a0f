"""Rank functions for ``backend="auto"`` (``tests/test_auto.py``): construction with the measured
plan, its tables made up or its measurement made to fail on chosen ranks."""

import contextlib
import os
from unittest import mock

import torch.distributed as dist

import dcp.buffers
import dcp.plan
from dcp import DcpAllToAll
from dcp.transports import TritonTransport
from dcp.constants import KIND_COMBINE, KIND_GATHER, TAG_ABORT, TAG_POISONED


def make_auto(state, key: str, tables=None, fail_on: int = -1, fail: str = "", fail_phase: int = 0,
              measure: str = "1", second_open_fails_on: int = -1, **kwargs) -> dict:
    """Construct with ``backend="auto"`` and measuring on (``measure``: ``DCP_A2A_MEASURE``).

    ``tables``: per rank, ``{key: us}`` (``(candidate, kind, size)`` or ``(LAYER, gather's,
    combine's, size)``) this rank reports instead of timing; points not in it are timed for real.
    ``fail`` on rank ``fail_on``: that candidate's launches raise there from the first measured call
    of phase ``fail_phase`` (0: the collectives alone, 1: the layers), its announcements excepted.
    ``second_open_fails_on``: that rank's second buffer setup (the pull's) fails. Each
    transport's launches are counted from then on (``counts``)."""
    real, real_launch = dcp.plan.measure, TritonTransport.launch
    rank, phases = dist.get_rank(), []

    def failing(self, *args, **kw):
        tag = kw["tag"] if "tag" in kw else args[6]  # (Transport.launch's order)
        if self.name == fail and tag not in (TAG_ABORT, TAG_POISONED):
            raise RuntimeError("injected failure")
        return real_launch(self, *args, **kw)

    def fake(runs, failure, points, timer, **kw):
        made = {tuple(k): v for k, v in tables[rank]} if tables is not None else {}
        timed = [p for p in points if p[0] + (p[2],) not in made]
        breaking = rank == fail_on and len(phases) == fail_phase
        phases.append(points)
        with mock.patch.object(TritonTransport, "launch", failing) if breaking else contextlib.nullcontext():
            table, failed = real(runs, failure, timed, timer, **kw) if timed else ({}, {})
        table.update({key + (b,): made[key + (b,)] for key, _, b in points if key + (b,) in made})
        return table, failed

    provider = dcp.buffers.HostShmProvider
    real_open, opened = provider.open, []

    def open_(self, group, nbytes):
        opened.append(nbytes)
        if len(opened) == 2 and rank == second_open_fails_on:
            with mock.patch.object(provider, "_map", side_effect=OSError("injected failure")):
                return real_open(self, group, nbytes)
        return real_open(self, group, nbytes)

    with mock.patch.object(dcp.plan, "measure", fake), mock.patch.dict(os.environ, {"DCP_A2A_MEASURE": measure}), \
            mock.patch.object(provider, "open", open_):
        comm = state[key] = DcpAllToAll(dist.group.WORLD, backend="auto", **kwargs)
    state[key + "/counts"] = counts = {name: 0 for name in comm._transports}
    for name, transport in comm._transports.items():
        def counted(*args, _launch=transport.launch, _name=name, **kw):
            counts[_name] += 1
            return _launch(*args, **kw)
        transport.launch = counted
    plan = comm.plan
    return {"backend": comm.backend, "reason": comm.backend_reason, "in_use": list(comm._transports),
            "plan": plan and plan.as_dict() | {"seconds": None}, "text": plan and str(plan),
            "by_size": plan and {k: plan.by_size[k] for k in (KIND_COMBINE, KIND_GATHER)},
            "phases": len(phases)}


def counts(state, key: str, reset: bool = True) -> dict:
    """Launches per transport since the last reset."""
    c = state[key + "/counts"]
    out = dict(c)
    if reset:
        for name in c:
            c[name] = 0
    return out


def sizes_on_two_routes(state, key: str, seed: int, sizes: list) -> dict:
    """Rank r combines B = sizes[r], sizes the plan sends to different transports: each rank waits
    on its own route and fails, naming the ranks that went elsewhere (on the timeout, or on a
    faster rank's next call announcing that it failed), and its channel stays poisoned."""
    from tests.lockstep_cases import _inputs, _raises, _then_poisoned
    from dcp import DcpMismatchError, DcpTimeoutError

    comm = state[key]
    B = sizes[comm.rank]
    _, _, po, pl = _inputs(comm, seed, B)
    first = _raises(lambda: comm.lse_reduce(po, pl, check=True), (DcpTimeoutError, DcpMismatchError))
    return {"first": first, "next": _then_poisoned(comm, seed + 1)}


def rejected_gather_then_combine(state, key: str, seed: int, bad_rank: int, B: int) -> dict:
    """``bad_rank`` passes its queries in the wrong dtype to a gather, the others gather B; then every
    rank combines B. The peers' gather fails at once naming it; its combine counts the rejected call
    as a gather, so it routes like theirs and fails at once on the poisoned channels they announce,
    not on the timeout."""
    import time

    from tests.gather_cases import make_queries
    from tests.lockstep_cases import _inputs, _raises
    from dcp import DcpError, DcpMismatchError

    comm = state[key]
    q = make_queries(seed, comm, B)[comm.rank].to(comm.device)
    if comm.rank == bad_rank:
        first = _raises(lambda: comm.all_gather_heads(q.float(), check=True), (TypeError, ValueError))
    else:
        first = _raises(lambda: comm.all_gather_heads(q, check=True), (DcpMismatchError,))
    _, _, po, pl = _inputs(comm, seed + 1, B)
    t0 = time.monotonic()
    second = _raises(lambda: comm.lse_reduce(po, pl, check=True), (DcpError,))
    return {"first": first, "second": second, "elapsed": time.monotonic() - t0}
