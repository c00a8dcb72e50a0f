"""A stand-in for vLLM (tests only): the module paths of vLLM 0.33.0 and of the older
``dcp_alltoall.py`` lineage, with just the behaviour this package's plugin meets there.

``STANDIN_VLLM_LINEAGE`` picks which lineage imports: ``current`` (``vllm.v1.attention.ops.dcp``,
the default) or ``legacy`` (``vllm.v1.attention.ops.dcp_alltoall``). ``CALLS`` counts every call
into vLLM's own DCP transports, so a test can assert that none ran.
"""

import collections
import os

CALLS: collections.Counter = collections.Counter()


def lineage() -> str:
    return os.environ.get("STANDIN_VLLM_LINEAGE", "current")
