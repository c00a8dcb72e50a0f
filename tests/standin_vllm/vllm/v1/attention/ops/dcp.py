"""vLLM 0.33.0's DCP module as the plugin meets it: ``MLADCPManager`` choosing its combine and
query gather once, in ``__init__``, the direct symmetric-memory workspace first (on one node it
wins), and the packed and AG+RS combines as module globals."""

import functools

import torch

from vllm import CALLS, lineage
from vllm.distributed.parallel_state import get_dcp_group
from vllm.v1.attention.ops.common import gathered_combine

if lineage() != "current":
    raise ImportError("this stand-in vLLM is of the dcp_alltoall.py lineage")


def dcp_a2a_lse_reduce(cp_attn_out, cp_attn_lse, cp_group, ctx=None, return_lse=False, is_lse_base_on_e=True,
                       seq_lens=None, query_start_loc=None):
    CALLS["dcp_a2a_lse_reduce"] += 1
    return gathered_combine(cp_attn_out, cp_attn_lse, cp_group, return_lse, is_lse_base_on_e, seq_lens,
                            query_start_loc)


def cp_lse_ag_out_rs(cp_attn_out, cp_attn_lse, cp_group, ctx=None, return_lse=False, is_lse_base_on_e=True,
                     seq_lens=None, query_start_loc=None):
    CALLS["cp_lse_ag_out_rs"] += 1
    return gathered_combine(cp_attn_out, cp_attn_lse, cp_group, return_lse, is_lse_base_on_e, seq_lens,
                            query_start_loc)


class DirectWorkspace:
    def __init__(self, group, max_num_tokens):
        self.group, self.max_num_tokens = group, max_num_tokens

    def lse_reduce(self, out, lse, is_lse_base_on_e, seq_lens, query_start_loc):
        CALLS["direct_workspace.lse_reduce"] += 1
        return gathered_combine(out, lse, self.group, False, is_lse_base_on_e, seq_lens, query_start_loc)


def get_direct_dcp_a2a_workspace(group, device, max_num_tokens, num_heads, head_dim, dtype, num_ubatches):
    CALLS["get_direct_dcp_a2a_workspace"] += 1
    return DirectWorkspace(group, max_num_tokens) if dtype in (torch.float16, torch.bfloat16) else None


def reserve_query_head_storage(query: torch.Tensor, padded_num_heads: int) -> torch.Tensor:
    """vLLM's layout: a contiguous [B, H, D] tensor whose storage has room for padded_num_heads."""
    storage = query.new_empty(query.shape[0] * padded_num_heads * query.shape[2])
    return storage[:query.numel()].view(query.shape).copy_(query)


class MLADCPManager:
    def __init__(self, vllm_config, device, num_heads, query_head_dim, output_head_dim, query_dtype, output_dtype,
                 padded_num_heads, is_lse_base_on_e, use_pcp):
        parallel = vllm_config.parallel_config
        self.group = get_dcp_group()
        self.device = torch.device(device)
        self.num_ubatches = 1
        self.max_num_tokens = vllm_config.max_num_tokens
        self.use_a2a = parallel.dcp_comm_backend == "a2a"
        self.padded_num_heads = padded_num_heads
        self.combine = self._init_combine(num_heads, output_head_dim, output_dtype, is_lse_base_on_e, use_pcp)
        self.query_gather = None if use_pcp else self._init_query_gather(num_heads, query_head_dim, query_dtype)

    def _init_combine(self, num_heads, head_dim, dtype, is_lse_base_on_e, use_pcp):
        ws = None
        if self.use_a2a:
            ws = get_direct_dcp_a2a_workspace(self.group, self.device, self.max_num_tokens, num_heads, head_dim,
                                              dtype, self.num_ubatches)
        if ws is not None:
            return functools.partial(self._direct_workspace_combine, ws, is_lse_base_on_e=is_lse_base_on_e)
        fn = dcp_a2a_lse_reduce if self.use_a2a else cp_lse_ag_out_rs
        return functools.partial(fn, cp_group=self.group, is_lse_base_on_e=is_lse_base_on_e)

    def _direct_workspace_combine(self, ws, partial_output, partial_lse, is_lse_base_on_e, seq_lens=None,
                                  query_start_loc=None):
        if partial_output.shape[0] <= ws.max_num_tokens:
            return ws.lse_reduce(partial_output, partial_lse, is_lse_base_on_e, seq_lens, query_start_loc)
        return dcp_a2a_lse_reduce(partial_output, partial_lse, cp_group=self.group,
                                  is_lse_base_on_e=is_lse_base_on_e, seq_lens=seq_lens,
                                  query_start_loc=query_start_loc)

    def _init_query_gather(self, num_heads, head_dim, dtype):
        CALLS["get_direct_dcp_q_gather_workspace"] += 1  # needs NVLink multicast: none here
        return self._gather_query

    def _gather_query(self, query):
        query = self.group.all_gather(query, dim=1)
        if self.padded_num_heads is not None:
            query = reserve_query_head_storage(query, self.padded_num_heads)
        return query
