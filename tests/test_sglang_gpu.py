"""GPU tier of the SGLang plugin (no SGLang needed): its two hooks under CUDA-graph capture with a
stand-in of SGLang's DCP group, as SGLang's MLA decode calls them (``tests/sglang_cases.py``)."""

import pytest
import torch

from tests import sglang_cases as sc
from tests.conftest import fresh_seed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("n", [3, 6])
def test_sglang_plugin_in_cuda_graphs_gpu(worlds, n):
    """One graph per batch size (2 layers: gather, attention stand-in, combine in base e then 2),
    replayed in any order on fresh inputs; each captured call allocates only the result it hands
    SGLang (the combine's output, the gathered queries: SGLang's own allocates those too), nothing
    else: no staging, no communicator memory, nothing built."""
    res = worlds(n, "cuda").run(sc.graphed_plugin, fresh_seed(), sizes=[1, 8, 64], layers=2, replays=12,
                                timeout=600)
    for r in res:
        assert r["theirs"] == {}, r["theirs"]
        assert r["allocs"] == [("gather", 1), ("combine", 1)] * 6, r["allocs"]
        assert r["memory_same"] and r["communicators"] == 1, r
    print(f"N={n}: combine errors {[round(r['err'], 4) for r in res]}")
