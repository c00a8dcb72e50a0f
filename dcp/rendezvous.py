"""Collective agreement over the group: every rank learns the same facts and fails together.

A peer that dies or leaves makes the group's collectives raise; here that becomes a ``DcpError``
naming the step, so that construction fails with one kind of error whatever went wrong.
"""

from typing import Any, Optional

import torch.distributed as dist

from dcp.errors import DcpError, DcpPeerLostError


def _lost(what: str, exc: Exception) -> DcpError:
    return DcpPeerLostError(f"{what}: a peer failed or left the group ({type(exc).__name__}: {exc})")


def all_gather(group: dist.ProcessGroup, obj: Any, what: str = "a collective setup step") -> list:
    out = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(out, obj, group=group)
    except Exception as exc:
        raise _lost(what, exc) from exc
    return out


def barrier(group: dist.ProcessGroup, what: str) -> None:
    try:
        dist.barrier(group)
    except Exception as exc:
        raise _lost(what, exc) from exc


def agree(group: dist.ProcessGroup, error: Optional[str], what: str, errors: Optional[list] = None) -> None:
    """Raise the same DcpError on every rank if any rank reports an error (``errors``: every rank's,
    if already gathered)."""
    errors = all_gather(group, error, what) if errors is None else errors
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise DcpError(f"{what} failed on {len(failed)} rank(s): {detail}")
