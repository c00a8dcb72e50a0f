"""vLLM's two DCP collectives on this package: drop-ins for its combine and its query gather.

``dcp_a2a_lse_reduce`` takes every form vLLM's call sites use (``dcp.py`` and the older
``dcp_alltoall.py`` lineage); ``query_gather`` is the ``all_gather(q, dim=1)`` of a layer. Both run
on one cached ``DcpAllToAll`` per geometry, built collectively by ``communicator`` (the serving
layer's, ``dcp.serving``; the plugin, ``dcp.vllm_plugin``, builds it when vLLM builds its DCP
managers, before graph capture). ``close_all`` closes them.
"""

import inspect
import logging
import sys
from typing import Any, Callable, Optional

import torch

from dcp import serving
from dcp.comm import DcpAllToAll
from dcp.errors import DcpError
from dcp.config import DEFAULT_MAX_TOKENS, max_tokens_for, max_tokens_from_env  # noqa: F401 (its names before)
from dcp.serving import capturing, close_all, communicator, group_parts  # noqa: F401 (the drop-ins' names)

log = logging.getLogger("dcp")
warmup = communicator  # the name earlier releases documented


def forward_step() -> object:
    """The model step a call runs in: vLLM's current forward context (None outside one, or where
    vLLM has none). A step's layers pass the same batch metadata, unchanged, and each step sets a
    context of its own (a graph capture, a drafter's step, a micro-batch too), so the communicator
    searches the metadata once per step (``DcpAllToAll.lse_reduce``'s ``step``)."""
    module = sys.modules.get("vllm.forward_context")
    available = getattr(module, "is_forward_context_available", None)
    if available is None or not available():
        return None
    return module.get_forward_context()


def _cached(group, num_heads, head_dim, dtype, device, query: Optional[tuple] = None) -> DcpAllToAll:
    """The communicator of a call: one that serves its geometry (any query geometry for a combine)."""
    comm = serving.built(group, num_heads, head_dim, dtype, device, query)
    if comm is not None:
        return comm
    if serving.capturing(device):
        raise DcpError("dcp.vllm: no communicator for this geometry yet, and the stream is capturing a CUDA "
                       "graph: call dcp.vllm.communicator(...) on every rank before capture")
    if query is None:
        return communicator(group, num_heads, head_dim, dtype, device)
    # A gather alone: the smallest combine rows beside it (the buffers fit the wider rows).
    return communicator(group, num_heads, 8, torch.bfloat16, device, query_dim=query[0], query_dtype=query[1])


def _note_ignored(names) -> None:
    new = sorted(name for name in names if serving.first_time("vllm", ("ignored", name)))
    if new:
        log.info("dcp.vllm.dcp_a2a_lse_reduce: ignoring keyword(s) %s (not needed by this backend)", ", ".join(new))


def dcp_a2a_lse_reduce(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group: Any = None,
                       ctx: Any = None, return_lse: bool = False, is_lse_base_on_e: bool = True,
                       seq_lens: Optional[torch.Tensor] = None, query_start_loc: Optional[torch.Tensor] = None,
                       *, kvp_group: Any = None, head_major: bool = False, **unknown):
    """vLLM's combine: ``[B, H, D]`` partial outputs and ``[B, H]`` LSEs of every rank in, this
    rank's ``[B, H/N, D]`` out (and its fp32 ``[B, H/N]`` LSE with ``return_lse``).

    ``seq_lens`` / ``query_start_loc`` mask rows as vLLM does (padding, empty local shards), on
    the device, searched once per model step (``forward_step``). A group of one returns the
    inputs, as vLLM does. ``head_major``: the output's storage is ``[H/N, B, D]`` (returned as its
    ``[B, H/N, D]`` view). ``ctx`` and unknown keywords (other lineages' options) are ignored, the
    latter logged once.
    """
    if isinstance(seq_lens, bool) and (query_start_loc is None or type(query_start_loc) is int):
        # The older lineage's 7th and 8th positions (use_b12x, b12x_max_batch_size), never metadata.
        unknown = dict(unknown, use_b12x=seq_lens, b12x_max_batch_size=query_start_loc)
        seq_lens = query_start_loc = None
    if unknown:
        _note_ignored(unknown)
    if cp_group is None:
        cp_group = kvp_group
    if cp_group is None:
        raise TypeError("dcp_a2a_lse_reduce: missing the group (cp_group or kvp_group)")
    group, world = group_parts(cp_group)
    if world == 1:
        return (cp_attn_out, cp_attn_lse) if return_lse else cp_attn_out
    if not isinstance(cp_attn_out, torch.Tensor) or cp_attn_out.dim() != 3:
        raise ValueError("cp_attn_out: expected a [B, H, D] tensor")
    B, H, D = cp_attn_out.shape
    if H % world:
        raise ValueError(f"H={H} must be divisible by DCP world size {world}.")
    comm = _cached(group, H, D, cp_attn_out.dtype, cp_attn_out.device)
    out = None
    if head_major:
        out = torch.empty((H // world, B, D), dtype=cp_attn_out.dtype, device=cp_attn_out.device).transpose(0, 1)
    return comm.lse_reduce(cp_attn_out, cp_attn_lse, return_lse=return_lse, is_lse_base_on_e=is_lse_base_on_e,
                           out=out, seq_lens=seq_lens, query_start_loc=query_start_loc,
                           step=None if seq_lens is None else forward_step())


def head_padded(q: torch.Tensor, num_heads: int, padded_num_heads: Optional[int]) -> Optional[torch.Tensor]:
    """The gather's output as vLLM reserves it for fixed-head decode kernels: a contiguous
    ``[B, H, Dq]`` tensor in storage of ``[B, padded_num_heads, Dq]`` (None: no padding asked)."""
    if padded_num_heads is None:
        return None
    if padded_num_heads < num_heads:
        raise ValueError(f"padded_num_heads {padded_num_heads} < {num_heads} heads")
    B, _, dq = q.shape
    storage = torch.empty(B * padded_num_heads * dq, dtype=q.dtype, device=q.device)
    return storage[:B * num_heads * dq].view(B, num_heads, dq)


def query_gather(q: torch.Tensor, cp_group: Any, padded_num_heads: Optional[int] = None) -> torch.Tensor:
    """vLLM's query all-gather along heads: ``[B, H/N, Dq]`` -> ``[B, H, Dq]``, with
    ``padded_num_heads`` in storage reserved for that many heads, as vLLM does. A group of one
    returns ``q``."""
    group, world = group_parts(cp_group)
    if world == 1:
        return q
    B, hn, dq = q.shape
    comm = _cached(group, hn * world, None, None, q.device, (dq, q.dtype))
    return comm.all_gather_heads(q, head_padded(q, hn * world, padded_num_heads))


def fallback_combine(original: Callable) -> Callable:
    """``dcp_a2a_lse_reduce`` where this package serves the call's geometry, else ``original``
    (vLLM's own, called exactly as it was). Positions past the sixth, which lineages name
    differently (``seq_lens`` here, ``use_b12x`` in ``dcp_alltoall.py``), pass by ``original``'s names."""
    try:
        names = list(inspect.signature(original).parameters)[2:]
    except (TypeError, ValueError):  # not introspectable: positions pass as they come
        names = []

    def combine(cp_attn_out, cp_attn_lse, *args, **kwargs):
        if len(args) > 4 and len(names) >= len(args):
            kwargs.update(zip(names, args))
            args = ()
        group = args[0] if args else kwargs.get("cp_group", kwargs.get("kvp_group"))
        pg, world = group_parts(group) if group is not None else (None, 0)
        if world == 1:
            return dcp_a2a_lse_reduce(cp_attn_out, cp_attn_lse, *args, **kwargs)
        if world and isinstance(cp_attn_out, torch.Tensor) and cp_attn_out.dim() == 3:
            _, H, D = cp_attn_out.shape
            # (the dictionary lookup first: the capture query costs more, on every eager call)
            if serving.built(pg, H, D, cp_attn_out.dtype, cp_attn_out.device) is not None:
                return dcp_a2a_lse_reduce(cp_attn_out, cp_attn_lse, *args, **kwargs)
            # Built now, or declined alike on every rank: its geometry or device, a construction that
            # failed, capture (where nothing may be built). Then vLLM's own serves it (logged once).
            comm, why = serving.serve(pg, H, D, cp_attn_out.dtype, cp_attn_out.device, engine="vLLM")
            if comm is not None:
                return dcp_a2a_lse_reduce(cp_attn_out, cp_attn_lse, *args, **kwargs)
            _note_declined(cp_attn_out, why)
        return original(cp_attn_out, cp_attn_lse, *args, **kwargs)

    combine.__wrapped__ = original
    combine.__name__ = combine.__qualname__ = "dcp_a2a_lse_reduce"
    return combine


def _note_declined(t: torch.Tensor, why: str) -> None:
    if serving.first_time("vllm", ("declined", tuple(t.shape[1:]), t.dtype, why)):
        hint = " (build one with dcp.vllm.communicator(...) before capture)" if why == serving.IN_CAPTURE else ""
        log.warning("dcp.vllm: vLLM's own serves a combine of %s %s: %s%s", t.dtype, list(t.shape[1:]), why, hint)
