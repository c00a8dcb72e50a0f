"""vLLM's own DCP combine, written plainly (gather everything, combine in fp32): what its
transports compute, the batch-metadata mask included."""

import torch
import torch.distributed as dist


def mask_empty_rows(lse: torch.Tensor, seq_lens, query_start_loc) -> torch.Tensor:
    if (seq_lens is None) != (query_start_loc is None):
        raise ValueError("seq_lens and query_start_loc must be provided together")
    if seq_lens is None:
        return lse
    if seq_lens.ndim != 1 or query_start_loc.ndim != 1 or len(query_start_loc) != len(seq_lens) + 1:
        raise ValueError("query_start_loc must contain one boundary per sequence")
    rows = torch.arange(lse.shape[0], device=lse.device)
    seq = torch.searchsorted(query_start_loc[1:].long(), rows, right=True).clamp(max=len(seq_lens) - 1)
    empty = rows >= query_start_loc[-1]
    if len(seq_lens):
        empty |= seq_lens.long()[seq.clamp(min=0)] == 0
    else:
        empty |= True
    return lse.float().masked_fill(empty[:, None], float("-inf"))


def gathered_combine(out: torch.Tensor, lse: torch.Tensor, group, return_lse: bool, base_e: bool,
                     seq_lens=None, query_start_loc=None):
    n, rank = group.world_size, group.rank_in_group
    if n == 1:
        return (out, lse) if return_lse else out
    B, H, D = out.shape
    if H % n:
        raise ValueError(f"H={H} must be divisible by DCP world size {n}.")
    lse = mask_empty_rows(lse, seq_lens, query_start_loc)
    outs = [torch.empty_like(out) for _ in range(n)]
    lses = [torch.empty_like(lse) for _ in range(n)]
    dist.all_gather(outs, out.contiguous(), group=group.device_group)
    dist.all_gather(lses, lse.contiguous(), group=group.device_group)
    mine = slice(rank * H // n, (rank + 1) * H // n)
    L = torch.stack([x[:, mine] for x in lses]).float()
    L = torch.where(torch.isnan(L) | (L == float("inf")), float("-inf"), L)
    m = L.max(0).values
    m = torch.where(m == float("-inf"), 0.0, m)
    w = torch.exp(L - m) if base_e else torch.exp2(L - m)
    s = w.sum(0)
    w = torch.where(s > 0, w / s, 0.0)
    O = torch.stack([x[:, mine] for x in outs]).float()
    y = torch.where(w[..., None] > 0, w[..., None] * O, 0.0).sum(0).to(out.dtype)
    if not return_lse:
        return y
    glse = torch.where(s > 0, (torch.log(s) if base_e else torch.log2(s)) + m, float("-inf"))
    return y, glse
