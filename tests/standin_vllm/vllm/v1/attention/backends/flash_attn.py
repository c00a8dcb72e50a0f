"""vLLM 0.33.0's FlashAttention backend as the plugin meets it: its impl binds the DCP combine by
name from ``ops.dcp`` once, in ``__init__`` (``dcp_a2a_lse_reduce`` where the user chose a2a), and
calls it in every decode step: with the group positional and ``return_lse``, LSEs in base e."""

import torch

from vllm import lineage
from vllm.distributed.parallel_state import get_dcp_group

if lineage() != "current":
    raise ImportError("this stand-in vLLM is of the dcp_alltoall.py lineage")

from vllm.v1.attention.ops.dcp import cp_lse_ag_out_rs, dcp_a2a_lse_reduce  # noqa: E402


class FlashAttentionImpl:
    def __init__(self, num_heads: int, head_size: int, vllm_config) -> None:
        self.num_heads, self.head_size = num_heads, head_size
        self.dcp_world_size = get_dcp_group().world_size
        dcp_a2a = self.dcp_world_size > 1 and vllm_config.parallel_config.dcp_comm_backend == "a2a"
        self.dcp_combine = dcp_a2a_lse_reduce if dcp_a2a else cp_lse_ag_out_rs
        self._dcp_dtype = torch.get_default_dtype()  # vLLM builds layers under the model's dtype
        self._dcp_max_num_tokens = vllm_config.max_num_tokens

    def context_combine(self, context_out: torch.Tensor, context_lse: torch.Tensor):
        """``context_out`` [B, H * N, D] (the query heads of every DCP rank), ``context_lse``
        [B, H * N]: this rank's heads combined, and their LSE."""
        return self.dcp_combine(context_out, context_lse, get_dcp_group(), return_lse=True)
