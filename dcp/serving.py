"""The serving layer under both engine plugins (``dcp.vllm_plugin``, ``dcp.sglang_plugin``) and
vLLM's drop-ins (``dcp.vllm``): one communicator per geometry, built collectively before capture;
the rules that decide whether this package serves a geometry or the engine's own path does; each
verdict said once in the engine's log; wrapping an engine's method once; checking the parameters
of what is wrapped. An engine is not a dependency: a group is a ``torch.distributed`` group or any
object with ``world_size`` and ``device_group`` (vLLM's and SGLang's ``GroupCoordinator``).
"""

import functools
import inspect
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from dcp.checks import combine_geometry_error, query_geometry_error
from dcp.comm import DcpAllToAll
from dcp.config import max_tokens_for
from dcp.errors import DcpError

MARK = "_dcp_a2a_original"  # a wrapped class's attribute: its original methods
IN_CAPTURE = "reached CUDA-graph capture with no communicator built for it (nothing may be built there)"
_comms: dict = {}  # its whole geometry -> (group, communicator): every communicator built here
_by_call: dict = {}  # (group id, kind, heads, row width, dtype, device) -> a communicator serving that call
_failed: dict = {}  # serve's key -> (why its construction failed, the group): not tried again
_said: set = set()


def group_parts(cp_group: Any) -> tuple:
    """(process group or None, world size) of a ProcessGroup or a coordinator-like object."""
    if isinstance(cp_group, dist.ProcessGroup):
        return cp_group, dist.get_world_size(cp_group)
    world = getattr(cp_group, "world_size", None)
    group = getattr(cp_group, "device_group", None)
    if isinstance(world, int) and world == 1:
        return group, 1
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError("cp_group: expected a torch.distributed ProcessGroup or a group coordinator with a "
                        f"device_group, got {type(cp_group).__name__}")
    size = dist.get_world_size(group)
    if world is not None and world != size:
        raise ValueError(f"cp_group: world_size {world} disagrees with its device_group's size {size}")
    return group, size


def capturing(device: torch.device) -> bool:
    """Whether this device's current stream is capturing a CUDA graph (nothing may be built then)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def communicator(cp_group: Any, num_heads: int, head_dim: int, dtype: torch.dtype,
                 device: Optional[Union[torch.device, str]] = None, *, query_dim: Optional[int] = None,
                 query_dtype: Optional[torch.dtype] = None, max_tokens: Optional[int] = None) -> DcpAllToAll:
    """Collective: the communicator of this geometry (``num_heads`` in all), built once, kernels
    loaded. Call it on every rank before graph capture; later calls return the cached one."""
    group, _ = group_parts(cp_group)
    device = _device(device)
    key = (id(group), num_heads, head_dim, dtype, query_dim or head_dim, query_dtype or dtype, device)
    if key not in _comms:
        comm = DcpAllToAll(group, max_tokens=max_tokens or max_tokens_for(None), num_heads=num_heads,
                           head_dim=head_dim, dtype=dtype, device=device, query_dim=query_dim,
                           query_dtype=query_dtype)
        _comms[key] = (group, comm)  # the group is kept alive with its id in the key
        _by_call.setdefault(_combine_key(group, num_heads, head_dim, dtype, device), comm)
        _by_call.setdefault(_gather_key(group, num_heads, key[4], key[5], device), comm)
    return _comms[key][1]


def _device(device) -> torch.device:
    """A device as the cache keys it (default: the current GPU, else the CPU)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _combine_key(group, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple:
    return (id(group), "combine", num_heads, head_dim, dtype, device)


def _gather_key(group, num_heads: int, query_dim: int, query_dtype: torch.dtype, device: torch.device) -> tuple:
    return (id(group), "gather", num_heads, query_dim, query_dtype, device)


def built(group, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
          query: Optional[tuple] = None) -> Optional[DcpAllToAll]:
    """A communicator built for a call of this geometry (a combine's, or with ``query`` (Dq, dtype)
    a gather's), or None. ``group``: the process group (``group_parts(...)[0]``)."""
    return _by_call.get(_combine_key(group, num_heads, head_dim, dtype, device) if query is None
                        else _gather_key(group, num_heads, *query, device))


def declined(world: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
             query: Optional[tuple] = None, engine: str = "the engine") -> Optional[str]:
    """Why this package does not serve a geometry (None: it does): the same on every rank."""
    if world == 1:
        return "a group of one"
    if device.type not in ("cuda", "cpu"):
        return f"{device.type} tensors ({engine}'s own serves NPU, XPU and other devices)"
    return (query is not None and query_geometry_error(*query)) or combine_geometry_error(world, num_heads, head_dim,
                                                                                          dtype)


def serve(group, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, *,
          query: Optional[tuple] = None, max_tokens: Optional[int] = None, engine: str = "the engine",
          decline_failure: bool = True) -> tuple:
    """Collective: ``(communicator, None)`` for a geometry this package serves (built unless it
    was: a combine takes any communicator of its geometry, a combine with its query gather
    (``query``: (Dq, dtype)) one built for both), or ``(None, why)``: declined (``declined``), first
    seen in capture (every rank captures the same graphs, so every rank declines alike), or, with
    ``decline_failure``, its construction failed (raised alike on every rank: every rank leaves it
    to the engine's own, and is not tried again; else it raises)."""
    device = _device(device)
    pg, world = group_parts(group)  # (the caches key the process group, not a coordinator around it)
    why = declined(world, num_heads, head_dim, dtype, device, query, engine)
    if why:
        return None, why
    key = (id(pg), num_heads, head_dim, dtype, *query, device) if query else None
    comm = _comms[key][1] if key in _comms else None if query else built(pg, num_heads, head_dim, dtype, device)
    if comm is not None:
        return comm, None
    if capturing(device):
        return None, IN_CAPTURE
    failed = (id(pg), num_heads, head_dim, dtype, query, device)
    if decline_failure and failed in _failed:
        return None, _failed[failed][0]
    extra = dict(query_dim=query[0], query_dtype=query[1]) if query else {}
    tokens = max_tokens_for(max_tokens)
    try:
        return communicator(group, num_heads, head_dim, dtype, device, max_tokens=tokens, **extra), None
    except DcpError as exc:
        if not decline_failure:
            raise
        _failed[failed] = (f"construction failed: {exc}", pg)  # (the group kept alive with its id in the key)
        return None, _failed[failed][0]


def first_time(scope: str, key) -> bool:
    """Whether ``key`` (a verdict, a warning) comes up for the first time in ``scope`` (a plugin's
    name): each is logged once, until ``forget(scope)``."""
    if (scope, key) in _said:
        return False
    _said.add((scope, key))
    return True


def forget(scope: str) -> None:
    """Log a scope's verdicts again when they next come up."""
    _said.difference_update([said for said in _said if said[0] == scope])


def parameters(fn: Callable) -> Optional[tuple]:
    """The names of a function's parameters (None: not introspectable)."""
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def missing_parameters(fn: Callable, names) -> list:
    """Those of ``names`` that ``fn`` does not take (all of them where it cannot be introspected)."""
    found = parameters(fn)
    return [n for n in names if found is None or n not in found]


def wrap_once(cls: Any, wrappers: dict) -> str:
    """Replace methods that ``cls`` defines itself (``{name: wrap(original) -> replacement}``), once
    per class, the originals kept under ``MARK``: ``"wrapped"``, ``"already"`` (wrapped before), or
    ``"missing"`` (``cls`` lacks one of them: nothing replaced)."""
    namespace = getattr(cls, "__dict__", {})
    if MARK in namespace:
        return "already"
    originals = {name: namespace.get(name) for name in wrappers}
    if any(fn is None for fn in originals.values()):
        return "missing"
    for name, wrap in wrappers.items():
        setattr(cls, name, functools.update_wrapper(wrap(originals[name]), originals[name]))
    setattr(cls, MARK, originals)
    return "wrapped"


def close_all() -> None:
    """Collective: close every communicator built here (drop captured graphs first)."""
    _by_call.clear()
    _failed.clear()
    while _comms:
        _, (_, comm) = _comms.popitem()
        comm.close()
