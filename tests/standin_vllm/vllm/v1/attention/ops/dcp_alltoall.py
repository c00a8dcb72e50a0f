"""The older lineage's DCP module: ``dcp_a2a_lse_reduce`` imported by name by its callers, which
pass options of their own (``use_b12x`` ...)."""

from vllm import CALLS, lineage
from vllm.v1.attention.ops.common import gathered_combine

if lineage() != "legacy":
    raise ImportError("this stand-in vLLM is of the dcp.py lineage")


def dcp_a2a_lse_reduce(cp_attn_out, cp_attn_lse, cp_group, ctx=None, return_lse=False, is_lse_base_on_e=True,
                       use_b12x=False, b12x_max_batch_size=0, b12x_query_head_dim=0):
    CALLS["dcp_a2a_lse_reduce"] += 1
    return gathered_combine(cp_attn_out, cp_attn_lse, cp_group, return_lse, is_lse_base_on_e)
