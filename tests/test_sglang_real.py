"""The SGLang plugin inside a real SGLang 0.5.23, where one can be imported (SGLang is not a dependency).

SGLang's Python code imports without its compiled kernels on a CPU-only machine, given its
pure-Python dependencies; then ``PYTHONPATH=<unpacked wheel> python -m pytest tests/test_sglang_real.py``
(CI's ``.ci/users_stack`` does so, with ``DCP_EXPECT_SGLANG=1``: there a missing SGLang fails, not skips).
Each rank process imports SGLang once (tens of seconds on 2 cores), hence the long timeouts."""

import importlib.util
import os

import pytest
import torch

from dcp.spawn import World
from tests import rank_cases as rc
from tests import sglang_cases as sc
from tests.conftest import fresh_seed

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None
                                and os.environ.get("DCP_EXPECT_SGLANG") != "1", reason="no SGLang importable here")



@pytest.fixture(scope="module")
def worlds():
    """conftest's rank worlds, their processes started with ``TRITON_INTERPRET=1`` in their
    environment (Triton reads it where it decorates its own library, on import: before ``World``'s
    ``env`` is applied): SGLang's own Triton kernels, its fallback path, then run on CPU tensors.
    Ours run interpreted on the CPU either way."""
    made: dict = {}

    def get(n: int) -> World:
        if n not in made:
            before = os.environ.get("TRITON_INTERPRET")
            os.environ["TRITON_INTERPRET"] = "1"
            try:
                made[n] = World(n, "cpu")
            finally:
                if before is None:
                    os.environ.pop("TRITON_INTERPRET")
                else:
                    os.environ["TRITON_INTERPRET"] = before
        return made[n]

    yield get
    for w in made.values():
        w.close()
    assert rc.shm_segments() == [], f"shared-memory segments left behind: {rc.shm_segments()}"


@pytest.mark.parametrize("n", [2, 3])  # 3: a DCP size no other fast path serves
def test_plugin_in_a_real_sglang(worlds, n):
    """SGLang's MLA decode (its query gather function, ``forward_absorb_core`` with a stand-in
    attention) under each --dcp-comm-backend, LSEs in base e and base 2: both collectives ran
    here and none of SGLang's transports did; results against the float64 reference."""
    w = worlds(n)
    for backend in ("a2a", "ag_rs", "fi_a2a"):
        res = w.run(sc.real_sglang_layer, fresh_seed(), backend, timeout=600)
        calls = res[0]["calls"]
        theirs = {k: v for k, v in calls.items() if not k.startswith("ours")}
        assert theirs == {}, f"SGLang's own transports ran under {backend}: {theirs}"
        assert calls.get("ours: combine") == 2 and calls.get("ours: query gather") == 2, (backend, calls)
        assert all(r["calls"] == calls for r in res), [r["calls"] for r in res]
        for r in res:
            for base_e, one in r["results"].items():
                assert one["exact"], (backend, base_e, "query gather not bit-exact")
                assert one["err"] <= rc.TOL[torch.bfloat16], (backend, base_e, one["err"])
            # (the stand-in runner: 4 captured requests x 2 tokens; H = 2 heads per rank, D 32, Dq 48)
            assert r["built"] == [(8, 2 * n, sc.NOPE, sc.NOPE + sc.ROPE)], r["built"]
        log = res[0]["log"]
        assert any("hooked in sglang.srt.layers.dcp.comm" in line for line in log), log
        assert any(f"--dcp-comm-backend {backend}" in line and "on dcp-a2a" in line for line in log), log
        print(f"real SGLang at {res[0]['sglang']}, {backend}: combine errors "
              f"{[round(o['err'], 4) for r in res for o in r['results'].values()]}; calls {calls}")
    w.run(sc.close)


def test_model_runner_builds_before_capture(worlds):
    """SGLang's ModelRunner, imported after the plugins loaded, is wrapped by the import hook."""
    assert all(worlds(2).run(sc.runner_is_hooked, timeout=600))


def test_a_geometry_first_seen_in_capture_goes_to_sglangs_own(worlds):
    """No communicator for a geometry and the stream capturing: SGLang's own a2a serves the call
    (its result checked too), nothing is built, and the log says why."""
    res = worlds(2).run(sc.first_seen_in_capture, fresh_seed(), timeout=600)
    for r in res:
        assert r["res"]["exact"] and r["res"]["err"] <= rc.TOL[torch.bfloat16], r["res"]
        assert r["built"] == 0, r
        assert r["calls"] == {"SGLang: all_gather_q_for_mla_decode": 1, "SGLang: GroupCoordinator.all_gather": 1,
                              "SGLang: dcp_a2a_lse_reduce": 1, "SGLang: GroupCoordinator.all_to_all_single": 1,
                              "SGLang: GroupCoordinator._all_to_all_single": 1}, r["calls"]
        assert any("reached CUDA-graph capture" in line for line in r["log"]), r["log"]
    worlds(2).run(sc.close)
