"""Rank functions of the query all-gather tests: bit-exact copies, checked byte for byte."""

import torch
import torch.distributed as dist

from dcp import DcpAllToAll, DcpMismatchError, reference
from tests.lockstep_cases import _raises
from tests.rank_cases import DTYPES, elsewhere_alias, lse_case

QUERY_DTYPES = dict(DTYPES, float8_e4m3fn=torch.float8_e4m3fn, float8_e5m2=torch.float8_e5m2)
POISON_BYTE = 0x5A


def make_queries(seed: int, comm: DcpAllToAll, B: int) -> list:
    return reference.make_queries(seed, comm.world, B, comm.heads_per_rank, comm.query_dim, comm.query_dtype)


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


def interleaved(state, key: str, seed: int, calls: int, channel: int = 0) -> int:
    """Gathers and combines in a random order (the same on every rank) on one channel and its epoch,
    with random sizes up to twice max_tokens; every result checked."""
    import random

    comm: DcpAllToAll = state[key]
    rnd = random.Random(seed)
    for i in range(calls):
        B = rnd.randint(1, 2 * comm.max_tokens)
        if rnd.random() < 0.5:
            gather_case(state, key, seed + i, B, strided=rnd.random() < 0.5, padded_out=rnd.random() < 0.5,
                        channel=channel)
        else:
            lse_case(state, key, seed + i, B, use_out=True, special=True, channel=channel)
    return calls


def gather_sizes(state, key: str, seed: int, sizes: list) -> str:
    """Rank r gathers B = sizes[r]: every rank must raise a mismatch."""
    comm: DcpAllToAll = state[key]
    q = make_queries(seed, comm, max(sizes))[comm.rank].to(comm.device)
    return _raises(lambda: comm.all_gather_heads(q[:sizes[comm.rank]], check=True), (DcpMismatchError,))


def lonely_gather(state, key: str) -> list:
    """Only this rank gathers: a timeout naming the others, and the result reads as NaN (all ones)."""
    from dcp import DcpTimeoutError

    comm: DcpAllToAll = state[key]
    q = make_queries(1, comm, 2)[comm.rank].to(comm.device)
    out = torch.zeros((2, comm.num_heads, comm.query_dim), dtype=comm.query_dtype, device=comm.device)
    try:
        comm.all_gather_heads(q, out=out, check=True)
    except DcpTimeoutError as exc:
        assert (_bytes(out) == 0xFF).all(), "rows that could not be gathered must read as all-ones (NaN)"
        return exc.missing_ranks
    raise AssertionError("a gather with absent peers returned")


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
        "out_overlaps_itself": lambda: comm.all_gather_heads(q, out=big[:1, :H].expand(2, -1, -1)),
        "out_aliases_q_elsewhere": lambda: comm.all_gather_heads(big[:, hn:2 * hn], out=elsewhere_alias(big)[:, :H]),
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


def layer_graphs(state, key: str, seed: int, sizes: list, layers: int, replays: int) -> dict:
    """Graphs of whole DCP layers, one graph per batch size: per layer a gather, a stand-in for
    attention (the partial outputs and LSEs derived from the gathered queries on the device), and a
    combine, ``layers`` times. Replayed in a random order shared by all ranks, with eager gathers
    and combines between; every layer's outputs checked. Returns the allocations each captured
    call made (all must be 0)."""
    import random

    from dcp.reference import chunk_reference, max_rel_error
    from tests.rank_cases import TOL

    comm: DcpAllToAll = state[key]
    dev, rank = comm.device, comm.rank
    H, D, hn, dq = comm.num_heads, comm.head_dim, comm.heads_per_rank, comm.query_dim

    def attention(q_all: torch.Tensor, po: torch.Tensor, pl: torch.Tensor, layer: int) -> None:
        """A stand-in: partials that follow from the gathered queries' bytes, this rank and the
        layer (so any rank can compute every rank's). Needs Dq's bytes >= D."""
        x = q_all.view(torch.uint8)[..., :D].to(torch.float32)
        po.copy_(x * ((rank + 1 + layer) / 256.0))
        pl.copy_(x[..., 0] / 64.0 - rank)

    graphs, allocs = [], []
    allocated = lambda: torch.cuda.memory_stats(dev).get("allocation.all.allocated", 0)
    for B in sizes:
        bufs = [dict(q=torch.empty((B, hn, dq), dtype=comm.query_dtype, device=dev),
                     q_all=torch.empty((B, H, dq), dtype=comm.query_dtype, device=dev),
                     po=torch.empty((B, H, D), dtype=comm.dtype, device=dev),
                     pl=torch.empty((B, H), dtype=torch.float32, device=dev),
                     y=torch.empty((B, hn, D), dtype=comm.dtype, device=dev)) for _ in range(layers)]
        for b in bufs:  # the eager warm-up a serving engine runs before capture
            comm.all_gather_heads(b["q"], out=b["q_all"])
            comm.lse_reduce(b["po"], b["pl"], out=b["y"])
        torch.cuda.synchronize()
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
            pass  # what torch allocates for a stream's first capture
        with torch.cuda.graph(graph, stream=stream):
            for layer, b in enumerate(bufs):
                before = allocated()
                comm.all_gather_heads(b["q"], out=b["q_all"])
                allocs.append(allocated() - before)
                attention(b["q_all"], b["po"], b["pl"], layer)
                before = allocated()
                comm.lse_reduce(b["po"], b["pl"], out=b["y"])
                allocs.append(allocated() - before)
        graphs.append((B, graph, bufs))
    rnd = random.Random(seed)
    for step in range(replays):
        B, graph, bufs = graphs[rnd.randrange(len(graphs))]
        queries = []
        for layer, b in enumerate(bufs):
            qs = make_queries(seed + 97 * step + layer, comm, B)
            b["q"].copy_(qs[rank])
            b["q_all"].view(torch.uint8).fill_(POISON_BYTE)
            b["y"].fill_(float("nan"))
            queries.append(qs)
        graph.replay()
        if step % 3 == 1:  # eager calls between replays move the shared epoch
            gather_case(state, key, seed + 500 + step, 3)
            lse_case(state, key, seed + 700 + step, 2, use_out=True)
        torch.cuda.synchronize()
        for layer, (b, qs) in enumerate(zip(bufs, queries)):
            q_all = torch.cat(qs, dim=1)
            assert torch.equal(_bytes(b["q_all"]), _bytes(q_all)), f"step {step} layer {layer}: gather differs"
            # every rank's partials, as each rank's stand-in computed them from the same queries
            x = q_all.view(torch.uint8)[..., :D].to(torch.float32)
            outs = [(x * ((r + 1 + layer) / 256.0)).to(comm.dtype) for r in range(comm.world)]
            lses = [x[..., 0] / 64.0 - r for r in range(comm.world)]
            ref, _ = chunk_reference(outs, lses, rank, hn)
            err = max_rel_error(b["y"], ref)
            assert err <= TOL[comm.dtype], f"step {step} layer {layer}: combine error {err}"
    comm.check()
    return {"allocs": allocs, "replays": replays}


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
