"""Functions that run on every rank of a ``tests.world.World`` (first argument: the rank's state)."""

import glob
import math
import os

import torch
import torch.distributed as dist

from dcp import DcpAllToAll, DcpError
from tests.reference import lse_combine_reference, make_inputs

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _device(state) -> str:
    return "cuda" if torch.cuda.is_available() and state.get("cuda", True) else "cpu"


def make_comm(state, key: str, device: str = "cpu", **kwargs) -> str:
    kwargs["dtype"] = DTYPES[kwargs.get("dtype", "bfloat16")]
    if key in state:
        state.pop(key).close()
    state[key] = DcpAllToAll(dist.group.WORLD, device=device, **kwargs)
    return repr(state[key])


def close_comm(state, key: str) -> None:
    state.pop(key).close()


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
             special: bool = False, channel: int = 0) -> float:
    """One call on fresh random inputs, checked against the float64 reference. Returns max error."""
    comm: DcpAllToAll = state[key]
    rank, n, dev = comm.rank, comm.world, comm.device
    H, D, hn = comm.num_heads, comm.head_dim, comm.heads_per_rank
    outs, lses = make_inputs(seed, n, B, H, D, comm.dtype, DTYPES[lse_dtype], special)
    po, pl = outs[rank].to(dev), lses[rank].to(dev)
    if strided:
        po = _strided(po, 1)
        pl = _strided(pl.t().contiguous(), 0).t()  # head-major storage: LSE stride (1, H + pad)
        assert not po.is_contiguous() and not pl.is_contiguous()
    out = out_lse = None
    if use_out:  # poisoned: an element the kernel does not write stays NaN and fails the check
        out = torch.full((B, hn, D), float("nan"), dtype=comm.dtype, device=dev)
        out_lse = torch.full((B, hn), float("nan"), dtype=torch.float32, device=dev) if return_lse else None
    res = comm.lse_reduce(po, pl, return_lse=return_lse, is_lse_base_on_e=base_e, out=out,
                          out_lse=out_lse, channel=channel)
    y, y_lse = res if return_lse else (res, None)
    if use_out:
        assert y is out and (y_lse is out_lse)
    assert y.shape == (B, hn, D) and y.dtype == comm.dtype
    ref, ref_lse = lse_combine_reference(outs, lses, base_e)
    ref, ref_lse = ref[:, rank * hn:(rank + 1) * hn], ref_lse[:, rank * hn:(rank + 1) * hn]
    y64 = y.double().cpu()
    assert torch.isfinite(y64).all(), f"non-finite outputs at {torch.nonzero(~torch.isfinite(y64))[:5].tolist()}"
    tol = TOL[comm.dtype]
    err = ((y64 - ref).abs() / (1 + ref.abs())).max().item() if B else 0.0
    assert err <= tol, f"max relative error {err:.3g} > {tol} (rank {rank}, B={B})"
    if return_lse:
        yl = y_lse.double().cpu()
        assert y_lse.dtype == torch.float32 and y_lse.shape == (B, hn)
        assert torch.equal(torch.isneginf(yl), torch.isneginf(ref_lse)), "-inf LSE positions differ"
        fin = torch.isfinite(ref_lse)
        assert torch.isfinite(yl[fin]).all()
        lerr = (yl[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
        assert lerr <= 1e-4 * (1 + ref_lse[fin].abs().max().item() if fin.any() else 1), f"LSE error {lerr}"
    return err


def bad_calls(state, key: str) -> list:
    """Every malformed call must raise, with a message naming what was expected and what came."""
    comm: DcpAllToAll = state[key]
    dev, H, D, hn = comm.device, comm.num_heads, comm.head_dim, comm.heads_per_rank
    po = torch.randn(2, H, D).to(comm.dtype).to(dev)
    pl = torch.randn(2, H, device=dev)
    other = torch.float16 if comm.dtype == torch.bfloat16 else torch.bfloat16
    cases = {
        "ndim": lambda: comm.lse_reduce(po[0], pl),
        "heads": lambda: comm.lse_reduce(po[:, :-1], pl[:, :-1]),
        "head_dim": lambda: comm.lse_reduce(torch.randn(2, H, D + 8).to(comm.dtype).to(dev), pl),
        "dtype": lambda: comm.lse_reduce(po.to(other), pl),
        "lse_dtype": lambda: comm.lse_reduce(po, pl.double()),
        "lse_shape": lambda: comm.lse_reduce(po, pl[:1]),
        "out_shape": lambda: comm.lse_reduce(po, pl, out=torch.empty(2, hn + 1, D, dtype=comm.dtype, device=dev)),
        "out_dtype": lambda: comm.lse_reduce(po, pl, out=torch.empty(2, hn, D, dtype=other, device=dev)),
        "last_dim_stride": lambda: comm.lse_reduce(
            torch.randn(2, D, H).to(comm.dtype).to(dev).transpose(1, 2), pl),
        "channel": lambda: comm.lse_reduce(po, pl, channel=comm.channels),
        "not_tensor": lambda: comm.lse_reduce(po.tolist(), pl),
    }
    if dev.type == "cpu":
        cases["device"] = lambda: comm.lse_reduce(po.to("meta"), pl)
    else:
        cases["device"] = lambda: comm.lse_reduce(po.cpu(), pl.cpu())
    messages = []
    for name, call in cases.items():
        try:
            call()
        except (ValueError, TypeError, DcpError) as exc:
            assert "expected" in str(exc), f"{name}: message does not say what was expected: {exc}"
            messages.append(f"{name}: {exc}")
        else:
            raise AssertionError(f"{name}: malformed call was accepted")
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
    return sorted(glob.glob("/dev/shm/dcp-a2a-*"))


def rank_pid(state) -> int:
    return os.getpid()
