"""Backend selection, the NCCL reference path and the vLLM drop-in (CPU tier)."""

import pytest
import torch

from tests import rank_cases as rc
from tests.conftest import fresh_seed


@pytest.mark.parametrize("n", [2, 3, 6])
def test_triton_and_nccl_agree(worlds, n):
    w = worlds(n)
    seed = fresh_seed()
    outputs = {}
    for backend in ("triton", "nccl"):
        w.run(rc.make_comm, backend, max_tokens=4, num_heads=2 * n, head_dim=16, backend=backend)
        outputs[backend] = [
            w.run(rc.lse_case, backend, seed + i, return_output=True, **case)
            for i, case in enumerate([dict(B=3, special=True), dict(B=9, base_e=False, strided=True)])]
        w.run(rc.close_comm, backend)
    for per_case_t, per_case_n in zip(outputs["triton"], outputs["nccl"]):
        for (yt, lt), (yn, ln) in zip(per_case_t, per_case_n):
            assert torch.equal(yt, yn)
            assert (lt is None) == (ln is None) and (lt is None or torch.equal(lt, ln))


def test_auto_picks_triton_on_one_host(worlds):
    res = worlds(3).run(rc.auto_backend)
    assert all(r[0] == "triton" for r in res), res


def test_auto_falls_back_together_when_one_rank_setup_fails(worlds):
    res = worlds(3).run(rc.auto_backend, fail_setup_on=1)
    assert all(r[0] == "nccl" and "injected failure" in r[1] for r in res), res


def test_auto_falls_back_together_across_hosts(worlds):
    res = worlds(3).run(rc.auto_backend, other_host_on=2)
    assert all(r[0] == "nccl" and "hosts" in r[1] for r in res), res


def test_env_overrides_the_default(worlds):
    res = worlds(2).run(rc.auto_backend, env_backend="nccl")
    assert all(r == ("nccl", "requested") for r in res), res


def test_the_launch_argument_orders_are_the_kernels():
    """``dcp.launch`` writes each kernel's runtime argument order once; the transports launch in it.
    Checked against the kernels' own signatures (the constexprs follow them); a transport that
    passed another order would read strides as tags."""
    import inspect

    from dcp.kernels import build_kernels
    from dcp.launch import COMBINE_ARGS, FUSED_ARGS, PACK_ARGS

    kernels = build_kernels(True)
    for fn, names in ((kernels.fused, FUSED_ARGS), (kernels.pack, PACK_ARGS), (kernels.combine, COMBINE_ARGS)):
        params = list(inspect.signature(fn.fn).parameters)
        assert params[:len(names)] == list(names)
        assert all(fn.fn.__annotations__.get(p) is not None for p in params[len(names):]), "constexprs follow"


def test_a_bound_launch_passes_what_a_call_passes():
    """``Launcher.bound`` (the floor ``bench.host_time`` times) calls a loaded variant's entry point
    with the very arguments a call would: the stream, the function, the pointers, the scalars, the
    constexprs' placeholders. A fake entry point records both; no variant is loaded: None."""
    import types

    from dcp.kernels import build_kernels
    from dcp.launch import Launcher, pointers

    launcher = Launcher(build_kernels(True).fused, torch.device("cpu"), {}, {"num_warps": 4})
    a, b = torch.randn(3), torch.randn(5)
    assert launcher.bound(("v", True), 4, *pointers(a, b), 7, 8) is None
    seen = []
    launcher.raw_stream = lambda index: 11
    launcher.compiled[("v", True)] = (types.SimpleNamespace(function=22), lambda *args: seen.append(args),
                                      (1, 2, None, None), (33, 44))
    launcher(("v", True), 4, *pointers(a, b), 7, 8)
    launcher.bound(("v", True), 4, *pointers(a, b), 7, 8)()
    assert seen[0] == seen[1] == (4, 1, 1, 11, 22, 1, 2, None, None, a.data_ptr(), b.data_ptr(), 7, 8, 33, 44)


def test_the_entry_point_gets_each_launch_s_own_pointers(worlds):
    """A call passes its addresses as read by its checks (``launch_operands``), and the transport
    those it fixed at construction: every launch's pointer arguments must still be the tensors it
    runs on, a chunk's own included (a stale address would write another call's rows)."""
    w = worlds(2)
    w.run(rc.make_comm, "entry", max_tokens=4, num_heads=4, head_dim=16, backend="triton", query_dim=24)
    try:
        res = w.run(rc.entry_pointers, "entry")
    finally:
        w.run(rc.close_comm, "entry")
    for per_rank in res:
        for got, want in per_rank:
            assert got == want
