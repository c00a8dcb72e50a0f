"""A second importer of the older lineage, imported after the plugin ran (in the tests)."""

from vllm.v1.attention.ops.dcp_alltoall import dcp_a2a_lse_reduce  # noqa: F401 (bound by name)
