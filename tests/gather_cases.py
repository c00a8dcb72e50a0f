"""Rank functions of the query all-gather tests: bit-exact copies, checked byte for byte."""

import torch
import torch.distributed as dist

from dcp import DcpAllToAll, DcpMismatchError
from tests.lockstep_cases import _raises
from tests.rank_cases import DTYPES, lse_case

QUERY_DTYPES = dict(DTYPES, float8_e4m3fn=torch.float8_e4m3fn, float8_e5m2=torch.float8_e5m2)
POISON_BYTE = 0x5A


def make_queries(seed: int, comm: DcpAllToAll, B: int) -> list:
    """Every rank's [B, H/N, Dq] queries from one seed, as random bit patterns of the query dtype
    (NaN and inf payloads included: a gather copies bits, it never computes)."""
    g = torch.Generator().manual_seed(seed)
    nbytes = comm.heads_per_rank * comm.query_dim * comm.query_dtype.itemsize
    return [torch.randint(0, 256, (B, nbytes), dtype=torch.uint8, generator=g)
            .view(comm.query_dtype).view(B, comm.heads_per_rank, comm.query_dim) for _ in range(comm.world)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view(torch.uint8)


def gather_case(state, key: str, seed: int, B: int, strided: bool = False, padded_out: bool = False,
                use_out: bool = False, channel: int = 0) -> int:
    """One gather on fresh random bits; the result must equal every rank's queries, in head order,
    byte for byte, and nothing outside the result may change. Returns the bytes checked."""
    comm: DcpAllToAll = state[key]
    dev, H, dq, dt = comm.device, comm.num_heads, comm.query_dim, comm.query_dtype
    qs = make_queries(seed, comm, B)
    q = qs[comm.rank].to(dev)
    if strided:  # head- and token-strided view into a larger buffer, last dimension contiguous
        big = torch.empty((B, comm.heads_per_rank + 3, dq), dtype=dt, device=dev)
        q = big[:, 2:2 + comm.heads_per_rank]
        q.copy_(qs[comm.rank].to(dev))
        assert not q.is_contiguous() or B <= 1
    out = buf = None
    if padded_out or use_out:
        pad = 5 if padded_out else 0
        buf = torch.full((B, H + pad, dq * dt.itemsize), POISON_BYTE, dtype=torch.uint8, device=dev).view(dt)
        buf = buf.view(B, H + pad, dq)
        out = buf[:, :H]
    y = comm.all_gather_heads(q, out=out, channel=channel)
    comm.check(synchronize=True)
    assert y.shape == (B, H, dq) and y.dtype == dt and y.device == dev
    if out is not None:
        assert y is out
        if padded_out:  # the head padding beyond H is not touched
            assert (_bytes(buf[:, H:]) == POISON_BYTE).all(), "the gather wrote past the heads of out"
    want = _bytes(torch.cat(qs, dim=1))
    got = _bytes(y)
    assert torch.equal(got, want), f"rank {comm.rank}: {int((got != want).sum())} bytes differ (B={B})"
    return got.numel()


def interleaved(state, key: str, seed: int, sizes: list) -> int:
    """Gathers and combines alternate on one channel (and its epoch), sizes above max_tokens too."""
    for i, B in enumerate(sizes):
        if i % 2 == 0:
            gather_case(state, key, seed + i, B, strided=i % 4 == 0, padded_out=i % 4 == 2)
        else:
            lse_case(state, key, seed + i, B, use_out=True, special=True)
    return len(sizes)


def gather_against_combine(state, key: str, seed: int) -> dict:
    """Rank 0 gathers while the others combine on the same call: every rank is told, then poisoned."""
    comm: DcpAllToAll = state[key]
    q = make_queries(seed, comm, 2)[comm.rank].to(comm.device)
    po = torch.randn(2, comm.num_heads, comm.head_dim).to(comm.dtype).to(comm.device)
    pl = torch.randn(2, comm.num_heads, device=comm.device)
    if comm.rank == 0:
        first = _raises(lambda: comm.all_gather_heads(q, check=True), (DcpMismatchError,))
    else:
        first = _raises(lambda: comm.lse_reduce(po, pl, check=True), (DcpMismatchError,))
    return {"first": first, "next": _raises(lambda: comm.all_gather_heads(q, check=True))}


def bad_gathers(state, key: str, seed: int) -> list:
    """Malformed gathers on every rank: each raises naming what was expected; then a good one."""
    comm: DcpAllToAll = state[key]
    dev, H, hn, dq, dt = comm.device, comm.num_heads, comm.heads_per_rank, comm.query_dim, comm.query_dtype
    q = make_queries(seed, comm, 2)[comm.rank].to(dev)
    other = torch.float16 if dt != torch.float16 else torch.bfloat16
    big = torch.zeros((2, H + hn, dq), dtype=dt, device=dev)
    cases = {
        "ndim": lambda: comm.all_gather_heads(q[0]),
        "heads": lambda: comm.all_gather_heads(q[:, :-1]),
        "dim": lambda: comm.all_gather_heads(torch.cat([q, q], dim=2)),
        "dtype": lambda: comm.all_gather_heads(q.view(torch.uint8) if dt.itemsize == 1 else q.view(other)),
        "out_shape": lambda: comm.all_gather_heads(q, out=torch.empty((2, H + 1, dq), dtype=dt, device=dev)),
        "out_dtype": lambda: comm.all_gather_heads(q, out=torch.empty((2, H, dq), dtype=torch.float32
                                                                       if dt != torch.float32 else other, device=dev)),
        "last_dim_stride": lambda: comm.all_gather_heads(
            torch.empty((2, dq, hn), dtype=dt, device=dev).transpose(1, 2)),
        "not_tensor": lambda: comm.all_gather_heads([1, 2]),
        "device": lambda: comm.all_gather_heads(q.to("meta" if dev.type == "cpu" else "cpu")),
        "out_overlaps_q": lambda: comm.all_gather_heads(big[:, H:], out=big[:, :H + hn][:, hn:]),
    }
    msgs = []
    for name, call in cases.items():
        msg = _raises(call, (ValueError, TypeError))
        assert "expected" in msg, f"{name}: {msg}"
        msgs.append(f"{name}: {msg}")
    gather_case(state, key, seed + 1, 3)  # every rank rejected the same calls: still in step
    return msgs


def empty_gather(state, key: str) -> tuple:
    comm: DcpAllToAll = state[key]
    q = torch.empty((0, comm.heads_per_rank, comm.query_dim), dtype=comm.query_dtype, device=comm.device)
    y = comm.all_gather_heads(q)
    return tuple(y.shape)


def memory(state, key: str) -> dict:
    return state[key].memory_bytes()


def gather_graph_case(state, key: str, seed: int, B: int, replays: int) -> int:
    """A layer's two collectives captured in one graph (gather, then combine), replayed on fresh
    inputs written in place, interleaved with eager gathers; every replay checked."""
    from dcp.reference import chunk_reference, make_inputs, max_rel_error
    from tests.rank_cases import TOL

    comm: DcpAllToAll = state[key]
    dev, n, rank = comm.device, comm.world, comm.rank
    H, D, hn, dq = comm.num_heads, comm.head_dim, comm.heads_per_rank, comm.query_dim
    q = torch.empty((B, hn, dq), dtype=comm.query_dtype, device=dev)
    q_all = torch.empty((B, H, dq), dtype=comm.query_dtype, device=dev)
    po = torch.empty((B, H, D), dtype=comm.dtype, device=dev)
    pl = torch.empty((B, H), dtype=torch.float32, device=dev)
    y = torch.empty((B, hn, D), dtype=comm.dtype, device=dev)
    comm.all_gather_heads(q, out=q_all)
    comm.lse_reduce(po, pl, out=y)
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=stream):
        comm.all_gather_heads(q, out=q_all)
        comm.lse_reduce(po, pl, out=y)
    for step in range(replays):
        qs = make_queries(seed + step, comm, B)
        outs, lses = make_inputs(seed + 1000 + step, n, B, H, D, comm.dtype, special=True)
        q.copy_(qs[rank])
        po.copy_(outs[rank])
        pl.copy_(lses[rank])
        q_all.view(torch.uint8).fill_(POISON_BYTE)
        y.fill_(float("nan"))
        graph.replay()
        if step % 2:
            gather_case(state, key, seed + 500 + step, 3)  # an eager gather between replays
        torch.cuda.synchronize()
        assert torch.equal(_bytes(q_all), _bytes(torch.cat(qs, dim=1))), f"replay {step}: gather differs"
        ref, _ = chunk_reference(outs, lses, rank, hn)
        err = max_rel_error(y, ref)
        assert err <= TOL[comm.dtype], f"replay {step}: combine error {err}"
    comm.check()
    return replays


def count_gather_launches(state, key: str, B: int) -> list:
    """Names of the device kernels one eager gather runs, as the CUDA profiler sees them."""
    from torch.profiler import ProfilerActivity, profile

    comm: DcpAllToAll = state[key]
    q = make_queries(1, comm, B)[comm.rank].to(comm.device)
    out = torch.empty((B, comm.num_heads, comm.query_dim), dtype=comm.query_dtype, device=comm.device)
    comm.all_gather_heads(q, out=out)
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        comm.all_gather_heads(q, out=out)
        torch.cuda.synchronize()
    dist.barrier()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]
