"""A drop-in for vLLM's ``dcp_a2a_lse_reduce``, backed by one cached ``DcpAllToAll`` per geometry.

Wiring (see the README): replace vLLM's function of that name with this one, and call ``warmup``
for each attention geometry before CUDA graph capture. vLLM is not a dependency.
"""

import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from dcp.comm import DcpAllToAll
from dcp.errors import DcpError

DEFAULT_MAX_TOKENS = 256
_comms: dict = {}


def max_tokens_from_env() -> int:
    """``DCP_A2A_MAX_TOKENS`` (default 256): tokens the persistent buffers hold per launch."""
    return int(os.environ.get("DCP_A2A_MAX_TOKENS", DEFAULT_MAX_TOKENS))


def _process_group(cp_group: Any) -> dist.ProcessGroup:
    """A ProcessGroup, or a vLLM-style GroupCoordinator (``device_group``, ``world_size``, ``rank_in_group``)."""
    if isinstance(cp_group, dist.ProcessGroup):
        return cp_group
    group = getattr(cp_group, "device_group", None)
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError("cp_group: expected a torch.distributed ProcessGroup or a group coordinator with "
                        f"a device_group, got {type(cp_group).__name__}")
    if getattr(cp_group, "world_size", dist.get_world_size(group)) != dist.get_world_size(group):
        raise ValueError("cp_group: world_size disagrees with its device_group's size")
    return group


def _key(group, num_heads, head_dim, dtype, device) -> tuple:
    return (id(group), num_heads, head_dim, dtype, torch.device(device))


def warmup(cp_group: Any, num_heads: int, head_dim: int, dtype: torch.dtype,
           device: Optional[torch.device] = None, max_tokens: Optional[int] = None) -> DcpAllToAll:
    """Collective: build (or return) the communicator of this geometry, kernels loaded, before capture."""
    group = _process_group(cp_group)
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    key = _key(group, num_heads, head_dim, dtype, device)
    if key not in _comms:
        comm = DcpAllToAll(group, max_tokens=max_tokens or max_tokens_from_env(), num_heads=num_heads,
                           head_dim=head_dim, dtype=dtype, device=device)
        _comms[key] = (group, comm)
    return _comms[key][1]


def dcp_a2a_lse_reduce(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group: Any,
                       ctx: Any = None, return_lse: bool = False, is_lse_base_on_e: bool = True):
    """vLLM's signature: ``[B, H, D]`` partial outputs and ``[B, H]`` LSEs of every rank in, this
    rank's ``[B, H/N, D]`` combined output out (and ``[B, H/N]`` LSE with ``return_lse``).

    ``ctx`` is accepted for compatibility and unused: the communicator keeps its own state.
    """
    group = _process_group(cp_group)
    if not isinstance(cp_attn_out, torch.Tensor) or cp_attn_out.dim() != 3:
        raise ValueError("cp_attn_out: expected a [B, H, D] tensor")
    _, H, D = cp_attn_out.shape
    key = _key(group, H, D, cp_attn_out.dtype, cp_attn_out.device)
    if key not in _comms:
        if cp_attn_out.is_cuda and torch.cuda.is_current_stream_capturing():
            raise DcpError("dcp_a2a_lse_reduce: no communicator for this geometry yet, and the stream is "
                           "capturing a CUDA graph; call dcp.vllm.warmup(cp_group, num_heads, head_dim, "
                           "dtype) on every rank before capture")
        warmup(group, H, D, cp_attn_out.dtype, cp_attn_out.device)
    return _comms[key][1].lse_reduce(cp_attn_out, cp_attn_lse, return_lse=return_lse,
                                     is_lse_base_on_e=is_lse_base_on_e)


def close_all() -> None:
    """Collective: close every cached communicator (drop captured graphs first)."""
    while _comms:
        _, (_, comm) = _comms.popitem()
        comm.close()
