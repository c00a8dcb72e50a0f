"""An MLA layer's DCP half, as 0.33.0 wires it: the manager (imported by name) built with the
layer, then ``query_gather(q)`` before attention and ``combine(out, lse, seq_lens=...,
query_start_loc=...)`` after."""

from vllm.v1.attention.ops.dcp import MLADCPManager


class MLAAttention:
    def __init__(self, vllm_config, device, num_local_heads, kv_lora_rank, qk_rope_head_dim, model_dtype,
                 query_dtype, padded_num_heads=None, use_pcp=False):
        self.dcp_manager = MLADCPManager(vllm_config, device, num_local_heads, kv_lora_rank + qk_rope_head_dim,
                                         kv_lora_rank, query_dtype, model_dtype, padded_num_heads, True, use_pcp)

    def dcp_decode(self, q_local, partial_out, partial_lse, seq_lens, query_start_loc):
        q = self.dcp_manager.query_gather(q_local)
        out = self.dcp_manager.combine(partial_out, partial_lse, seq_lens=seq_lens, query_start_loc=query_start_loc)
        return q, out
