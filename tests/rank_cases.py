"""Functions that run on every rank of a ``tests.world.World`` (first argument: the rank's state)."""

import glob
import os
from typing import Optional

import torch
import torch.distributed as dist

from dcp import DcpAllToAll, DcpError
from dcp.reference import chunk_reference, make_inputs, mask_by_metadata, max_rel_error
from dcp.constants import KIND_GATHER

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def make_comm(state, key: str, device: str = "cpu", **kwargs) -> str:
    kwargs["dtype"] = DTYPES[kwargs.get("dtype", "bfloat16")]
    if key in state:
        state.pop(key).close()
    state[key] = DcpAllToAll(dist.group.WORLD, device=device, **kwargs)
    return repr(state[key])


def backend_reason(state, key: str) -> str:
    return state[key].backend_reason


def close_comm(state, key: str) -> None:
    state.pop(key).close()


def fused_grids(state, key: str) -> dict:
    """The fused transport's launch grid of each call size (index B - 1), by kind."""
    comm = state[key]
    return {kind: [grid for _, grid in by_size] for kind, by_size in comm._transports[comm.backend].by_size.items()}


def gather_tiles(state, key: str, B: int) -> int:
    """The tiles of a query all-gather of B tokens."""
    layout = state[key].gather_layout
    return layout.tiles(B, layout.warps_for(B))


def tilings(state, key: str, sizes: list) -> list:
    """(warps, programmatic launch) of each call size, or the error a size raised."""
    out = []
    for n in sizes:
        try:
            out.append(state[key].tiling(n))
        except ValueError as exc:
            out.append(str(exc))
    return out


def _strided(t: torch.Tensor, heads_dim: int, pad: int = 3) -> torch.Tensor:
    """The same values as a view into a larger buffer (head-sliced padding), not contiguous."""
    shape = list(t.shape)
    shape[heads_dim] += pad
    big = torch.full(shape, float("nan"), dtype=t.dtype, device=t.device)
    view = big.narrow(heads_dim, 1, t.shape[heads_dim])
    view.copy_(t)
    return view


def lse_case(state, key: str, seed: int, B: int, lse_dtype: str = "float32", base_e: bool = True,
             return_lse: bool = True, use_out: bool = False, strided: bool = False,
             special: bool = False, channel: int = 0, return_output: bool = False,
             misaligned: bool = False, subclass: bool = False):
    """One call on fresh random inputs, checked against the float64 reference.

    Returns the max error, or with ``return_output`` the outputs themselves (on the CPU)."""
    comm: DcpAllToAll = state[key]
    rank, n, dev = comm.rank, comm.world, comm.device
    H, D, hn = comm.num_heads, comm.head_dim, comm.heads_per_rank
    outs, lses = make_inputs(seed, n, B, H, D, comm.dtype, DTYPES[lse_dtype], special)
    po, pl = outs[rank].to(dev), lses[rank].to(dev)
    if strided:
        po = _strided(po, 1)
        pl = _strided(pl.t().contiguous(), 0).t()  # head-major storage: LSE stride (1, H + pad)
        assert not po.is_contiguous() and not pl.is_contiguous()
    if misaligned:  # 2-byte storage offset: pointers not 16-byte aligned, the unaligned variant
        raw = torch.empty(po.numel() + 1, dtype=po.dtype, device=dev)
        po = raw[1:].view(po.shape).copy_(po)
        assert po.data_ptr() % 16 != 0
    if subclass:  # a torch.Tensor subclass, as frameworks pass (here nn.Parameter)
        po, pl = (torch.nn.Parameter(t, requires_grad=False) for t in (po, pl))
    out = out_lse = None
    if use_out:  # poisoned: an element the kernel does not write stays NaN and fails the check
        out = torch.full((B, hn, D), float("nan"), dtype=comm.dtype, device=dev)
        out_lse = torch.full((B, hn), float("nan"), dtype=torch.float32, device=dev) if return_lse else None
    res = comm.lse_reduce(po, pl, return_lse=return_lse, is_lse_base_on_e=base_e, out=out,
                          out_lse=out_lse, channel=channel)
    y, y_lse = res if return_lse else (res, None)
    comm.check(synchronize=True)  # a timeout or size mismatch raises here, naming the rank
    if use_out:
        assert y is out and (y_lse is out_lse)
    assert y.shape == (B, hn, D) and y.dtype == comm.dtype
    ref, ref_lse = chunk_reference(outs, lses, rank, hn, base_e)
    y64 = y.double().cpu()
    assert torch.isfinite(y64).all(), f"non-finite outputs at {torch.nonzero(~torch.isfinite(y64))[:5].tolist()}"
    tol = TOL[comm.dtype]
    err = max_rel_error(y64, ref) if B else 0.0
    assert err <= tol, f"max relative error {err:.3g} > {tol} (rank {rank}, B={B})"
    if return_lse:
        yl = y_lse.double().cpu()
        assert y_lse.dtype == torch.float32 and y_lse.shape == (B, hn)
        assert torch.equal(torch.isneginf(yl), torch.isneginf(ref_lse)), "-inf LSE positions differ"
        fin = torch.isfinite(ref_lse)
        assert torch.isfinite(yl[fin]).all()
        lerr = (yl[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
        assert lerr <= 1e-4 * (1 + ref_lse[fin].abs().max().item() if fin.any() else 1), f"LSE error {lerr}"
    if return_output:
        return y.cpu(), (y_lse.cpu() if return_lse else None)
    return err


def metadata_case(state, key: str, seed: int, B: int, query_start_loc: list, layout: str = "int32",
                  use_out: bool = False, steps: int = 0) -> float:
    """One call with vLLM's batch metadata (this rank's seq_lens, some 0) on fresh inputs, against the
    float64 reference of the masked LSEs. ``layout``: int32, int64, or int32 / int64 with a stride of
    3 / 2 (views into larger tensors). ``steps``: that many steps of three calls each (``step=``:
    the first searches, the others read its verdicts), each step's metadata drawn anew into the same
    tensors, every call on fresh inputs."""
    if not steps:
        return _metadata_call(state, key, seed, seed + 1, B, query_start_loc, layout, use_out)
    held, err, max_tokens = {}, 0.0, state[key].max_tokens
    for s in range(steps):
        step = object()
        for c in range(3):
            err = max(err, _metadata_call(state, key, seed + 10 * s + c, seed + 10 * s, B, query_start_loc, layout,
                                          use_out, step, held, poke=s == steps - 1 and c == 2 and B <= max_tokens))
    return err


def _metadata_call(state, key: str, seed: int, meta_seed: int, B: int, query_start_loc: list, layout: str,
                   use_out: bool, step: object = None, held: Optional[dict] = None, poke: bool = False) -> float:
    """One call of ``metadata_case``: inputs drawn with ``seed``, seq_lens with ``meta_seed``; with
    ``step``, the metadata tensors ``held`` keeps (refilled in place when the step changes). Where
    the call is the step's first, the channel's mask must then hold each token's verdict; ``poke``:
    the mask is cleared first (no token empty), and a call that reads it must follow it (calls
    above max_tokens search: they neither write nor read the mask)."""
    comm: DcpAllToAll = state[key]
    rank, n, dev, hn = comm.rank, comm.world, comm.device, comm.heads_per_rank
    outs, lses = make_inputs(seed, n, B, comm.num_heads, comm.head_dim, comm.dtype, special=True)
    g = torch.Generator().manual_seed(meta_seed)
    seqs = len(query_start_loc) - 1
    lens = [torch.randint(0, 3, (seqs,), generator=g, dtype=torch.int32) for _ in range(n)]
    qsl = torch.tensor(query_start_loc, dtype=torch.int32)
    masked = [mask_by_metadata(l, s, qsl) for l, s in zip(lses, lens)]

    def as_layout(t):
        if layout == "int64":
            return t.long().to(dev)
        if layout in ("strided", "int64_strided"):
            wide = torch.full((t.numel(), 3 if layout == "strided" else 2), -7,
                              dtype=torch.int32 if layout == "strided" else torch.int64)
            wide[:, 0] = t
            return wide.to(dev)[:, 0]
        return t.to(dev)

    sl, q = as_layout(lens[rank]), as_layout(qsl)
    if step is not None:  # a step's calls keep their tensors; a new step refills them in place
        if held.get("step") is not step:
            if held:
                held["sl"].copy_(sl)
                held["q"].copy_(q)
            else:
                held.update(sl=sl, q=q)
            held["step"] = step
        sl, q = held["sl"], held["q"]
    out = torch.full((B, hn, comm.head_dim), float("nan"), dtype=comm.dtype, device=dev) if use_out else None
    first = step is not None and (comm._mask_for[0] is None or comm._mask_for[0][0] is not step)
    if poke:
        comm._masks[0][:B] = 0
        masked = [lse.double() for lse in lses]
    y, yl = comm.lse_reduce(outs[rank].to(dev), lses[rank].to(dev), return_lse=True, out=out, seq_lens=sl,
                            query_start_loc=q, step=step, check=True)
    if first and B <= comm.max_tokens:
        want = mask_by_metadata(torch.zeros(B, 1), lens[rank], qsl)[:, 0] == float("-inf")
        assert torch.equal(comm._masks[0][:B].cpu() != 0, want), "the step's mask differs from the metadata"
    ref, ref_lse = chunk_reference(outs, masked, rank, hn)
    assert torch.equal(torch.isneginf(yl.cpu()), torch.isneginf(ref_lse)), "-inf LSE positions differ"
    err = max_rel_error(y, ref) if B else 0.0
    assert err <= TOL[comm.dtype], f"max relative error {err:.3g} (rank {rank}, B={B}, {layout})"
    return err


def metadata_errors(state, key: str, in_step: bool = False) -> list:
    """Inconsistent batch metadata, the same on every rank: vLLM's errors (and ours for a dtype or
    layout it cannot read); every rank rejects alike, so the next call is still in step. ``in_step``:
    each bad call comes within a step whose first call had good metadata (a step's later calls skip
    the checks only for views of what that call passed), and a step's call with other tensors of the
    same values searches them again, but not one with new views of the same ones (vLLM slices them)."""
    comm: DcpAllToAll = state[key]
    po = torch.randn(3, comm.num_heads, comm.head_dim).to(comm.dtype)
    pl = torch.randn(3, comm.num_heads)
    good_sl, good_q = torch.tensor([1, 2], dtype=torch.int32), torch.tensor([0, 1, 3], dtype=torch.int32)
    step = object() if in_step else None
    if in_step:
        comm.lse_reduce(po, pl, seq_lens=good_sl, query_start_loc=good_q, step=step, check=True)
        kept = comm._mask_for[0]
        comm.lse_reduce(po, pl, seq_lens=good_sl[:], query_start_loc=good_q[:3], step=step, check=True)
        assert comm._mask_for[0] is kept, "new views of the step's tensors searched them again"
    bad = [dict(seq_lens=good_sl), dict(query_start_loc=good_q),
           dict(seq_lens=good_sl, query_start_loc=good_q[:2]),
           dict(seq_lens=good_sl[None], query_start_loc=good_q),
           dict(seq_lens=good_sl.float(), query_start_loc=good_q),
           dict(seq_lens=[1, 2], query_start_loc=good_q)]
    messages = []
    for kwargs in bad:
        try:
            comm.lse_reduce(po, pl, check=True, step=step, **kwargs)
            messages.append("accepted")
        except (TypeError, ValueError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
    y = comm.lse_reduce(po, pl, seq_lens=good_sl, query_start_loc=good_q, check=True)
    assert torch.isfinite(y.float()).all()
    if in_step:
        # Views of one buffer at one address: another dtype is refused, another stride searched.
        wide = torch.tensor([1, 7, 2, 7], dtype=torch.int32)
        comm.lse_reduce(po, pl, seq_lens=wide[:2], query_start_loc=good_q, step=step, check=True)
        try:
            comm.lse_reduce(po, pl, seq_lens=wide[:2].view(torch.float32), query_start_loc=good_q, step=step,
                            check=True)
            raise AssertionError("a float view of the step's seq_lens was accepted")
        except TypeError:
            pass
        kept = comm._mask_for[0]
        comm.lse_reduce(po, pl, seq_lens=wide[::2], query_start_loc=good_q, step=step, check=True)
        assert comm._mask_for[0] is not kept, "a view of another stride read the step's verdicts"
        for sl, q in ((good_sl.clone(), good_q), (good_sl, good_q.clone()), (good_sl, good_q.long()),
                      (good_sl, good_q[:2]), (torch.tensor([1, 2, 5], dtype=torch.int32)[:2], good_q)):
            kept = comm._mask_for[0]
            try:
                comm.lse_reduce(po, pl, seq_lens=sl, query_start_loc=q, step=step, check=True)
            except ValueError:  # (query_start_loc too short: refused, the mask kept)
                assert q.shape[0] == 2 and comm._mask_for[0] is kept
                continue
            assert comm._mask_for[0] is not kept, f"other tensors read the step's verdicts: {sl}, {q}"
    return messages


def elsewhere_alias(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes through a storage object of their own (DLPack), as ``from_numpy`` twice, IPC
    handles or a carved workspace hand them over: torch's own overlap test sees two allocations."""
    from torch.utils.dlpack import from_dlpack, to_dlpack

    return from_dlpack(to_dlpack(t))


class _Subclass(torch.Tensor):
    """A tensor subclass: a call with one skips the communicator's fast check for the slow one."""


def bad_calls(state, key: str) -> list:
    """Every malformed call must raise, with a message naming what was expected and what came; the
    same call with tensor-subclass arguments (checked by the slow path alone) raises the same."""
    comm: DcpAllToAll = state[key]
    dev, H, D, hn = comm.device, comm.num_heads, comm.head_dim, comm.heads_per_rank
    po = torch.randn(2, H, D).to(comm.dtype).to(dev)
    pl = torch.randn(2, H, device=dev)
    po3 = torch.randn(3, H, D).to(comm.dtype).to(dev)
    other = torch.float16 if comm.dtype == torch.bfloat16 else torch.bfloat16
    elsewhere = "meta" if dev.type == "cpu" else "cpu"

    def cases(wrap) -> dict:
        def call(*args, **kwargs):
            return comm.lse_reduce(*map(wrap, args), **{k: wrap(v) for k, v in kwargs.items()})
        return {
            "ndim": lambda: call(po[0], pl),
            "heads": lambda: call(po[:, :-1], pl[:, :-1]),
            "head_dim": lambda: call(torch.randn(2, H, D + 8).to(comm.dtype).to(dev), pl),
            "dtype": lambda: call(po.to(other), pl),
            "lse_dtype": lambda: call(po, pl.double()),
            "lse_shape": lambda: call(po, pl[:1]),
            "out_shape": lambda: call(po, pl, out=torch.empty(2, hn + 1, D, dtype=comm.dtype, device=dev)),
            "out_dtype": lambda: call(po, pl, out=torch.empty(2, hn, D, dtype=other, device=dev)),
            "last_dim_stride": lambda: call(torch.randn(2, D, H).to(comm.dtype).to(dev).transpose(1, 2), pl),
            "out_last_dim_stride": lambda: call(
                po, pl, out=torch.empty(2, D, hn, dtype=comm.dtype, device=dev).transpose(1, 2)),
            "out_lse_shape": lambda: call(
                po, pl, return_lse=True, out_lse=torch.empty(2, hn + 1, dtype=torch.float32, device=dev)),
            "out_lse_dtype": lambda: call(
                po, pl, return_lse=True, out_lse=torch.empty(2, hn, dtype=torch.float64, device=dev)),
            "empty_last_dim_stride": lambda: call(  # B = 0: nothing to move, still malformed
                torch.randn(0, D, H).to(comm.dtype).to(dev).transpose(1, 2), pl[:0]),
            "not_tensor": lambda: call(po.tolist(), pl),
            "device": lambda: call(po.to(elsewhere), pl),
            "lse_device": lambda: call(po, pl.to(elsewhere)),
            "out_device": lambda: call(po, pl, out=torch.empty(2, hn, D, dtype=comm.dtype, device=elsewhere)),
            "out_aliases_input": lambda: call(po, pl, out=po[:, :hn]),
            "out_lse_aliases_lse": lambda: call(po, pl, return_lse=True, out_lse=pl[:, :hn]),
            # the same bytes through other storage objects, at the input's start and past it
            "out_aliases_input_elsewhere": lambda: call(po, pl, out=elsewhere_alias(po)[:, :hn]),
            "out_aliases_input_shifted": lambda: call(po3[:2], pl, out=elsewhere_alias(po3[1:])[:, :hn]),
            "out_lse_aliases_lse_elsewhere": lambda: call(po, pl, return_lse=True,
                                                          out_lse=elsewhere_alias(pl[:, hn:])),
            "out_lse_without_return_lse": lambda: call(po, pl, out_lse=torch.empty(2, hn, device=dev)),
            "lse_base_none": lambda: call(po, pl, is_lse_base_on_e=None),
            "too_many_tokens": lambda: call(po[:1].expand(1 << 28, H, D), pl[:1].expand(1 << 28, H)),
            # last: a channel that does not exist poisons every channel (the peers' is unknown)
            "channel": lambda: call(po, pl, channel=comm.channels),
            "negative_channel": lambda: call(po, pl, channel=-1),
            "channel_bool": lambda: call(po, pl, channel=True),
        }

    plain = cases(lambda v: v)
    subclassed = cases(lambda v: v.as_subclass(_Subclass) if isinstance(v, torch.Tensor) else v)
    messages = []
    for name in plain:
        got = []
        for call in (plain[name], subclassed[name]):
            try:
                call()
            except (ValueError, TypeError, DcpError) as exc:
                got.append(f"{type(exc).__name__}: {exc}")
            else:
                raise AssertionError(f"{name}: malformed call was accepted ({len(got)} of 2)")
        assert "expected" in got[0], f"{name}: message does not say what was expected: {got[0]}"
        assert got[0] == got[1], f"{name}: the fast and the slow check disagree: {got}"
        messages.append(f"{name}: {got[0]}")
    return messages


def construct_expect_error(state, device: str = "cpu", **kwargs) -> str:
    """Construction that must fail on every rank alike; returns the message."""
    kwargs["dtype"] = DTYPES[kwargs.get("dtype", "bfloat16")]
    before = shm_segments()
    try:
        DcpAllToAll(dist.group.WORLD, device=device, **kwargs)
    except DcpError as exc:
        assert shm_segments() == before, "a failed construction left shared memory behind"
        return str(exc)
    raise AssertionError("construction succeeded but should have failed")


def construct_recording_compiles(state, fail_rank: int = -1, device: str = "cpu", **kwargs):
    """Construct with this rank's ``TritonTransport.load`` recorded (and raising on ``fail_rank``).

    Returns the (LSE dtype, tilings) of each load the constructor asked for, then the ChannelLayout's
    tilings; or, where construction failed, the DcpError's message."""
    from dcp.transports import TritonTransport

    loads, original = [], TritonTransport.load

    def load(self, kind, operands, po, lse, y, warps=None):
        loads.append(("gather" if kind == KIND_GATHER else str(lse.dtype), warps))
        if dist.get_rank() == fail_rank:
            raise RuntimeError("injected compile failure")
        original(self, kind, operands, po, lse, y, warps)

    TritonTransport.load = load
    try:
        if fail_rank >= 0:
            return construct_expect_error(state, device, **kwargs)
        with DcpAllToAll(dist.group.WORLD, device=device, **kwargs) as comm:
            return loads, comm.layout.tilings, comm.gather_layout.tilings
    finally:
        TritonTransport.load = original


def call_after_close(state, device: str = "cpu") -> str:
    comm = DcpAllToAll(dist.group.WORLD, max_tokens=2, num_heads=2 * dist.get_world_size(), head_dim=8,
                       device=device)
    with comm:
        pass
    try:
        comm.lse_reduce(torch.randn(1, comm.num_heads, 8).bfloat16().to(comm.device),
                        torch.randn(1, comm.num_heads, device=comm.device))
    except DcpError as exc:
        return str(exc)
    raise AssertionError("a call after close() was accepted")


def shm_segments(state=None) -> list:
    """The host shared-memory segments of this test session's processes (their names carry the
    session's DCP_A2A_SHM_TAG, set by tests/conftest.py): another run or a server on the machine
    has segments too, and they are not this session's leaks."""
    from dcp.buffers import SHM_PREFIX

    tag = os.environ.get("DCP_A2A_SHM_TAG")
    assert tag, "DCP_A2A_SHM_TAG is not set (tests/conftest.py sets it for the session)"
    return sorted(glob.glob(f"{glob.escape(SHM_PREFIX + tag)}-*"))


def leaking_construction(state) -> list:
    """A planted leak: a communicator built and closed with the provider's unlinking turned off;
    returns the segments this session's processes then hold (the caller removes them)."""
    from unittest import mock

    with mock.patch("dcp.buffers._unlink", lambda paths: None):
        DcpAllToAll(dist.group.WORLD, max_tokens=2, num_heads=2 * dist.get_world_size(), head_dim=8).close()
    dist.barrier()
    return shm_segments()


def rank_pid(state) -> int:
    return os.getpid()


def count_launches(state, key: str, B: int) -> list:
    """Names of the device kernels one eager call runs, as the CUDA profiler sees them."""
    from torch.profiler import ProfilerActivity, profile

    comm: DcpAllToAll = state[key]
    outs, lses = make_inputs(1, comm.world, B, comm.num_heads, comm.head_dim, comm.dtype)
    po, pl = outs[comm.rank].to(comm.device), lses[comm.rank].to(comm.device)
    out = torch.empty((B, comm.heads_per_rank, comm.head_dim), dtype=comm.dtype, device=comm.device)
    comm.lse_reduce(po, pl, out=out)
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        comm.lse_reduce(po, pl, out=out)
        torch.cuda.synchronize()
    dist.barrier()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


def entry_pointers(state, key: str) -> list:
    """The pointer arguments a loaded variant's entry point gets, against the tensors each launch
    should read: a combine (with ``out_lse``), one with batch metadata, one of three chunks, and a
    query all-gather. On the CPU nothing is compiled, so each variant's entry is a fake that
    records its arguments; no kernel runs on any rank, so the ranks stay in step. Returns per
    launch (recorded, expected) pointer tuples."""
    import types

    from dcp.constants import KIND_COMBINE

    comm: DcpAllToAll = state[key]
    t = comm._transport
    seen = []
    for fused in t.fused.values():
        fused.raw_stream = lambda index: 0
        for variant in ((torch.float32, True, True, True), (KIND_GATHER, True, True, True)):
            fused.compiled[variant] = (types.SimpleNamespace(function=0), lambda *args: seen.append(args[9:17]),
                                       (0, 0, None, None), ())
    mt, n, hn, d = comm.max_tokens, comm.num_heads, comm.heads_per_rank, comm.head_dim
    at = torch.Tensor.data_ptr
    expected = []
    B = mt - 1
    po, pl = torch.randn(B, n, d).to(comm.dtype), torch.randn(B, n)
    y, y_lse = torch.empty(B, hn, d, dtype=comm.dtype), torch.empty(B, hn)
    comm.lse_reduce(po, pl, return_lse=True, out=y, out_lse=y_lse)
    ctl, (sl0, qsl0, _, _, _, tmask, _) = t.ctl[0], t.no_meta
    expected.append((po, pl, y, y_lse, ctl, sl0, qsl0, tmask))
    sl, qsl = torch.ones(B, dtype=torch.int32), torch.arange(B + 1, dtype=torch.int32)
    comm.lse_reduce(po, pl, out=y, seq_lens=sl, query_start_loc=qsl)
    expected.append((po, pl, y, t.scratch, ctl, sl, qsl, comm._masks[0]))
    B = 2 * mt + 1  # three launches
    po, pl, y = torch.randn(B, n, d).to(comm.dtype), torch.randn(B, n), torch.empty(B, hn, d, dtype=comm.dtype)
    comm.lse_reduce(po, pl, out=y)
    for b0 in range(0, B, mt):
        expected.append((po[b0:], pl[b0:], y[b0:], t.scratch, ctl, sl0, qsl0, tmask))
    q = torch.randn(mt, hn, comm.query_dim).to(comm.query_dtype)
    qy = torch.empty(mt, n, comm.query_dim, dtype=comm.query_dtype)
    comm.all_gather_heads(q, out=qy)
    expected.append((q, comm._loader.scratch, qy, t.scratch, ctl, sl0, qsl0, tmask))
    assert len(seen) == len(expected) == 6, (len(seen), len(expected))
    return [(tuple(got), tuple(map(at, want))) for got, want in zip(seen, expected)]


def _fill(dst_out, dst_lse, outs, lses, rank):
    dst_out.copy_(outs[rank])
    dst_lse.copy_(lses[rank])


def step_graph_case(state, key: str, seed: int, replays: int = 6) -> float:
    """``step=`` in CUDA graphs: a graph of three combines of one step, captured after eager calls of
    that step on the same metadata tensors, must search in its first call (a verdict from outside
    the capture would be stale at replay), each replay after the metadata was refilled in place;
    and an eager step's verdicts, written before a replay of that graph (which rewrites the mask),
    must not be read after it. Every call on fresh inputs against the float64 reference."""
    comm: DcpAllToAll = state[key]
    dev, H, D, hn, n, rank = comm.device, comm.num_heads, comm.head_dim, comm.heads_per_rank, comm.world, comm.rank
    B, bounds = 6, [0, 1, 3, 4, 5]
    qsl = torch.tensor(bounds, dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    # (each replay's seq_lens are the last ones flipped, 0 <-> 1, and the eager step's those of the
    # first replay flipped: a verdict read where it should have been searched is wrong somewhere)
    lens_g = [torch.randint(0, 2, (len(bounds) - 1,), generator=g, dtype=torch.int32) for _ in range(n)]
    lens_e = [lens.clone() for lens in lens_g]
    sl_g, q_g = lens_g[rank].to(dev), qsl.to(dev)
    sl_e, q_e = lens_e[rank].to(dev), qsl.clone().to(dev)
    po = torch.empty((3, B, H, D), dtype=comm.dtype, device=dev)
    pl = torch.empty((3, B, H), dtype=torch.float32, device=dev)
    ys = torch.empty((3, B, hn, D), dtype=comm.dtype, device=dev)
    max_err = 0.0

    def check(y, outs, lses, lens) -> None:
        nonlocal max_err
        ref, _ = chunk_reference(outs, [mask_by_metadata(l, s, qsl) for l, s in zip(lses, lens)], rank, hn)
        err = max_rel_error(y, ref)
        assert err <= TOL[comm.dtype], f"error {err}"
        max_err = max(max_err, err)

    def fresh(k: int, s: int):
        outs, lses = make_inputs(seed + 100 * s + k, n, B, H, D, comm.dtype)
        _fill(po[k], pl[k], outs, lses, rank)
        return outs, lses

    step = object()
    for k in range(2):  # the step's eager calls: the second reads the first's verdicts
        inputs = fresh(k, 0)
        comm.lse_reduce(po[k], pl[k], out=ys[k], seq_lens=sl_g, query_start_loc=q_g, step=step)
        check(ys[k], *inputs, lens_g)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=stream):
        for k in range(3):
            comm.lse_reduce(po[k], pl[k], out=ys[k], seq_lens=sl_g, query_start_loc=q_g, step=step)
    torch.cuda.current_stream().wait_stream(stream)
    eager_step = object()
    for s in range(1, replays + 1):
        lens_g = [1 - lens for lens in lens_g]
        sl_g.copy_(lens_g[rank])
        inputs = [fresh(k, s) for k in range(3)]
        ys.fill_(float("nan"))
        if s == 1:  # an eager step on other tensors, before the replay rewrites the mask
            eager_in = make_inputs(seed + 7, n, B, H, D, comm.dtype)
            y = comm.lse_reduce(eager_in[0][rank].to(dev), eager_in[1][rank].to(dev), seq_lens=sl_e,
                                query_start_loc=q_e, step=eager_step)
            check(y, *eager_in, lens_e)
        graph.replay()
        for k in range(3):
            check(ys[k], *inputs[k], lens_g)
        if s == 1:  # the same eager step again, after the replay: it must not read the mask
            y = comm.lse_reduce(eager_in[0][rank].to(dev), eager_in[1][rank].to(dev), seq_lens=sl_e,
                                query_start_loc=q_e, step=eager_step)
            check(y, *eager_in, lens_e)
    torch.cuda.synchronize()
    comm.check()
    return max_err


def step_graph_reads_case(state, key: str, seed: int, replays: int = 2) -> float:
    """A captured step's later call reads the verdicts its first call wrote: a graph clears the mask
    between the two (every token kept), so the second call must return the unmasked combine. A
    second call that searched the metadata again returns the masked one, which differs (checked)."""
    comm: DcpAllToAll = state[key]
    dev, H, D, hn, n, rank = comm.device, comm.num_heads, comm.head_dim, comm.heads_per_rank, comm.world, comm.rank
    B, bounds = 6, [0, 1, 3, 4, 5]  # (token 5 is graph padding)
    qsl = torch.tensor(bounds, dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    lens = [torch.randint(0, 2, (len(bounds) - 1,), generator=g, dtype=torch.int32) for _ in range(n)]
    lens[0][0] = 0
    sl, q = lens[rank].to(dev), qsl.to(dev)
    po = torch.empty((2, B, H, D), dtype=comm.dtype, device=dev)
    pl = torch.empty((2, B, H), dtype=torch.float32, device=dev)
    ys = torch.empty((2, B, hn, D), dtype=comm.dtype, device=dev)
    step = object()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=stream):
        comm.lse_reduce(po[0], pl[0], out=ys[0], seq_lens=sl, query_start_loc=q, step=step)
        comm._masks[0][:B].fill_(0)
        comm.lse_reduce(po[1], pl[1], out=ys[1], seq_lens=sl, query_start_loc=q, step=step)
    torch.cuda.current_stream().wait_stream(stream)
    max_err = 0.0
    for s in range(replays):
        inputs = [make_inputs(seed + 100 * s + k, n, B, H, D, comm.dtype) for k in range(2)]
        for k in range(2):
            _fill(po[k], pl[k], *inputs[k], rank)
        ys.fill_(float("nan"))
        graph.replay()
        masked = [chunk_reference(o, [mask_by_metadata(l, m, qsl) for l, m in zip(ls, lens)], rank, hn)[0]
                  for o, ls in inputs]
        unmasked = chunk_reference(*inputs[1], rank, hn)[0]
        assert max_rel_error(masked[1], unmasked) > 10 * TOL[comm.dtype], "the cleared mask changes nothing here"
        for y, ref in ((ys[0], masked[0]), (ys[1], unmasked)):
            err = max_rel_error(y, ref)
            assert err <= TOL[comm.dtype], f"error {err} (the second call did not read the cleared mask?)"
            max_err = max(max_err, err)
    torch.cuda.synchronize()
    comm.check()
    return max_err


def graph_case(state, key: str, seed: int, sizes: list, calls_per_graph: int, replays: int,
               channel: int = 0) -> dict:
    """Graphs at several batch sizes, each holding several calls, replayed in a random order shared
    by all ranks and interleaved with eager calls, on fresh inputs written in place each time."""
    comm: DcpAllToAll = state[key]
    dev, H, D, hn, n, rank = comm.device, comm.num_heads, comm.head_dim, comm.heads_per_rank, comm.world, comm.rank
    g = torch.Generator().manual_seed(seed)
    graphs = []
    alloc_deltas = []
    for B in sizes:
        po = [torch.empty((B, H, D), dtype=comm.dtype, device=dev) for _ in range(calls_per_graph)]
        pl = [torch.empty((B, H), dtype=torch.float32, device=dev) for _ in range(calls_per_graph)]
        ys = [torch.empty((B, hn, D), dtype=comm.dtype, device=dev) for _ in range(calls_per_graph)]
        yl = [torch.empty((B, hn), dtype=torch.float32, device=dev) for _ in range(calls_per_graph)]
        for k in range(calls_per_graph):
            o, l = make_inputs(seed + 7 * B + k, n, B, H, D, comm.dtype)
            _fill(po[k], pl[k], o, l, rank)
        # the eager warm-up call just before capture, as a serving engine does
        comm.lse_reduce(po[0], pl[0], out=ys[0], out_lse=yl[0], return_lse=True, channel=channel)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # An empty capture on the same stream first takes whatever torch allocates for a
        # capture itself; the capture of our calls must then allocate nothing at all.
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
            pass
        allocs = lambda: torch.cuda.memory_stats(dev).get("allocation.all.allocated", 0)
        with torch.cuda.graph(graph, stream=stream):
            for k in range(calls_per_graph):
                before = allocs()
                comm.lse_reduce(po[k], pl[k], out=ys[k], out_lse=yl[k], return_lse=True, channel=channel)
                alloc_deltas.append(allocs() - before)
        graphs.append((B, graph, po, pl, ys, yl))
    order = torch.randint(0, len(graphs), (replays,), generator=g).tolist()
    max_err = 0.0
    for step, i in enumerate(order):
        B, graph, po, pl, ys, yl = graphs[i]
        inputs = []
        for k in range(calls_per_graph):
            o, l = make_inputs(seed * 31 + step * 101 + k, n, B, H, D, comm.dtype, special=(k == 1))
            _fill(po[k], pl[k], o, l, rank)
            ys[k].fill_(float("nan"))
            yl[k].fill_(float("nan"))
            inputs.append((o, l))
        graph.replay()
        if step % 3 == 2:  # an eager call between replays moves the epoch by one
            o, l = make_inputs(seed + step, n, 5, H, D, comm.dtype)
            comm.lse_reduce(o[rank].to(dev), l[rank].to(dev), channel=channel)
        torch.cuda.synchronize()
        for k, (o, l) in enumerate(inputs):
            ref, ref_lse = chunk_reference(o, l, rank, hn)
            y = ys[k].double().cpu()
            assert torch.isfinite(y).all(), f"graph B={B} call {k} step {step}: unwritten or NaN outputs"
            err = max_rel_error(y, ref)
            assert err <= TOL[comm.dtype], f"graph B={B} call {k} step {step}: error {err}"
            fin = torch.isfinite(ref_lse)
            assert torch.equal(torch.isneginf(yl[k].double().cpu()), torch.isneginf(ref_lse))
            assert (yl[k].double().cpu()[fin] - ref_lse[fin]).abs().max().item() < 1e-3
            max_err = max(max_err, err)
    comm.check()
    return {"max_err": max_err, "alloc_deltas": alloc_deltas, "replays": replays}


def capture_before_warmup(state, key: str) -> str:
    """A capture that would need an unloaded variant must refuse, not compile inside the capture."""
    comm: DcpAllToAll = state[key]
    dev, H, D = comm.device, comm.num_heads, comm.head_dim
    raw = torch.empty(2 * H * D + 1, dtype=comm.dtype, device=dev)
    po = raw[1:].view(2, H, D)  # 2-byte offset: a layout no warm-up compiled
    pl = torch.randn(2, H, device=dev)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            comm.lse_reduce(po, pl)
    except DcpError as exc:
        assert "warmup" in str(exc)
        return str(exc)
    raise AssertionError("capture compiled a new variant instead of refusing")


def auto_backend(state, device: str = "cpu", fail_setup_on: int = -1, other_host_on: int = -1,
                 env_backend: str = "", backend=None) -> tuple:
    """Construct with backend selection under injected faults; returns (backend, reason) after a
    checked call, so every rank proves the chosen path works."""
    from unittest import mock

    import dcp.buffers
    import dcp.config

    rank = dist.get_rank()
    patches = []
    if rank == fail_setup_on:
        cls = dcp.buffers.HostShmProvider if device == "cpu" else dcp.buffers.CudaIpcProvider
        real = cls.open

        def failing(self, group, nbytes):
            with mock.patch.object(cls, "_map", side_effect=OSError("injected failure")) if device == "cpu" \
                    else mock.patch("dcp.cudart.malloc", side_effect=RuntimeError("injected failure")):
                return real(self, group, nbytes)
        patches.append(mock.patch.object(cls, "open", failing))
    if rank == other_host_on:
        patches.append(mock.patch.object(dcp.config.socket, "gethostname", return_value="another-host"))
    if env_backend:
        patches.append(mock.patch.dict(os.environ, {"DCP_A2A_BACKEND": env_backend}))
    for p in patches:
        p.start()
    try:
        n = dist.get_world_size()
        state["auto"] = DcpAllToAll(dist.group.WORLD, max_tokens=4, num_heads=2 * n, head_dim=16,
                                    device=device, backend=backend)
    finally:
        for p in patches:
            p.stop()
    comm = state["auto"]
    lse_case(state, "auto", 1234, B=3, special=True)
    result = (comm.backend, comm.backend_reason)
    state.pop("auto").close()
    assert shm_segments() == [], "a fallback left shared memory behind"
    return result


def set_epoch(state, key: str, channel: int, epoch: int) -> None:
    """Move a channel's device epoch (every rank alike), e.g. just below the wrap."""
    state[key]._transport.poke_epoch(channel, epoch)


def channel_mix(state, key: str, seed: int, pattern: list) -> int:
    """Calls on several channels in an interleaving that leaves their epochs different."""
    for i, ch in enumerate(pattern):
        lse_case(state, key, seed + i, B=1 + (i % 3), channel=ch, special=i % 2 == 0)
    return len(pattern)


def exit_now(state) -> None:
    os._exit(17)  # abrupt: no close, no goodbye


def expect_timeout(state, key: str, B: int = 2) -> dict:
    """A call whose peers never come: DcpTimeoutError naming them, within the timeout + margin."""
    import time

    from dcp import DcpMismatchError, DcpTimeoutError

    comm: DcpAllToAll = state[key]
    po = torch.randn(B, comm.num_heads, comm.head_dim).to(comm.dtype).to(comm.device)
    pl = torch.randn(B, comm.num_heads, device=comm.device)
    out = torch.zeros(B, comm.heads_per_rank, comm.head_dim, dtype=comm.dtype, device=comm.device)
    t0 = time.monotonic()
    try:
        comm.lse_reduce(po, pl, out=out, check=True)
    except (DcpTimeoutError, DcpMismatchError) as exc:  # a mismatch: another survivor failed first
        elapsed = time.monotonic() - t0
        assert torch.isnan(out.float()).all(), "rows that could not be combined must read as NaN"
        if comm.device.type == "cuda":  # the context is still usable: no trap killed it
            assert torch.ones(4, device=comm.device).sum().item() == 4
        return {"elapsed": elapsed, "missing": exc.missing_ranks, "message": str(exc)}
    raise AssertionError("a call with absent peers returned without DcpTimeoutError")


def _timeout_with_a_record_planted(state, key: str, B: int, planted) -> dict:
    """``expect_timeout`` with the interpreted kernel's ``_record_failure`` replaced by
    ``planted(record)`` (the real one wrapped) for this call."""
    from dcp.kernels import build_kernels

    scope = build_kernels(True).fused.fn.__globals__  # the interpreted kernel's helpers
    record = scope["_record_failure"]
    scope["_record_failure"] = planted(record)
    try:
        return expect_timeout(state, key, B)
    finally:
        scope["_record_failure"] = record


def timeout_with_a_late_flag(state, key: str, B: int = 2) -> dict:
    """``expect_timeout`` on the CPU tier with the race planted in the real kernel: as this rank's
    wait, given up on rank 1, records the failure, rank 1's flag of this very call lands (a late
    peer's, with this call's tag). The record must still name rank 1."""
    import triton.language as tl

    def planted(record):
        def late(status, flags, ctl, slot, t, e, tag, code, absent, N, TILES_MAX, *rest):
            tl.store(flags + TILES_MAX + t, (tag.to(tl.int64) << 32) | e.to(tl.int64))  # source 1, tile t
            return record(status, flags, ctl, slot, t, e, tag, code, absent, N, TILES_MAX, *rest)
        return late

    return _timeout_with_a_record_planted(state, key, B, planted)


def timeout_with_a_racing_record(state, key: str, B: int = 2) -> dict:
    """``expect_timeout`` on the CPU tier; on rank 0 a second program's record is planted in the
    real kernel: it gave up on source 1 only (its own tile's view) and wrote its words, and this
    program read the channel unrecorded before that program's code landed, so both write. The
    record must name what either program missed: one must not clear the other's sources."""
    import triton.language as tl

    def planted(record):
        def racing(status, flags, ctl, slot, t, e, tag, code, absent, *rest):
            record(status, flags, ctl, slot, t, e, tag, code, absent * 0 + 0b10, *rest)
            tl.store(status, 0)  # (its code not yet seen by this program)
            return record(status, flags, ctl, slot, t, e, tag, code, absent, *rest)
        return racing

    if state[key].rank != 0:
        return expect_timeout(state, key, B)
    return _timeout_with_a_record_planted(state, key, B, planted)


def timeout_after_a_tile_that_arrived(state, key: str, B: int, lossy: int) -> dict:
    """Rank ``lossy`` loses its flag of the call's second tile (planted in the interpreted kernel),
    so with one program a rank's first tile arrives and its second never does. That wait's
    failure must be recorded like a first tile's: the call raises, naming rank ``lossy``."""
    from dcp import DcpTimeoutError
    from dcp.kernels import build_kernels

    comm: DcpAllToAll = state[key]
    scope = build_kernels(True).fused.fn.__globals__  # the interpreted kernel's helpers
    store, stores = scope["_store_relaxed"], []

    def second_lost(ptr, val, GPU_SCOPE):
        stores.append(val)
        if len(stores) != 2:  # the flags of tile 0, then of tile 1: the second store is lost
            store(ptr, val, GPU_SCOPE)

    if comm.rank == lossy:
        scope["_store_relaxed"] = second_lost
    po = torch.randn(B, comm.num_heads, comm.head_dim).to(comm.dtype)
    pl = torch.randn(B, comm.num_heads)
    out = torch.full((B, comm.heads_per_rank, comm.head_dim), 7.0, dtype=comm.dtype)
    try:
        comm.lse_reduce(po, pl, out=out, check=True)
    except DcpTimeoutError as exc:
        return {"missing": exc.missing_ranks, "message": str(exc), "flags": len(stores)}
    finally:
        scope["_store_relaxed"] = store
    return {"returned": True, "flags": len(stores)}


def one_wait_flag_lost(state, key: str, seed: int, B: int, lossy: int) -> dict:
    """A combine whose tiling publishes one flag per program (16 warps), of several tiles a program,
    with every flag store of rank ``lossy`` (-1: none) lost (planted in the interpreted kernel).
    Returns the call's tiles and grid, the flag stores each rank made (publications, refreshes,
    retractions), then the error the call raised, or its rows' error against the float64 reference."""
    from dcp import DcpMismatchError, DcpTimeoutError
    from dcp.constants import KIND_COMBINE
    from dcp.kernels import build_kernels

    comm: DcpAllToAll = state[key]
    rank, hn, transport = comm.rank, comm.heads_per_rank, comm._transports[comm.backend]
    warps = comm.tiling(B)[0]
    res = {"tiles": transport.layout.tiles(B, warps), "grid": transport.by_size[KIND_COMBINE][B - 1][1],
           "one_wait": transport.layout.one_wait(warps)}
    scope = build_kernels(True).fused.fn.__globals__  # the interpreted kernel's helpers
    store, stores = scope["_store_relaxed"], []

    def lost(ptr, val, GPU_SCOPE):
        stores.append(val)  # (never stored: this rank's peers never see it)

    def counted(ptr, val, GPU_SCOPE):
        stores.append(val)
        store(ptr, val, GPU_SCOPE)

    scope["_store_relaxed"] = lost if rank == lossy else counted
    outs, lses = make_inputs(seed, comm.world, B, comm.num_heads, comm.head_dim, comm.dtype)
    out = torch.full((B, hn, comm.head_dim), float("nan"), dtype=comm.dtype)
    try:
        comm.lse_reduce(outs[rank], lses[rank], out=out, check=True)
        res["error"] = max_rel_error(out.double(), chunk_reference(outs, lses, rank, hn)[0])
    except (DcpTimeoutError, DcpMismatchError) as exc:
        res.update(missing=exc.missing_ranks, message=str(exc), nan=bool(torch.isnan(out.float()).all()))
    finally:
        scope["_store_relaxed"] = store
    res["flags"] = len(stores)
    return res


def flag_from_a_period_ago(state, key: str, seed: int, B: int, lossy: int, filler: int = 0) -> dict:
    """A call of B on channel 0, then as many calls as make an epoch period (all but the last few
    skipped by moving the epoch): combines without rows, or gathers of ``filler`` tokens, which
    publish one flag per program and must refresh the indices they leave alone. Then
    ``timeout_after_a_tile_that_arrived``'s call of B: the same tag and epoch as the first, with
    rank ``lossy``'s flag of tile 1 or later lost. The first call's flag at that index, if nothing
    rewrote it, would stand in for it."""
    import ctypes

    from dcp.constants import EPOCH_PERIOD, EPOCH_STRIDE

    comm: DcpAllToAll = state[key]
    transport = comm._transports[comm.backend]
    epoch = ctypes.c_uint32.from_address(transport.regions[0].local).value // EPOCH_STRIDE  # (CPU tier)
    lse_case(state, key, seed, B)
    small = 4 * transport.region.tiles_max
    transport.poke_epoch(0, (epoch - small) % EPOCH_PERIOD)
    q = torch.randn(filler, comm.heads_per_rank, comm.query_dim).to(comm.query_dtype) if filler else None
    for i in range(small):
        if q is not None:
            comm.all_gather_heads(q)
        else:
            lse_case(state, key, seed + 1 + i, 0)  # (one program, publishing at index 0)
    return timeout_after_a_tile_that_arrived(state, key, B, lossy)


def expect_mismatch(state, key: str, B: int) -> str:
    from dcp import DcpMismatchError

    comm: DcpAllToAll = state[key]
    po = torch.randn(B, comm.num_heads, comm.head_dim).to(comm.dtype).to(comm.device)
    pl = torch.randn(B, comm.num_heads, device=comm.device)
    try:
        comm.lse_reduce(po, pl, check=True)
    except DcpMismatchError as exc:
        return str(exc)
    raise AssertionError("ranks with different B were not told")


def watchdog_sees_timeout(state, key: str) -> str:
    """Only this rank calls (check off); the background watchdog must report the timeout."""
    import threading

    comm: DcpAllToAll = state[key]
    seen = threading.Event()
    errors = []
    comm.start_watchdog(0.05, lambda exc: (errors.append(str(exc)), seen.set()))
    po = torch.randn(1, comm.num_heads, comm.head_dim).to(comm.dtype).to(comm.device)
    comm.lse_reduce(po, torch.randn(1, comm.num_heads, device=comm.device), check=False)
    assert seen.wait(10), "the watchdog did not report the timed-out call"
    comm.stop_watchdog()
    return errors[0]


def _resources() -> dict:
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    return {"fds": len(os.listdir("/proc/self/fd")), "maps": maps, "shm": len(shm_segments())}


def construct_close_loop(state, times: int, device: str = "cpu", max_tokens: int = 8,
                         heads_per_rank: int = 2, head_dim: int = 64) -> tuple:
    """Construct and close ``times`` communicators: descriptors, mappings, segments and device
    memory must end where they started."""
    n = dist.get_world_size()
    make = lambda: DcpAllToAll(dist.group.WORLD, max_tokens=max_tokens, num_heads=heads_per_rank * n,
                               head_dim=head_dim, device=device, channels=2)
    make().close()
    free = lambda: torch.cuda.mem_get_info()[0] if device == "cuda" else 0
    dist.barrier()
    before, free0 = _resources(), free()
    per = 0
    for _ in range(times):
        with make() as comm:
            per = comm.memory_bytes()["total"]
    dist.barrier()
    after, free1 = _resources(), free()
    # A leak of even one resource per communicator would show ``times`` over. Mappings may grow once:
    # on CPU a rank maps one more region (anonymous, 1 MiB + 4 KiB) once, between its 40th and 60th
    # construction, and none in the next 60; so did e34db41's constructor.
    maps_grown = after.pop("maps") - before.pop("maps")
    assert after == before and 0 <= maps_grown <= 1, (before, after, maps_grown)
    assert abs(free1 - free0) < max(per, 1 << 20) * n, (free0, free1)
    return before, after


def soak(state, key: str, seed: int, calls: int, check_every: int) -> dict:
    """Many calls, random B per call (the same on every rank), both channels, sampled checks."""
    import random
    import time

    comm: DcpAllToAll = state[key]
    rnd = random.Random(seed)
    dev, rank, n = comm.device, comm.rank, comm.world
    H, D, hn = comm.num_heads, comm.head_dim, comm.heads_per_rank
    outs, lses = make_inputs(seed, n, 2 * comm.max_tokens, H, D, comm.dtype, special=True)
    po_all, pl_all = outs[rank].to(dev), lses[rank].to(dev)
    done, checked, t0 = 0, 0, time.monotonic()
    for i in range(calls):
        B = rnd.randint(1, 2 * comm.max_tokens)
        ch = rnd.randrange(comm.channels)
        y = comm.lse_reduce(po_all[:B], pl_all[:B], channel=ch, check=False)
        if i % check_every == 0:
            ref, _ = chunk_reference([o[:B] for o in outs], [l[:B] for l in lses], rank, hn)
            err = max_rel_error(y, ref)
            assert err <= TOL[comm.dtype], f"call {i}: error {err}"
            checked += 1
        done += 1
    comm.check(synchronize=True)
    return {"calls": done, "checked": checked, "seconds": time.monotonic() - t0}


def two_streams(state, key: str, seed: int, calls: int) -> float:
    """Channel 0 driven from one stream and channel 1 from another, concurrently."""
    comm: DcpAllToAll = state[key]
    dev, rank, n, H, D, hn = comm.device, comm.rank, comm.world, comm.num_heads, comm.head_dim, comm.heads_per_rank
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    jobs = []
    for ch in (0, 1):
        for k in range(calls):
            outs, lses = make_inputs(seed + 100 * ch + k, n, 2 + ch, H, D, comm.dtype, special=True)
            jobs.append((ch, outs, lses, outs[rank].to(dev), lses[rank].to(dev),
                         torch.full((2 + ch, hn, D), float("nan"), dtype=comm.dtype, device=dev)))
    torch.cuda.synchronize()
    for k in range(calls):  # interleave the issue order: both streams have work queued at once
        for ch in (0, 1):
            _, _, _, po, pl, y = jobs[ch * calls + k]
            with torch.cuda.stream(streams[ch]):
                comm.lse_reduce(po, pl, out=y, channel=ch)
    torch.cuda.synchronize()
    comm.check()
    worst = 0.0
    for ch, outs, lses, _, _, y in jobs:
        ref, _ = chunk_reference(outs, lses, rank, hn)
        err = max_rel_error(y, ref)
        assert err <= TOL[comm.dtype], (ch, err)
        worst = max(worst, err)
    return worst


def traced_calls(state, seed: int, B: int, calls: int) -> list:
    """Checked calls with the trace compiled in; returns the records (and that tracing off raises)."""
    untraced = DcpAllToAll(dist.group.WORLD, max_tokens=B, num_heads=2 * dist.get_world_size(), head_dim=16)
    try:
        untraced.trace()
        raise AssertionError("trace() without DCP_A2A_TRACE=1 returned")
    except DcpError as exc:
        assert "DCP_A2A_TRACE" in str(exc)
    finally:
        untraced.close()
    os.environ["DCP_A2A_TRACE"] = "1"
    try:
        state["trace"] = DcpAllToAll(dist.group.WORLD, max_tokens=B, num_heads=2 * dist.get_world_size(),
                                     head_dim=16)
    finally:
        del os.environ["DCP_A2A_TRACE"]
    for i in range(calls):
        lse_case(state, "trace", seed + i, B, use_out=True)
    records = state["trace"].trace().numpy()
    state.pop("trace").close()
    return records
