"""An importer of the older lineage: binds the combine by name when imported."""

from vllm.v1.attention.ops.dcp_alltoall import dcp_a2a_lse_reduce


def combine_decode(out, lse, group, return_lse=False):
    return dcp_a2a_lse_reduce(out, lse, group, return_lse=return_lse, use_b12x=False, b12x_max_batch_size=64,
                              b12x_query_head_dim=576)
