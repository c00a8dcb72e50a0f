"""The plugin inside a real vLLM, where one can be imported (vLLM is not a dependency).

vLLM 0.33.0's Python code imports without its compiled ops on a CPU-only machine, given its
pure-Python dependencies; then ``PYTHONPATH=<unpacked wheel> python -m pytest tests/test_vllm_real.py``
(CI's ``.ci/users_stack`` does so, with ``DCP_EXPECT_VLLM=1``: there a missing vLLM fails, not skips)."""

import importlib.util
import os

import pytest
import torch

from tests import rank_cases as rc
from tests import vllm_cases as vc
from tests.conftest import fresh_seed

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None and os.environ.get("DCP_EXPECT_VLLM") != "1",
                                reason="no vLLM importable here")


@pytest.mark.parametrize("n", [2, 3])  # 3: a DCP size no other fast path serves
def test_plugin_in_a_real_vllm(worlds, n):
    res = worlds(n).run(vc.real_vllm_layer, fresh_seed())
    for r in res:
        assert r["ours"] and r["exact"] and r["storage_ok"], r
        assert r["err"] <= rc.TOL[torch.bfloat16], r
    assert any("MLADCPManager patched" in line for line in res[0]["log"]), res[0]["log"]
    assert not any("vLLM's own serves" in line for r in res for line in r["log"]), res  # none went to vLLM's
    for r in res:  # its combines (one, then two steps of two) and query gather ran here, none on vLLM's own
        assert r["calls"] == {"ours: combine": 5, "ours: query gather": 1}, r["calls"]
    print(f"real vLLM at {res[0]['vllm']}: combine errors {[round(r['err'], 4) for r in res]}; calls {res[0]['calls']}")
