"""Rank functions of the lockstep tests: what a careless or unlucky caller does to one rank.

Each returns what the test asserts on; a call that should have raised and did not fails here.
"""

import threading
import time

import torch
import torch.distributed as dist

from dcp import DcpAllToAll, DcpError, DcpMismatchError
from dcp.constants import WIRE_REVISION
from dcp.reference import chunk_reference, make_inputs, max_rel_error
from tests.rank_cases import DTYPES, TOL, lse_case, shm_segments


def _inputs(comm: DcpAllToAll, seed: int, B: int, **kw):
    outs, lses = make_inputs(seed, comm.world, B, comm.num_heads, comm.head_dim, comm.dtype, **kw)
    return outs, lses, outs[comm.rank].to(comm.device), lses[comm.rank].to(comm.device)


def _checked_call(comm: DcpAllToAll, seed: int, B: int, channel: int = 0) -> float:
    """A correct call on fresh inputs, into a poisoned ``out``; returns its error against float64."""
    outs, lses, po, pl = _inputs(comm, seed, B, special=True)
    out = torch.full((B, comm.heads_per_rank, comm.head_dim), float("nan"), dtype=comm.dtype, device=comm.device)
    comm.lse_reduce(po, pl, out=out, channel=channel, check=True)
    ref, _ = chunk_reference(outs, lses, comm.rank, comm.heads_per_rank)
    y = out.double().cpu()
    assert torch.isfinite(y).all(), "unwritten or NaN rows"
    err = max_rel_error(y, ref) if B else 0.0
    assert err <= TOL[comm.dtype], f"rank {comm.rank}: error {err}"
    return err


def _raises(fn, types=(DcpError,)) -> str:
    try:
        fn()
    except types as exc:
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError(f"expected {[t.__name__ for t in types]}, but the call returned")


def _then_poisoned(comm: DcpAllToAll, seed: int, B: int = 2, channel: int = 0) -> str:
    """The next correct call on the channel must raise, on every rank, writing nothing but NaN."""
    outs, lses, po, pl = _inputs(comm, seed, B)
    out = torch.full((B, comm.heads_per_rank, comm.head_dim), 7.0, dtype=comm.dtype, device=comm.device)
    msg = _raises(lambda: comm.lse_reduce(po, pl, out=out, channel=channel, check=True))
    if comm.device.type == "cuda":
        torch.cuda.synchronize()
    # untouched (raised before launch), or NaN (on a GPU the host may learn of the failure only from
    # this call's own poisoned kernel): never rows of any call
    assert ((out.float() == 7.0) | out.float().isnan()).all(), "a call that raised wrote rows"
    return msg


def rejecting_rank(state, key: str, seed: int, bad_rank: int, B: int = 3, how: str = "dtype") -> dict:
    """``bad_rank`` passes a wrong dtype (or, ``how="metadata"``, batch metadata of mismatched
    lengths); the others a correct call. Then everyone a correct call."""
    comm: DcpAllToAll = state[key]
    outs, lses, po, pl = _inputs(comm, seed, B)
    other = torch.float16 if comm.dtype == torch.bfloat16 else torch.bfloat16
    meta = {}
    if how == "metadata":  # the bad rank's query_start_loc lacks a boundary
        bounds = [0, B] if comm.rank == bad_rank else [0, 1, B]
        meta = dict(seq_lens=torch.tensor([2, 0], dtype=torch.int32, device=comm.device),
                    query_start_loc=torch.tensor(bounds, dtype=torch.int32, device=comm.device))
    t0 = time.monotonic()
    if comm.rank == bad_rank:
        bad = po if how == "metadata" else po.to(other)
        first = _raises(lambda: comm.lse_reduce(bad, pl, check=True, **meta), (TypeError, ValueError))
    else:
        first = _raises(lambda: comm.lse_reduce(po, pl, check=True, **meta), (DcpMismatchError,))
    return {"first": first, "elapsed": time.monotonic() - t0, "next": _then_poisoned(comm, seed + 1)}


def every_rank_rejects(state, key: str, seed: int) -> float:
    """The same bad call on every rank: all raise, nobody is out of step, the next call is exact."""
    comm: DcpAllToAll = state[key]
    _, _, po, pl = _inputs(comm, seed, 2)
    _raises(lambda: comm.lse_reduce(po, pl.double()), (TypeError,))
    buf = torch.empty((3, comm.num_heads, comm.head_dim), dtype=comm.dtype, device=comm.device)
    buf[1:].copy_(po)
    # out overlaps the input shifted by one token: refused, on every rank alike
    _raises(lambda: comm.lse_reduce(buf[1:], pl, out=buf[:2, :comm.heads_per_rank]), (ValueError,))
    # outputs whose tokens would share one row (expanded): refused, whatever else they overlap
    row = torch.empty((1, comm.heads_per_rank, comm.head_dim), dtype=comm.dtype, device=comm.device)
    msg = _raises(lambda: comm.lse_reduce(po, pl, out=row.expand(2, -1, -1)), (ValueError,))
    assert "overlap each other" in msg, msg
    lse_row = torch.empty((1, comm.heads_per_rank), device=comm.device)
    msg = _raises(lambda: comm.lse_reduce(po, pl, return_lse=True, out_lse=lse_row.expand(2, -1)), (ValueError,))
    assert "out_lse" in msg and "overlap each other" in msg, msg
    return _checked_call(comm, seed + 1, 5)


def rank_sizes(state, key: str, seed: int, sizes: list) -> dict:
    """Rank r calls with B = sizes[r]; every rank must raise (a mismatch), then stay poisoned."""
    comm: DcpAllToAll = state[key]
    B = sizes[comm.rank]
    outs, lses, po, pl = _inputs(comm, seed, max(sizes))
    t0 = time.monotonic()
    first = _raises(lambda: comm.lse_reduce(po[:B], pl[:B], check=True), (DcpMismatchError,))
    return {"first": first, "elapsed": time.monotonic() - t0, "next": _then_poisoned(comm, seed + 1)}


def everyone_empty(state, key: str, seed: int) -> float:
    """B = 0 on every rank: an empty result, and the channel stays in step."""
    comm: DcpAllToAll = state[key]
    _, _, po, pl = _inputs(comm, seed, 0)
    y, yl = comm.lse_reduce(po, pl, return_lse=True)
    assert y.shape == (0, comm.heads_per_rank, comm.head_dim) and yl.shape == (0, comm.heads_per_rank)
    return _checked_call(comm, seed + 1, 3)


def _until(pred, what: str, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


def _inside_a_call(comm: DcpAllToAll, channel: int = 0) -> None:
    """Wait until another thread of this process holds the channel (it is inside a call)."""
    _until(lambda: comm._busy[channel].locked(), "the other thread is inside its call")
    if comm.device.type == "cpu":
        import dcp.launch
        _until(dcp.launch._INTERPRETER.locked, "the other thread's kernel runs")


def _late_peer_call(comm: DcpAllToAll, seed: int, B: int, channel: int = 0) -> float:
    """Rank 0 is inside its call: this rank calls only once rank 0 has done what the test does
    meanwhile and meets it at a barrier (gloo, from rank 0's main thread)."""
    dist.barrier()
    return _checked_call(comm, seed, B, channel)


def two_threads_one_channel(state, key: str, seed: int) -> dict:
    """Rank 0 calls from two threads on one channel while rank 1 is late: the second call is refused,
    the first still pairs with rank 1's call exactly, and the channel is poisoned afterwards."""
    comm: DcpAllToAll = state[key]
    if comm.rank != 0:
        return {"first": _late_peer_call(comm, seed, 2), "next": _then_poisoned(comm, seed + 1)}
    results: dict = {}
    # (the refused call's inputs are made first: the less this thread does while the other one is
    # inside its call, the sooner rank 1 is let in)
    _, _, po, pl = _inputs(comm, seed + 5, 2)
    worker = threading.Thread(target=lambda: results.update(err=_checked_call(comm, seed, 2)))
    worker.start()
    _inside_a_call(comm)
    refused = _raises(lambda: comm.lse_reduce(po, pl))
    dist.barrier()
    worker.join(60)
    assert "err" in results, "the first thread's call did not finish correctly"
    return {"first": results["err"], "refused": refused, "next": _then_poisoned(comm, seed + 1)}


def two_threads_two_channels_cpu(state, key: str, seed: int) -> dict:
    """On the CPU one kernel runs at a time per process: a call on channel 1 while another thread's
    call on channel 0 runs is refused, channel 1 is poisoned (on every rank from its next call), and
    channel 0 goes on."""
    comm: DcpAllToAll = state[key]
    if comm.rank != 0:
        first = _late_peer_call(comm, seed, 2, channel=0)
        _, _, po, pl = _inputs(comm, seed + 2, 2)
        ch1 = _raises(lambda: comm.lse_reduce(po, pl, channel=1, check=True), (DcpMismatchError,))
        return {"first": first, "ch1": ch1, "ch0_after": _checked_call(comm, seed + 3, 3, channel=0)}
    results: dict = {}
    _, _, po, pl = _inputs(comm, seed + 2, 2)  # (first: as in two_threads_one_channel)
    worker = threading.Thread(target=lambda: results.update(err=_checked_call(comm, seed, 2, channel=0)))
    worker.start()
    _inside_a_call(comm)
    refused = _raises(lambda: comm.lse_reduce(po, pl, channel=1))
    dist.barrier()
    worker.join(60)
    assert "err" in results, "the channel-0 call did not finish correctly"
    ch1 = _then_poisoned(comm, seed + 2, channel=1)
    return {"first": results["err"], "refused": refused, "ch1": ch1,
            "ch0_after": _checked_call(comm, seed + 3, 3, channel=0)}


def near_dtype_max(state, key: str, seed: int) -> dict:
    """Partial outputs near bf16's maximum with equal LSEs: the exact mean is finite."""
    comm: DcpAllToAll = state[key]
    B, H, D = 3, comm.num_heads, comm.head_dim
    g = torch.Generator().manual_seed(seed)
    big = torch.finfo(comm.dtype).max
    outs = [((0.9 + 0.1 * torch.rand(B, H, D, generator=g)) * big * torch.sign(torch.randn(B, H, D, generator=g)))
            .to(comm.dtype) for _ in range(comm.world)]
    lses = [torch.full((B, H), 1.5) for _ in range(comm.world)]
    lses[0][0] += 1e-3  # one row with unequal weights too
    y = comm.lse_reduce(outs[comm.rank].to(comm.device), lses[comm.rank].to(comm.device), check=True)
    ref, _ = chunk_reference(outs, lses, comm.rank, comm.heads_per_rank)
    y64 = y.double().cpu()
    return {"finite": bool(torch.isfinite(y64).all()), "ref_finite": bool(torch.isfinite(ref).all()),
            "err": max_rel_error(y64 / big, ref / big)}


def close_while_calling(state, key: str, seed: int) -> dict:
    """Rank 0 closes from its main thread while another of its threads is inside a call (rank 1 is
    late): close waits for that call, which still returns its exact result."""
    comm: DcpAllToAll = state.pop(key)
    if comm.rank != 0:
        err = _late_peer_call(comm, seed, 2)
        comm.close()
        return {"err": err, "closed": comm._closed}
    results: dict = {}
    worker = threading.Thread(target=lambda: results.update(err=_checked_call(comm, seed, 2)))
    worker.start()
    _inside_a_call(comm)
    closer = threading.Thread(target=comm.close)
    closer.start()
    _until(lambda: comm._closed, "close() has begun")  # it now waits for the call in flight
    time.sleep(0.2)
    assert closer.is_alive() and worker.is_alive(), "close() did not wait for the call in flight"
    dist.barrier()
    closer.join(60)
    worker.join(60)
    assert "err" in results, "the call in flight did not finish correctly"
    return {"err": results["err"], "closed": comm._closed}


def close_from_on_error(state, timeout_s: float) -> dict:
    """Only rank 0 calls, so it times out; the watchdog's ``on_error`` closes the communicator."""
    n = dist.get_world_size()
    comm = DcpAllToAll(dist.group.WORLD, max_tokens=4, num_heads=2 * n, head_dim=16, timeout_s=timeout_s)
    if comm.rank != 0:
        time.sleep(timeout_s + 2)
        comm.close()
        return {}
    done, errors, seen = threading.Event(), [], []

    def on_error(exc):
        seen.append(str(exc))
        try:
            comm.close()
        except BaseException as e:  # what the issue saw: "cannot join current thread"
            errors.append(repr(e))
        done.set()

    comm.start_watchdog(0.05, on_error)
    _, _, po, pl = _inputs(comm, 1, 1)
    comm.lse_reduce(po, pl, check=False)
    assert done.wait(timeout_s + 30), "the watchdog did not report the timeout"
    return {"seen": seen, "errors": errors, "closed": comm._closed,
            "released": comm._transport.regions == [] and comm._transport.status_addr == 0}


def construct_dying(state, die_rank: int) -> dict:
    """``die_rank`` exits while mapping its peers' segments (its own exists by then); the others
    must get a DcpError, and no segment may be left behind."""
    from unittest import mock

    import dcp.buffers

    n = dist.get_world_size()
    if dist.get_rank() == die_rank:
        real = dcp.buffers.HostShmProvider._map

        def dying(path, nbytes, releases, create):
            if not create:
                import os
                os._exit(17)
            return real(path, nbytes, releases, create)
        mock.patch.object(dcp.buffers.HostShmProvider, "_map", staticmethod(dying)).start()
    msg = _raises(lambda: DcpAllToAll(dist.group.WORLD, max_tokens=4, num_heads=2 * n, head_dim=16))
    return {"message": msg, "segments": shm_segments()}


def construct_per_rank(state, per_rank: dict, **common) -> str:
    """Construct with rank-specific arguments (``per_rank[rank]``) on top of ``common``; returns the
    message of the DcpError that every rank must raise."""
    kwargs = dict(common, **per_rank.get(dist.get_rank(), {}))
    kwargs["dtype"] = DTYPES[kwargs.get("dtype", "bfloat16")]
    before = shm_segments()
    t0 = time.monotonic()
    msg = _raises(lambda: DcpAllToAll(dist.group.WORLD, **kwargs))
    assert time.monotonic() - t0 < 60, "construction took a timeout to fail"
    assert shm_segments() == before, "a failed construction left shared memory behind"
    return msg


def construct_with_wire_revision(state, revisions: dict, **common) -> str:
    """Construction where rank r runs wire revision ``revisions[r]`` (another release of this
    package on that rank); returns the message of the DcpError that every rank must raise."""
    from unittest import mock

    with mock.patch("dcp.config.WIRE_REVISION", revisions.get(dist.get_rank(), WIRE_REVISION)):
        return construct_per_rank(state, {}, **common)


def integer_like_arguments(state, seed: int) -> float:
    """numpy integers are integers; a call on the result is exact."""
    import numpy as np

    n = dist.get_world_size()
    state["np"] = DcpAllToAll(dist.group.WORLD, max_tokens=np.int64(4), num_heads=np.int32(2 * n),
                              head_dim=np.int64(16), channels=np.int64(1), timeout_s=np.float32(30))
    try:
        return _checked_call(state["np"], seed, 3)
    finally:
        state.pop("np").close()


def outside_the_subgroup(state, seed: int) -> str:
    """Ranks 0 and 1 build on a subgroup of the three; rank 2, not a member, is told so clearly."""
    sub = dist.new_group([0, 1])
    if dist.get_rank() == 2:
        return _raises(lambda: DcpAllToAll(sub, max_tokens=4, num_heads=4, head_dim=16))
    comm = DcpAllToAll(sub, max_tokens=4, num_heads=4, head_dim=16)
    try:
        return f"ok {_checked_call(comm, seed, 3)}"
    finally:
        comm.close()


def graph_after_poison(state, key: str, seed: int) -> dict:
    """A captured call replays exactly; after a mismatch poisons the channel, a replay (no host code
    runs) writes NaN rows instead of rows of any call, and the failure stays recorded."""
    comm: DcpAllToAll = state[key]
    B = 2
    outs, lses, po, pl = _inputs(comm, seed, B)
    y = torch.empty((B, comm.heads_per_rank, comm.head_dim), dtype=comm.dtype, device=comm.device)
    comm.lse_reduce(po, pl, out=y)
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=stream):
        comm.lse_reduce(po, pl, out=y)
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = chunk_reference(outs, lses, comm.rank, comm.heads_per_rank)
    err = max_rel_error(y, ref)
    assert err <= TOL[comm.dtype], err
    Bm = 1 if comm.rank == 0 else 2
    mismatch = _raises(lambda: comm.lse_reduce(po[:Bm], pl[:Bm], check=True), (DcpMismatchError,))
    y.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    return {"err": err, "mismatch": mismatch, "nan_after": bool(torch.isnan(y.float()).all()),
            "recorded": comm._transport.error(0) is not None}


def rounding_case(state, key: str, seed: int) -> int:
    """Two ranks of equal LSE: the fp32 mean of two bf16/fp16 values is exact, so the stored result
    must be the float64 reference rounded to nearest even, bit for bit (not truncated)."""
    comm: DcpAllToAll = state[key]
    B, H, D = 4, comm.num_heads, comm.head_dim
    g = torch.Generator().manual_seed(seed)
    outs = [torch.randn(B, H, D, generator=g).to(comm.dtype) for _ in range(comm.world)]
    lses = [torch.zeros(B, H) for _ in range(comm.world)]
    y = comm.lse_reduce(outs[comm.rank].to(comm.device), lses[comm.rank].to(comm.device), check=True)
    ref, _ = chunk_reference(outs, lses, comm.rank, comm.heads_per_rank)
    want = ref.to(comm.dtype)
    assert torch.equal(y.cpu().view(torch.int16), want.view(torch.int16)), \
        f"{int((y.cpu() != want).sum())} of {want.numel()} values not rounded to nearest even"
    return want.numel()


def lse_bases(state, key: str, seed: int, base_e_on: list) -> dict:
    """Rank r's LSEs are base e if ``base_e_on[r]`` else base 2: the weights would disagree, so every
    rank must raise (a mismatch), then stay poisoned."""
    comm: DcpAllToAll = state[key]
    _, _, po, pl = _inputs(comm, seed, 2)
    first = _raises(lambda: comm.lse_reduce(po, pl, is_lse_base_on_e=base_e_on[comm.rank], check=True),
                    (DcpMismatchError,))
    return {"first": first, "next": _then_poisoned(comm, seed + 1)}


def nccl_rejects(state, key: str, seed: int, rejecting: list) -> dict:
    """On the NCCL path, after a call in step: one the ranks in ``rejecting`` reject (the others
    skip it: theirs would wait for a rejecting rank's next call). Every later call of a rejecting
    rank raises, on every channel, and so does ``check``; the others lose nothing."""
    comm: DcpAllToAll = state[key]
    res = {"err": lse_case(state, key, seed, 2)}
    if comm.rank in rejecting:
        outs, lses, po, pl = _inputs(comm, seed + 1, 2)
        res["rejected"] = _raises(lambda: comm.lse_reduce(po, pl, out=po[:, :comm.heads_per_rank]), (ValueError,))
        res["next"] = [_raises(lambda: comm.lse_reduce(po, pl, channel=c)) for c in range(comm.channels)]
        res["gather"] = _raises(lambda: comm.all_gather_heads(
            torch.randn(2, comm.heads_per_rank, comm.query_dim).to(comm.query_dtype)))
        res["check"] = _raises(comm.check)
    else:
        comm.check()
    return res


def nccl_busy_channel(state, key: str, seed: int) -> dict:
    """On the NCCL path rank 0 calls from two threads on channel 0: the second call is refused, and
    since this path pairs calls by the group's order on any channel, rank 0's next call on channel
    1 raises too (it would pair with the peers' call that the refused one skipped). The first call
    pairs with rank 1's exactly (rank 1 is let in through the store: not a collective of the group)."""
    comm: DcpAllToAll = state[key]
    store = dist.distributed_c10d._get_default_store()
    if comm.rank != 0:
        store.wait(["nccl_busy_refused"], __import__("datetime").timedelta(seconds=60))
        return {"first": _checked_call(comm, seed, 2)}
    results: dict = {}
    _, _, po, pl = _inputs(comm, seed + 5, 2)
    worker = threading.Thread(target=lambda: results.update(err=_checked_call(comm, seed, 2)))
    worker.start()
    _until(lambda: comm._busy[0].locked(), "the other thread is inside its call")
    refused = _raises(lambda: comm.lse_reduce(po, pl))
    store.set("nccl_busy_refused", "1")
    worker.join(60)
    assert "err" in results, "the first thread's call did not finish correctly"
    return {"first": results["err"], "refused": refused, "ch1": _raises(lambda: comm.lse_reduce(po, pl, channel=1))}
