"""Collective agreement over the group: every rank learns the same facts and fails together."""

from typing import Any, Optional

import torch.distributed as dist

from dcp.errors import DcpError


def all_gather(group: dist.ProcessGroup, obj: Any) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def agree(group: dist.ProcessGroup, error: Optional[str], what: str) -> None:
    """Raise the same DcpError on every rank if any rank reports an error."""
    errors = all_gather(group, error)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise DcpError(f"{what} failed on {len(failed)} rank(s): {detail}")
