"""Construction's first two steps: the arguments and the environment resolved into one frozen
``Config`` (``resolve``), then agreed by every rank of the group (``agree_config``).

Every ``DCP_A2A_*`` variable is read here, so that what a process's environment can change is in
one place: ``DCP_A2A_BACKEND``, ``DCP_A2A_CHECK``, ``DCP_A2A_TRACE``,
``DCP_A2A_MEASURE``, ``DCP_A2A_FENCE_SCOPE``, ``DCP_A2A_SHM_TAG``, ``DCP_A2A_MAX_TOKENS`` and the
plugins' switches (``DCP_A2A_VLLM``, ``DCP_A2A_SGLANG``).
"""

import numbers
import os
import re
import socket
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist

from dcp.checks import combine_geometry_error, geometry_disagreement, query_geometry_error
from dcp.constants import WIRE_REVISION
from dcp.errors import DcpError
from dcp.rendezvous import agree, all_gather

BACKENDS = ("auto", "triton", "push", "pull", "nccl")  # "push" is another name of "triton"
DEFAULT_TIMEOUT_S = {"cuda": 10.0, "cpu": 120.0}
MAX_TIMEOUT_S = 86400.0
DEFAULT_MAX_TOKENS = 256  # the plugins' buffers, where neither the engine nor the environment says
_INT_ARGS = ("max_tokens", "num_heads", "head_dim", "channels", "query_dim")


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def plugin_enabled(variable: str) -> bool:
    """An engine plugin's switch (``DCP_A2A_VLLM``, ``DCP_A2A_SGLANG``): set and not 0 (spaces ignored)."""
    return os.environ.get(variable, "0").strip() not in ("", "0")


def shm_tag() -> str:
    """``DCP_A2A_SHM_TAG``'s letters, digits and ``_`` (at most 32): names this process tree's segments."""
    return re.sub(r"[^A-Za-z0-9_]", "", os.environ.get("DCP_A2A_SHM_TAG", ""))[:32]


def max_tokens_set() -> bool:
    """Whether ``DCP_A2A_MAX_TOKENS`` is set (it then decides every plugin communicator's size)."""
    return bool(os.environ.get("DCP_A2A_MAX_TOKENS"))


def max_tokens_from_env() -> int:
    """``DCP_A2A_MAX_TOKENS`` (default 256): tokens the persistent buffers hold per launch."""
    value = os.environ.get("DCP_A2A_MAX_TOKENS", "")
    try:
        tokens = int(value) if value else DEFAULT_MAX_TOKENS
    except ValueError:
        tokens = 0
    if tokens < 1:
        raise DcpError(f"DCP_A2A_MAX_TOKENS must be a positive integer; got {value!r}")
    return tokens


def max_tokens_for(framework_sized: Optional[int]) -> int:
    """A plugin communicator's max_tokens: ``DCP_A2A_MAX_TOKENS`` where set, else the tokens the
    engine sized its own DCP buffers or graphs for, else 256: larger calls run in chunks."""
    return max_tokens_from_env() if max_tokens_set() else framework_sized or DEFAULT_MAX_TOKENS


@dataclass(frozen=True)
class Config:
    """A communicator's configuration, resolved from its arguments and the environment; after
    ``agree_config`` the same on every rank (but ``rank`` and ``device``)."""

    rank: int
    world: int
    max_tokens: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    query_dim: int
    query_dtype: torch.dtype
    device: torch.device
    backend: str  # as requested ("push" named "triton")
    channels: int
    timeout_s: float
    max_programs: Optional[int]  # the grid this rank asks for at most (None until agreed: then its default)
    num_warps: Optional[int]
    pdl: bool
    check_calls: bool
    tracing: bool
    measures: bool  # whether auto times its candidates
    gpu_scope: bool = False  # set when agreed: flags and fences at GPU scope (every rank on one GPU)
    ranks_per_device: int = 1  # set when agreed
    programs: int = 1  # set when agreed: the smallest grid of any rank, every rank's grid and tile sizing

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.world

    @property
    def query_words(self) -> int:
        """16-bit words of a query row: the gather moves them raw, bit for bit, whatever the dtype."""
        return self.query_dim * self.query_dtype.itemsize // 2


def resolve(rank: int, world: int, max_tokens, num_heads, head_dim, dtype, device, *, backend, channels, timeout_s,
            max_programs, num_warps, pdl, check, query_dim, query_dtype) -> tuple:
    """``(Config, None)``, or ``(None, why)`` naming the first argument that does not fit (the
    caller agrees on it with the peers before anyone raises)."""
    requested = backend if backend is not None else os.environ.get("DCP_A2A_BACKEND", "auto")
    requested = "triton" if requested == "push" else requested
    missing = [name for name, value in (("num_heads", num_heads), ("head_dim", head_dim)) if value is None]
    if missing:
        return None, f"{' and '.join(missing)} must be given (the geometry every call must match)"
    query_dim = head_dim if query_dim is None else query_dim
    ints = {}
    for name, value in zip(_INT_ARGS, (max_tokens, num_heads, head_dim, channels, query_dim)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            return None, f"{name} must be an integer; got {value!r}"
        ints[name] = int(value)
    max_programs, num_warps = (int(v) if isinstance(v, numbers.Integral) and not isinstance(v, bool) else v
                               for v in (max_programs, num_warps))
    try:
        device = _resolve_device(device)
    except Exception as exc:
        return None, f"device: {device!r} is not a usable device ({exc})"
    if device.type not in ("cuda", "cpu"):
        return None, f"device must be cuda or cpu; got {device}"
    if timeout_s is None:
        timeout_s = DEFAULT_TIMEOUT_S[device.type]
    if (not isinstance(timeout_s, numbers.Real) or isinstance(timeout_s, bool)
            or not 0 < float(timeout_s) <= MAX_TIMEOUT_S):
        return None, f"timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S:.0f}]; got {timeout_s!r}"
    has_pdl = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
    measure = os.environ.get("DCP_A2A_MEASURE", "")
    config = Config(
        rank=rank, world=world, dtype=dtype, query_dtype=query_dtype if query_dtype is not None else dtype,
        device=device, backend=requested, timeout_s=float(timeout_s), max_programs=max_programs,
        num_warps=num_warps, pdl=has_pdl if pdl is None else pdl,
        # CPU calls are synchronous, so checking their status costs nothing.
        check_calls=bool(check) if check is not None else (_flag("DCP_A2A_CHECK") or device.type == "cpu"),
        tracing=_flag("DCP_A2A_TRACE"),
        measures=measure not in ("", "0") if measure else device.type == "cuda", **ints)
    return config, _error(config, has_pdl)


def _resolve_device(device) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.get_device_properties(device)  # raises for a GPU that does not exist
    return device


def _error(c: Config, has_pdl: bool) -> Optional[str]:
    if c.world < 2:
        return f"the group has {c.world} rank(s); a DCP group needs at least 2"
    if c.backend not in BACKENDS:
        return f"backend must be one of {BACKENDS}; got {c.backend!r}"
    error = combine_geometry_error(c.world, c.num_heads, c.head_dim, c.dtype)
    if error:
        return error
    if c.max_tokens <= 0:
        return f"max_tokens must be a positive integer; got {c.max_tokens}"
    error = query_geometry_error(c.query_dim, c.query_dtype)
    if error:
        return error
    if c.channels < 1:
        return f"channels must be a positive integer; got {c.channels}"
    if c.max_programs is not None and (type(c.max_programs) is not int or c.max_programs < 1):
        return f"max_programs must be None or a positive integer; got {c.max_programs!r}"
    if c.num_warps not in (None, 1, 2, 4, 8, 16):
        return f"num_warps must be None or a power of two from 1 to 16; got {c.num_warps!r}"
    if c.pdl not in (False, True):
        return f"pdl must be None, True or False; got {c.pdl!r}"
    if c.pdl and not has_pdl:
        return f"pdl=True needs a GPU of compute capability 9.0 or newer; {c.device} is not one"
    return None


def where(device: torch.device) -> str:
    """``host/GPU uuid`` (or ``host/cpu``): ranks with the same one share a device."""
    if device.type == "cuda":
        return f"{socket.gethostname()}/{torch.cuda.get_device_properties(device).uuid}"
    return f"{socket.gethostname()}/cpu"


@dataclass(frozen=True)
class Group:
    """What construction learned from every rank: each one's host and device index."""

    hosts: tuple
    devices: tuple


def agree_config(group: dist.ProcessGroup, config: Optional[Config], error: Optional[str]) -> tuple:
    """Collective: every rank's verdict on its arguments (a bad one on any rank raises ``DcpError``
    on every rank), the same geometry everywhere, the ranks sharing each device, and the grid
    every rank runs (the smallest asked for: small calls' tiles are sized by it too). Returns the agreed
    ``Config`` and the ``Group``."""
    place = None
    if error is None:
        try:
            place = where(config.device)
        except Exception as exc:  # anything unexpected is reported to every rank too
            error = f"{type(exc).__name__}: {exc}"
    geometry = None if config is None else dict(
        max_tokens=config.max_tokens, num_heads=config.num_heads, head_dim=config.head_dim, dtype=str(config.dtype),
        channels=config.channels, world=config.world, backend=config.backend, num_warps=config.num_warps,
        query_dim=config.query_dim, query_dtype=str(config.query_dtype), DCP_A2A_MEASURE=config.measures,
        wire_revision=WIRE_REVISION)  # (another release of this package on one rank: rows it would misread)
    index = None if config is None else config.device.index
    facts = all_gather(group, (geometry, error, place, index), "DcpAllToAll construction")
    agree(group, error, "DcpAllToAll construction", errors=[f[1] for f in facts])
    if any(f[0] != geometry for f in facts):
        raise DcpError(geometry_disagreement([f[0] for f in facts]))
    ranks_per_device = sum(1 for f in facts if f[2] == place)
    config = replace(config, ranks_per_device=ranks_per_device,
                     gpu_scope=ranks_per_device == config.world and os.environ.get("DCP_A2A_FENCE_SCOPE") != "sys")
    config = replace(config, max_programs=config.max_programs or _default_programs(config))
    programs = min(all_gather(group, config.max_programs, "DcpAllToAll construction"))
    return replace(config, programs=programs), Group(tuple(f[2].split("/")[0] for f in facts),
                                                         tuple(f[3] for f in facts))


def _default_programs(c: Config) -> int:
    if c.device.type == "cpu":
        return 4
    sms = torch.cuda.get_device_properties(c.device).multi_processor_count
    # Every waiting program of every rank and channel on this device must be resident at
    # once. A 16-warp program (calls from 128 tokens) fills an SM's registers on an H200, so:
    # one program per SM, shared out among the ranks and the channels that may run together.
    # (Two 8-warp programs per SM, which their registers allow, timed out at N = 6 on one H200
    # under MPS: ranks' programs cannot be counted on to pack onto the same SMs.)
    return max(1, sms // (c.ranks_per_device * c.channels))
