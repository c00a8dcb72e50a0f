"""The float64 reference of docs/design.md, section 1, and inputs for every rank drawn from one seed."""

import torch

NEG_INF = float("-inf")


def lse_combine_reference(outs: list, lses: list, base_e: bool = True):
    """outs: per rank [B, H, D]; lses: per rank [B, H]. Returns float64 (out [B, H, D], lse [B, H])."""
    O = torch.stack([o.double() for o in outs])
    L = torch.stack([l.double() for l in lses])
    L = torch.where(torch.isnan(L) | (L == float("inf")), torch.full_like(L, NEG_INF), L)
    m = L.max(0).values
    m = torch.where(m == NEG_INF, torch.zeros_like(m), m)
    w = torch.exp(L - m) if base_e else torch.exp2(L - m)
    s = w.sum(0)
    contrib = torch.where(w[..., None] > 0, w[..., None] * O, torch.zeros_like(O)).sum(0)
    out = torch.where(s[..., None] > 0, contrib / s[..., None], torch.zeros_like(contrib))
    glse = (torch.log(s) if base_e else torch.log2(s)) + m
    glse = torch.where(s > 0, glse, torch.full_like(s, NEG_INF))
    return out, glse


def chunk_reference(outs: list, lses: list, rank: int, heads_per_rank: int, base_e: bool = True):
    """The float64 reference of head chunk ``rank``: what that rank's call must return."""
    mine = slice(rank * heads_per_rank, (rank + 1) * heads_per_rank)
    return lse_combine_reference([o[:, mine] for o in outs], [l[:, mine] for l in lses], base_e)


def max_rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| / (1 + |ref|), with ``y`` read as float64 on the CPU (0 for no elements)."""
    if y.numel() == 0 and ref.numel() == 0:
        return 0.0
    return ((y.double().cpu() - ref).abs() / (1 + ref.abs())).max().item()


def make_inputs(seed: int, world: int, B: int, H: int, D: int, dtype, lse_dtype=torch.float32,
                special: bool = False):
    """Inputs of every rank, identical in every process that draws them with the same seed.

    With ``special``: empty-shard rows (NaN outputs, -inf LSE), NaN and +inf LSEs (read as -inf)
    and rows where every rank is empty.
    """
    g = torch.Generator().manual_seed(seed)
    outs = [torch.randn(B, H, D, generator=g).to(dtype) for _ in range(world)]
    lses = [(torch.randn(B, H, generator=g) * 4).to(lse_dtype) for _ in range(world)]
    if special and B > 0:
        for r in range(world):
            pick = torch.rand(B, H, generator=g)
            empty = pick < 0.2
            lses[r][empty] = NEG_INF
            outs[r][empty] = float("nan")
            lses[r][(pick >= 0.2) & (pick < 0.25)] = float("nan")
            lses[r][(pick >= 0.25) & (pick < 0.3)] = float("inf")
            outs[r][(pick >= 0.25) & (pick < 0.3)] = float("inf")
        for r in range(world):  # token 0, head 0: every rank empty
            lses[r][0, 0] = NEG_INF
            outs[r][0, 0] = float("nan")
    return outs, lses


def make_queries(seed: int, world: int, B: int, heads_per_rank: int, query_dim: int, dtype) -> list:
    """Every rank's [B, H/N, Dq] queries from one seed, as random bit patterns of ``dtype`` (NaN and
    inf payloads included: a gather copies bits, it never computes)."""
    g = torch.Generator().manual_seed(seed)
    nbytes = heads_per_rank * query_dim * dtype.itemsize
    return [torch.randint(0, 256, (B, nbytes), dtype=torch.uint8, generator=g).view(dtype)
            .view(B, heads_per_rank, query_dim) for _ in range(world)]


def mask_by_metadata(lse: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """A rank's ``[B, H]`` LSEs as vLLM's batch metadata leaves them (float64): -inf on tokens past
    ``query_start_loc[-1]`` and on tokens of a sequence whose local ``seq_lens`` entry is 0."""
    out = lse.double().clone()
    bounds, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b in range(out.shape[0]):
        seq = min(sum(1 for q in bounds[1:] if q <= b), len(lens) - 1)
        if b >= bounds[-1] or seq < 0 or lens[seq] == 0:
            out[b] = NEG_INF
    return out


def decode_metadata(seed: int, world: int, B: int) -> tuple:
    """vLLM's batch metadata of a decode batch of B tokens, alike in every process drawing it with
    one seed: ``query_start_loc`` [S + 1] int32 of S sequences, three in four of one query token and
    the rest of 2 to 4 (speculative decode; where B >= 3 the first has 2, so that a token's index is
    not its sequence's), the last ``B // 8`` tokens graph padding; every rank's local ``seq_lens``
    [S] int32, about a quarter 0, rank r's sequence r empty for r < S, no sequence empty on every
    rank and, where S > 1, no rank empty on every sequence: a call that ignores or misreads the
    metadata differs from the reference, whatever the seed."""
    g = torch.Generator().manual_seed(seed)
    real = B - B // 8
    sizes = [2] if real >= 3 else []
    while sum(sizes) < real:
        draw = torch.randint(0, 12, (), generator=g).item()
        sizes.append(min(real - sum(sizes), 1 if draw < 9 else draw - 7))
    qsl = torch.tensor([0] + sizes).cumsum(0).to(torch.int32)
    lens = torch.randint(0, 4, (world, len(sizes)), generator=g, dtype=torch.int32)
    for r in range(min(world, len(sizes))):
        lens[r, r] = 0
    lone = (lens == 0).all(0)
    lens[(torch.arange(len(sizes)) + 1) % world, torch.arange(len(sizes))] += lone.to(torch.int32)
    if len(sizes) > 1:
        idle = (lens == 0).all(1)
        lens[torch.arange(world), (torch.arange(world) + 1) % len(sizes)] += idle.to(torch.int32)
    return list(lens), qsl
