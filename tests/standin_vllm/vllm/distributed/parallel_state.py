"""vLLM's ``GroupCoordinator`` as the DCP code uses it: ``world_size``, ``rank_in_group``,
``device_group`` and ``all_gather(t, dim)``."""

import torch
import torch.distributed as dist

from vllm import CALLS

_DCP = None


class GroupCoordinator:
    def __init__(self, group: dist.ProcessGroup):
        self.device_group = self.cpu_group = group
        self.world_size = dist.get_world_size(group)
        self.rank_in_group = dist.get_rank(group)

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        CALLS["GroupCoordinator.all_gather"] += 1
        if self.world_size == 1:
            return t
        raw = t.contiguous().view(torch.uint8)  # as bytes: gloo has no fp8
        parts = [torch.empty_like(raw) for _ in range(self.world_size)]
        dist.all_gather(parts, raw, group=self.device_group)
        return torch.cat(parts, dim=dim).view(t.dtype)


def init_dcp_group(group: dist.ProcessGroup) -> None:
    global _DCP
    _DCP = GroupCoordinator(group)


def get_dcp_group() -> GroupCoordinator:
    assert _DCP is not None, "DCP group not initialized"
    return _DCP
