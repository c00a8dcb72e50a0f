"""``DcpAllToAll``: the communicator that owns the buffers, validates calls and picks a transport."""

import logging
import numbers
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from dcp.kernels import KIND_COMBINE, KIND_GATHER, MAX_PEERS, TAG_ABORT, TAG_MAX_TOKENS, TAG_POISONED
from dcp import plan as auto_plan
from dcp.backends import FUSED_TRANSPORTS, NcclTransport, TritonTransport
from dcp.checks import (LSE_DTYPES, as_words, combine_geometry_error, expect, gather_operands, geometry_disagreement,
                        launch_operands, metadata, query_geometry_error, refuse_overlap)
from dcp.errors import DcpError, DcpPeerLostError
from dcp.protocol import POISONED_NOTE, ChannelLayout, ChannelRegion, call_tag
from dcp.rendezvous import agree, all_gather, barrier

log = logging.getLogger("dcp")

BACKENDS = ("auto", "triton", "push", "pull", "nccl")  # "push" is another name of "triton"
DEFAULT_TIMEOUT_S = {"cuda": 10.0, "cpu": 120.0}
MAX_TIMEOUT_S = 86400.0
_INT_ARGS = ("max_tokens", "num_heads", "head_dim", "channels", "query_dim")


class DcpAllToAll:
    """The packed DCP all-to-all with LSE combine, and the query all-gather, on persistent buffers.

    Collective: every rank of ``group`` (NCCL or gloo; N = its size, at least 2) constructs it with
    the same arguments; a bad argument on any rank raises ``DcpError`` on every rank. All memory is
    allocated and mapped here, once; calls then allocate nothing but the outputs they return (none
    with ``out=``), so they can be captured in CUDA graphs. Use it as a context manager, or call
    ``close()`` (collective) after dropping captured graphs.

    Geometry (every call must match it):

    - ``num_heads`` (required): H, all heads of the group, a positive multiple of N; rank r owns
      heads ``[r*H/N, (r+1)*H/N)``.
    - ``head_dim`` (required): D of the partial outputs, a positive multiple of 8 up to 1024.
    - ``dtype``: of the partial outputs and the result: ``torch.float16``, ``torch.bfloat16`` or
      ``torch.float32``.
    - ``query_dim`` (default ``head_dim``) and ``query_dtype`` (default ``dtype``): the query
      all-gather's rows; a multiple of 8 up to 1024 (16 for fp8), dtype fp16, bf16, fp32,
      ``float8_e4m3fn`` or ``float8_e5m2``.
    - ``max_tokens`` (default 64): sizes the buffers, not the calls: a call of up to ``max_tokens``
      tokens is one kernel launch; a larger one runs in chunks of ``max_tokens`` inside the call.
    - ``device``: default the current CUDA device, else the CPU (Triton's interpreter).

    Transport: ``backend`` ``"triton"`` or ``"push"`` (one fused kernel pushing into peers' buffers;
    one host, peer access, at most 8 ranks), ``"pull"`` (the same kernel staging rows in this rank's
    own buffer, each rank reading its rows from its peers': for fabrics where peer writes
    collapse), ``"nccl"`` (pack, the group's all-to-all, combine; calls paired by the group's order,
    without the lockstep announcements) or ``"auto"``: where every rank can run the fused kernel,
    the ranks time the push and the pull over call sizes up to ``max_tokens`` and agree on the
    faster for each size (``plan``, ``dcp.plan``; calls above ``max_tokens`` take ``max_tokens``'s);
    elsewhere nccl.
    ``DCP_A2A_MEASURE=0`` skips the measurement (the push serves), ``=1`` measures on the CPU too
    (not by default: the interpreter's times say nothing of a fabric). ``None`` reads
    ``DCP_A2A_BACKEND`` (default ``auto``). After construction ``backend`` names the transport
    (``"auto"`` where the plan uses several) and ``backend_reason`` why.

    Failure: every wait is bounded by ``timeout_s`` (default 10 s on GPUs, 120 s on the CPU; at
    most a day). A call that cannot complete raises ``DcpTimeoutError`` (naming the missing ranks)
    or ``DcpMismatchError`` (ranks entered the call differently), writes its rows as NaN and
    poisons its channel until the communicator is rebuilt; a rank whose own call completed before
    a peer gave up raises at its next call on that channel. ``check`` (default: on the CPU,
    or with ``DCP_A2A_CHECK=1``) makes every call synchronize and raise at once; otherwise
    ``check()`` or ``start_watchdog()`` raises a recorded failure.

    Concurrency: each channel (``channels``, default 1) has its own slots, flags and device-side
    epoch; one call at a time per channel. Calls that may run concurrently (two streams, two graphs
    replayed at once) must use different channels.

    Tuning (defaults are measured: ``docs/design.md``, section 5): ``max_programs`` (default: the
    device's SMs over its ranks and the channels) sizes the kernel's grid; ``num_warps`` fixes the
    warps per program (default: by call size, fewer for small calls, 16 from 128 tokens); ``pdl``
    (default: on from compute capability 9.0) launches small calls with programmatic dependent
    launch. ``DCP_A2A_TRACE=1`` compiles in a per-call timestamp trace (``trace()``).
    """

    def __init__(self, group: dist.ProcessGroup, max_tokens: int = 64, num_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, dtype: torch.dtype = torch.bfloat16,
                 device: Optional[Union[torch.device, str, int]] = None, *,
                 backend: Optional[str] = None, channels: int = 1, timeout_s: Optional[float] = None,
                 max_programs: Optional[int] = None, num_warps: Optional[int] = None,
                 pdl: Optional[bool] = None, check: Optional[bool] = None,
                 query_dim: Optional[int] = None, query_dtype: Optional[torch.dtype] = None):
        self._closed = True
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:  # not collective: a non-member cannot reach the group
            raise DcpError("DcpAllToAll: this process is not a member of the group it was given")
        self.world = dist.get_world_size(group)
        # Every argument is checked here and the verdict agreed on by all ranks before any rank
        # acts on it, so that a bad argument on one rank fails construction on every rank alike.
        requested = backend if backend is not None else os.environ.get("DCP_A2A_BACKEND", "auto")
        requested = "triton" if requested == "push" else requested
        self.dtype, self.num_warps, self.max_programs, self.pdl = dtype, num_warps, max_programs, pdl
        self.max_tokens = self.num_heads = self.head_dim = self.channels = self.query_dim = 0
        self.query_dtype = query_dtype if query_dtype is not None else dtype
        self.device, self.timeout_s, self._has_pdl, where = torch.device("cpu"), 0.0, False, ""
        try:
            error = self._set_arguments(max_tokens, num_heads, head_dim, channels, device, timeout_s, requested,
                                        head_dim if query_dim is None else query_dim)
            if error is None:
                where = self._where()
        except Exception as exc:  # anything unexpected is reported to every rank too
            error = f"{type(exc).__name__}: {exc}"
        self.heads_per_rank = self.num_heads // self.world
        env_check = os.environ.get("DCP_A2A_CHECK", "0") not in ("", "0")
        # CPU calls are synchronous, so checking their status costs nothing.
        self.check_calls = bool(check) if check is not None else (env_check or self.device.type == "cpu")
        self.tracing = os.environ.get("DCP_A2A_TRACE", "0") not in ("", "0")
        measure = os.environ.get("DCP_A2A_MEASURE", "")
        self._measures = measure not in ("", "0") if measure else self.device.type == "cuda"
        geometry = dict(max_tokens=self.max_tokens, num_heads=self.num_heads, head_dim=self.head_dim, dtype=str(dtype),
                        channels=self.channels, world=self.world, backend=requested, num_warps=self.num_warps,
                        query_dim=self.query_dim, query_dtype=str(self.query_dtype), DCP_A2A_MEASURE=self._measures)
        facts = all_gather(group, (geometry, error, where, self.device.index), "DcpAllToAll construction")
        agree(group, facts[self.rank][1], "DcpAllToAll construction", errors=[f[1] for f in facts])
        if any(f[0] != geometry for f in facts):
            raise DcpError(geometry_disagreement([f[0] for f in facts]))
        self.ranks_per_device = sum(1 for f in facts if f[2] == where)
        self.max_programs = max_programs or self._default_programs()
        # Every rank must tile a call alike: small calls' tiles are sized by the smallest grid.
        programs = min(all_gather(group, self.max_programs, "DcpAllToAll construction"))
        self.layout = ChannelLayout(self.world, self.heads_per_rank, self.head_dim, self.max_tokens, self.num_warps,
                                    programs, value_words=dtype.itemsize // 2)
        # The gather moves query rows as raw 16-bit words: a copy, bit for bit, whatever the dtype.
        self._query_words = self.query_dim * self.query_dtype.itemsize // 2
        self.gather_layout = ChannelLayout(self.world, self.heads_per_rank, self._query_words, self.max_tokens,
                                           self.num_warps, programs, lse=False)
        self.region = ChannelRegion((self.layout, self.gather_layout))
        self._lse_scratch = torch.empty(1, dtype=torch.float32, device=self.device)
        self._ready: set = set()
        # One call at a time per channel (a second thread's call is refused), and the channels
        # poisoned on the host (a refused call may have left the ranks out of step) with the reason.
        self._busy = [threading.Lock() for _ in range(self.channels)]
        self._host_poison: dict = {}
        self.plan: Optional[auto_plan.Plan] = None
        self._transports: dict = {}  # name -> transport, the candidates' order; then those in use
        self._closed = False
        try:
            self._select(requested, facts)
            self._compile_shared()
            self.warmup()
            po, y, lses, _ = self._examples()
            # What a call that moves no data launches with (a rejected call's own tensors may be unusable).
            self._idle_call = (*launch_operands(po, lses[0], y, None), po, lses[0], y, self._lse_scratch)
            if len(self._transports) > 1:
                self._measure_plan()
        except BaseException:
            self.close()
            raise
        self._transport = next(iter(self._transports.values()))  # the first in use (trace, tests' pokes)
        self.backend: str = self._transport.name if len(self._transports) == 1 else "auto"
        self.provider: str = self._transport.provider
        # kind -> the transport of each call size, index min(B, max_tokens)
        self._routes = {kind: [self._transports[name] for name in self.plan.by_size[kind]] if self.plan
                        else [self._transport] * (self.max_tokens + 1) for kind in self._layouts}
        # The one transport every call takes, where there is one: calls then skip the routing.
        self._only = self._transport if len(self._transports) == 1 else None
        if self.rank == 0:
            log.info("DCP all-to-all backend: %s (%s)", self.backend, self.backend_reason)
            if self.plan is not None:
                log.info("%s", self.plan)

    # --- setup ---------------------------------------------------------------------------------
    def _set_arguments(self, max_tokens, num_heads, head_dim, channels, device, timeout_s,
                       requested, query_dim) -> Optional[str]:
        """Normalize the arguments onto ``self``; the first that does not fit, as a message."""
        missing = [name for name, value in (("num_heads", num_heads), ("head_dim", head_dim)) if value is None]
        if missing:
            return f"{' and '.join(missing)} must be given (the geometry every call must match)"
        for name, value in zip(_INT_ARGS, (max_tokens, num_heads, head_dim, channels, query_dim)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                return f"{name} must be an integer; got {value!r}"
            setattr(self, name, int(value))
        for name in ("max_programs", "num_warps"):
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                setattr(self, name, int(value))
        try:
            self.device = self._resolve_device(device)
        except Exception as exc:
            return f"device: {device!r} is not a usable device ({exc})"
        if self.device.type not in ("cuda", "cpu"):
            return f"device must be cuda or cpu; got {self.device}"
        if timeout_s is None:
            timeout_s = DEFAULT_TIMEOUT_S[self.device.type]
        if (not isinstance(timeout_s, numbers.Real) or isinstance(timeout_s, bool)
                or not 0 < float(timeout_s) <= MAX_TIMEOUT_S):
            return f"timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S:.0f}]; got {timeout_s!r}"
        self.timeout_s = float(timeout_s)
        self._has_pdl = self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) >= (9, 0)
        self.pdl = self._has_pdl if self.pdl is None else self.pdl
        return self._local_error(requested)

    def _resolve_device(self, device) -> torch.device:
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

    def _where(self) -> str:
        if self.device.type == "cuda":
            return f"{socket.gethostname()}/{torch.cuda.get_device_properties(self.device).uuid}"
        return f"{socket.gethostname()}/cpu"

    def _local_error(self, backend: str) -> Optional[str]:
        n = self.world
        if n < 2:
            return f"the group has {n} rank(s); a DCP group needs at least 2"
        if backend not in BACKENDS:
            return f"backend must be one of {BACKENDS}; got {backend!r}"
        error = combine_geometry_error(n, self.num_heads, self.head_dim, self.dtype)
        if error:
            return error
        if self.max_tokens <= 0:
            return f"max_tokens must be a positive integer; got {self.max_tokens}"
        error = query_geometry_error(self.query_dim, self.query_dtype)
        if error:
            return error
        if self.channels < 1:
            return f"channels must be a positive integer; got {self.channels}"
        if self.max_programs is not None and (type(self.max_programs) is not int or self.max_programs < 1):
            return f"max_programs must be None or a positive integer; got {self.max_programs!r}"
        if self.num_warps not in (None, 1, 2, 4, 8, 16):
            return f"num_warps must be None or a power of two from 1 to 16; got {self.num_warps!r}"
        if self.pdl not in (False, True):
            return f"pdl must be None, True or False; got {self.pdl!r}"
        if self.pdl and not self._has_pdl:
            return f"pdl=True needs a GPU of compute capability 9.0 or newer; {self.device} is not one"
        return None

    def _default_programs(self) -> int:
        if self.device.type == "cpu":
            return 4
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        # Every waiting program of every rank and channel on this device must be resident at
        # once. A 16-warp program (calls from 128 tokens) fills an SM's registers on an H200, so:
        # one program per SM, shared out among the ranks and the channels that may run together.
        # (Two 8-warp programs per SM, which their registers allow, timed out at N = 6 on one H200
        # under MPS: ranks' programs cannot be counted on to pack onto the same SMs.)
        return max(1, sms // (self.ranks_per_device * self.channels))

    @property
    def _layouts(self) -> dict:
        return {KIND_COMBINE: self.layout, KIND_GATHER: self.gather_layout}

    def _triton_obstacle(self, hosts: list) -> Optional[str]:
        """Why the triton path cannot serve this group, as every rank sees it (None: it can)."""
        if len(set(hosts)) > 1:
            return f"ranks are on {len(set(hosts))} hosts"
        if self.world > MAX_PEERS:
            return f"the group has {self.world} ranks; the triton path serves up to {MAX_PEERS}"
        return None

    def _p2p_obstacle(self, devices: list) -> Optional[str]:
        """This rank's view: can its GPU reach every other GPU of the group (peer access)?"""
        if self.device.type != "cuda":
            return None
        for other in set(devices) - {self.device.index}:
            if not torch.cuda.can_device_access_peer(self.device.index, other):
                return f"GPU {self.device.index} has no peer access to GPU {other}"
        return None

    def _gpu_scope(self) -> bool:
        """Flags and fences at GPU scope when every rank runs on this one GPU, else system scope.

        ``DCP_A2A_FENCE_SCOPE=sys`` forces system scope everywhere (the same on every rank).
        """
        return self.ranks_per_device == self.world and os.environ.get("DCP_A2A_FENCE_SCOPE") != "sys"

    def _select(self, requested: str, facts: list) -> None:
        """Build the transport(s) every rank agrees on, and say why (``backend_reason``): the one
        requested, or for ``auto`` the fused ones ``_measure_plan`` chooses among (the push alone
        where measuring is off), ``nccl`` where none can serve.

        The NCCL path is never one of ``auto``'s candidates: it pairs calls by the group's order, so
        a call one rank rejects would pair its peers' call with that rank's next one, and its waits
        are NCCL's, not ``timeout_s`` (docs/design.md, section 5.11)."""
        hosts, devices = [f[2].split("/")[0] for f in facts], [f[3] for f in facts]
        obstacle = self._triton_obstacle(hosts)
        if requested == "auto" and obstacle is None:
            views = all_gather(self.group, self._p2p_obstacle(devices))
            obstacle = next((v for v in views if v), None)
        if requested in FUSED_TRANSPORTS and obstacle is not None:
            raise DcpError(f"backend={requested!r} cannot serve this group: {obstacle}")
        measuring = requested == "auto" and obstacle is None and self._measures
        if requested in FUSED_TRANSPORTS:
            fused = [requested]
        elif requested == "auto" and obstacle is None:
            fused = list(FUSED_TRANSPORTS) if measuring else ["triton"]
        else:
            fused = []
        self._left_out: dict = {}
        reason = "requested" if requested != "auto" else obstacle
        for name in fused:
            try:
                self._transports[name] = TritonTransport(
                    self.group, self._layouts, self.region, self.device, self.channels, self.timeout_s,
                    self.max_programs, self._gpu_scope(), self.tracing, self.pdl, pull=name == "pull")
            except DcpError as exc:  # raised on every rank alike: the fallback is collective too
                if requested in FUSED_TRANSPORTS or isinstance(exc, DcpPeerLostError):
                    raise
                reason = self._left_out[name] = f"buffer setup failed: {exc}"
        if requested == "auto" and self._transports:
            reason = "every rank reaches every peer's buffer"
            if not measuring:
                why = "DCP_A2A_MEASURE=0" if self.device.type == "cuda" else "Triton's interpreter on the CPU"
                reason += f" (not measured: {why})"
            else:  # (where both were built, _measure_plan says what it chose)
                reason += "".join(f"; {name} left out: {why}" for name, why in self._left_out.items())
        if not self._transports:
            self._transports["nccl"] = NcclTransport(self.group, self._layouts, self.device, self.channels)
        self.backend_reason = reason

    def _measure_plan(self) -> None:
        """``auto``: time every candidate over the ladder of call sizes (``dcp.plan``), agree on the
        plan from every rank's times, where it splits a size's gather from its combine time layers
        and agree again, and close the transports it leaves unused. Collective."""
        t0 = time.perf_counter()
        mt, dev, cuda = self.max_tokens, self.device, self.device.type == "cuda"
        error = None
        try:  # inputs of max_tokens, and the timer; every rank has them before any rank calls
            po = torch.randn((mt, self.num_heads, self.head_dim), device=dev).to(self.dtype)
            lse = torch.randn((mt, self.num_heads), device=dev)
            y = torch.empty((mt, self.heads_per_rank, self.head_dim), dtype=self.dtype, device=dev)
            q16 = torch.randint(-1 << 15, 1 << 15, (mt, self.heads_per_rank, self._query_words), dtype=torch.int16,
                                device=dev)
            y16 = torch.empty((mt, self.num_heads, self._query_words), dtype=torch.int16, device=dev)
            calls = {KIND_COMBINE: (launch_operands(po, lse, y, None), po, lse, y),
                     KIND_GATHER: (gather_operands(q16, y16), q16, None, y16)}
            timer = auto_plan.CudaTimer(dev) if cuda else auto_plan.HostTimer()
        except Exception as exc:  # reported to every rank by agree()
            error = f"{type(exc).__name__}: {exc}"
        agree(self.group, error, "auto: preparing the measurement")

        def runner(transport):
            def run(kind: int, b: int) -> None:
                operands, a, l, out = calls[kind]
                try:
                    self._launches(transport, kind, operands, a[:b], self._lse_scratch if l is None else l[:b],
                                   out[:b], None, b, 0, True)
                except Exception:
                    # The peers' call fails at once, not on the timeout: their next calls, on another
                    # candidate, then meet this rank's in time.
                    self._announce(transport, 0, TAG_ABORT)
                    raise
            return run

        def failure(name: str) -> Optional[str]:
            if cuda:
                torch.cuda.synchronize(dev)
            error = self._transports[name].error(0)
            return None if error is None else str(error)

        sizes, candidates = auto_plan.ladder(mt), list(self._transports)
        runs = {name: runner(t) for name, t in self._transports.items()}

        def timed(points: list) -> tuple:
            table, failed = auto_plan.measure(runs, failure, points, timer, warm=1 if cuda else 0,
                                              reps=8 if cuda else 1, rounds=2 if cuda else 1)
            if cuda:
                torch.cuda.synchronize(dev)
            self._host_poison.clear()  # what a candidate's failure left here: that candidate is left out
            return table, failed, time.perf_counter() - t0

        plan = auto_plan.agree_plan(self.group, *timed(auto_plan.op_points(candidates, sizes)), candidates, sizes,
                                    self._left_out, mt)
        points = auto_plan.layer_points(plan)  # the same on every rank: so is the plan
        if points:
            plan = auto_plan.agree_plan(self.group, *timed(points), candidates, sizes, plan.left_out, mt, plan)
        # Every rank has synchronized before the exchange: no kernel of any rank still uses these.
        for name in [n for n in self._transports if n not in plan.transports]:
            self._transports.pop(name).close()
        self.plan = plan
        self.backend_reason = f"measured in {plan.seconds:.2f} s: {plan.summary()}" + "".join(
            f"; {name} left out: {why}" for name, why in plan.left_out.items())

    # --- readiness -----------------------------------------------------------------------------
    def warmup(self, partial_out: Optional[torch.Tensor] = None,
               partial_lse: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None, *,
               q_local: Optional[torch.Tensor] = None, q_out: Optional[torch.Tensor] = None) -> None:
        """Compile and load every kernel variant a call can use, so that capture never does.

        Without arguments: the variants of well-aligned inputs, for each accepted LSE dtype and
        the gather. With example tensors: also the variant of their exact layout (pointers not
        16-byte aligned or strides not multiples of 8 need their own): ``partial_out`` (with
        ``partial_lse``, ``out``) for the combine, ``q_local`` (with ``q_out``) for the gather.
        Runs only load-only launches: local, touches no peer and no epoch. Called by the constructor.
        """
        self._check_open()
        if self.device.type == "cpu":
            return  # interpreted: nothing to compile
        if partial_out is not None:
            y = out if out is not None else torch.empty(
                (1, self.heads_per_rank, self.head_dim), dtype=self.dtype, device=self.device)
            lse = partial_lse if partial_lse is not None else self._lse_scratch
            self._load(KIND_COMBINE, (partial_out, lse, y), launch_operands(partial_out, lse, y, None))
        if q_local is not None:
            y = q_out if q_out is not None else torch.empty(
                (1, self.num_heads, self.query_dim), dtype=self.query_dtype, device=self.device)
            q16, y16 = q_local.view(torch.int16), y.view(torch.int16)
            self._load(KIND_GATHER, (q16, self._lse_scratch, y16), gather_operands(q16, y16))
        if partial_out is None and q_local is None:
            for kind, tensors, operands in self._example_jobs():
                self._load(kind, tensors, operands)

    def _examples(self) -> tuple:
        """Calls of one token in the well-aligned layout: ``partial_out``, ``out``, one
        ``partial_lse`` per accepted LSE dtype, and the gather's (q, out) as 16-bit words."""
        dev = self.device
        po = torch.empty((1, self.num_heads, self.head_dim), dtype=self.dtype, device=dev)
        y = torch.empty((1, self.heads_per_rank, self.head_dim), dtype=self.dtype, device=dev)
        gather = (torch.empty((1, self.heads_per_rank, self._query_words), dtype=torch.int16, device=dev),
                  torch.empty((1, self.num_heads, self._query_words), dtype=torch.int16, device=dev))
        return po, y, [torch.empty((1, self.num_heads), dtype=t, device=dev) for t in LSE_DTYPES], gather

    def _example_jobs(self) -> list:
        """(kind, launch tensors, operands) of every well-aligned variant."""
        po, y, lses, (q16, y16) = self._examples()
        jobs = [(KIND_COMBINE, (po, lse, y), launch_operands(po, lse, y, None)) for lse in lses]
        return jobs + [(KIND_GATHER, (q16, self._lse_scratch, y16), gather_operands(q16, y16))]

    def _compile_shared(self) -> None:
        """Collective: compile the constructor's variants once per host, not once per rank.

        Triton keeps what it compiles in an on-disk cache that the ranks of a host share: each rank
        first compiles and loads its share of the (variant, tiling) pairs, and once all ranks
        have, ``warmup()`` finds the others' in the cache. A rank that fails makes every rank raise.
        """
        jobs = [(t, kind, tensors, operands, w) for t in self._transports.values()
                for kind, tensors, operands in self._example_jobs() for k, w in t.tilings if k == kind]
        error = None
        try:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # as in _load
            for t, kind, (a, b, c), (key, strides), w in jobs[self.rank::self.world]:
                t.load(kind, key, strides, a, b, c, self._lse_scratch, (w,))
        except Exception as exc:  # reported to every rank by agree()
            error = f"{type(exc).__name__}: {exc}"
        agree(self.group, error, "compiling the kernels")

    def _load(self, kind: int, tensors: tuple, operands: tuple) -> None:
        key, strides = operands
        if key in self._ready:
            return
        if self.device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                what = "partial_out, partial_lse, out" if kind == KIND_COMBINE else "q_local=..., q_out=..."
                raise DcpError(
                    f"the kernel variant for this call ({key[0]}, aligned layout {key[1]}) is not loaded, "
                    f"and the stream is capturing a CUDA graph: call comm.warmup({what}) with tensors of "
                    "this layout before capture")
            stream = torch.cuda.current_stream(self.device)
            stream.synchronize()  # loading a module next to a spinning kernel can block
            for transport in self._transports.values():
                transport.load(kind, key, strides, *tensors, self._lse_scratch)
            stream.synchronize()
        self._ready.add(key)

    # --- the call ------------------------------------------------------------------------------
    def lse_reduce(self, partial_out: torch.Tensor, partial_lse: torch.Tensor,
                   return_lse: bool = False, is_lse_base_on_e: bool = True,
                   out: Optional[torch.Tensor] = None, *, out_lse: Optional[torch.Tensor] = None,
                   seq_lens: Optional[torch.Tensor] = None, query_start_loc: Optional[torch.Tensor] = None,
                   channel: int = 0, check: Optional[bool] = None):
        """Combine this rank's head chunk over all ranks: ``[B, H, D]`` -> ``[B, H/N, D]``.

        ``partial_out`` ``[B, H, D]`` in the constructor's dtype (last dimension contiguous) and
        ``partial_lse`` ``[B, H]`` (fp32, bf16 or fp16, any strides): this rank's attention over its
        KV shard and the log-sum-exp of each softmax, in base e (``is_lse_base_on_e``, the default)
        or base 2 (every rank must agree). For each (token, head) of this rank's chunk the result is
        ``sum_i exp(lse_i - L) * out_i`` over the ranks i, ``L`` the combined LSE, accumulated in
        fp32; an LSE that is NaN or +inf counts as -inf, a rank of weight 0 adds nothing (even NaN
        rows), and where every rank is empty the result is 0 with LSE -inf.

        Returns ``out`` ``[B, H/N, D]`` (allocated unless given) and, with ``return_lse``, the
        combined LSE ``[B, H/N]`` fp32 in the input's base (``out_lse`` if given). ``out`` must not
        overlap the inputs. ``check`` (default: the constructor's) synchronizes and raises a
        recorded timeout or mismatch; ``channel`` picks the channel (default 0).

        ``seq_lens`` [S] (this rank's KV length per sequence) and ``query_start_loc`` [S + 1]
        (cumulative query tokens), int32 or int64 on the device, as vLLM passes them: this rank adds
        nothing to tokens past ``query_start_loc[S]`` (graph padding) or of sequences whose local
        length is 0. Read on the device inside the launch: no synchronization, capturable.

        Collective, whatever happens: a call rejected here (bad arguments) still announces itself
        to the peers, whose call then fails naming this rank; a call with B = 0 takes part too.
        """
        busy, transport = self._enter(channel, KIND_COMBINE, partial_out)
        try:
            try:
                B = self._validate(partial_out, partial_lse, out, out_lse)
                meta = None if seq_lens is None and query_start_loc is None else metadata(
                    self.device, seq_lens, query_start_loc)
                y = out if out is not None else torch.empty((B, self.heads_per_rank, self.head_dim),
                                                            dtype=self.dtype, device=self.device)
                y_lse = None  # an out_lse without return_lse is not written
                if return_lse:
                    y_lse = out_lse if out_lse is not None else torch.empty(
                        (B, self.heads_per_rank), dtype=torch.float32, device=self.device)
                operands = launch_operands(partial_out, partial_lse, y, y_lse)  # raises on a strided row
                if out is not None or out_lse is not None:
                    refuse_overlap((("partial_out", partial_out), ("partial_lse", partial_lse)),
                                   (("out", out), ("out_lse", out_lse)))
                if operands[0] not in self._ready:
                    self._load(KIND_COMBINE, (partial_out, partial_lse, y), operands)
            except BaseException:
                self._announce(transport, channel, TAG_ABORT)
                raise
            self._launches(transport, KIND_COMBINE, operands, partial_out, partial_lse, y, y_lse, B, channel,
                           is_lse_base_on_e, meta)
        finally:
            busy.release()
        self._checked(channel, check)
        return (y, y_lse) if return_lse else y

    def all_gather_heads(self, q_local: torch.Tensor, out: Optional[torch.Tensor] = None, *,
                         channel: int = 0, check: Optional[bool] = None) -> torch.Tensor:
        """Gather every rank's query heads: ``[B, H/N, Dq]`` -> ``[B, H, Dq]``, rank r's at
        ``[:, r*H/N:(r+1)*H/N]``, bit for bit (a copy: no arithmetic, any query dtype).

        ``q_local`` may be strided in its token and head dimensions (last dimension contiguous);
        ``out`` (allocated unless given) may be a head-sliced view of a larger buffer
        (``buf[:, :H]``). The result is never a view of the shared buffers. Collective, like
        ``lse_reduce``, on the same channels and epochs: gathers and combines interleave freely.
        """
        busy, transport = self._enter(channel, KIND_GATHER, q_local)
        try:
            try:
                B = self._validate_query(q_local, out)
                y = out if out is not None else torch.empty((B, self.num_heads, self.query_dim),
                                                            dtype=self.query_dtype, device=self.device)
                if out is not None:
                    refuse_overlap((("q_local", q_local),), (("out", out),))
                q16, y16 = as_words("q_local", q_local), as_words("out", y)
                operands = gather_operands(q16, y16)
                if operands[0] not in self._ready:
                    self._load(KIND_GATHER, (q16, self._lse_scratch, y16), operands)
            except BaseException:
                self._announce(transport, channel, TAG_ABORT)
                raise
            self._launches(transport, KIND_GATHER, operands, q16, self._lse_scratch, y16, None, B, channel, True)
        finally:
            busy.release()
        self._checked(channel, check)
        return y

    def _checked(self, channel: int, check: Optional[bool]) -> None:
        """With ``check`` (default: the constructor's), wait for the call and raise its failure."""
        if check if check is not None else self.check_calls:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            error = self._device_error(channel)  # this call's own failure (or the first before it)
            if error is not None:
                raise error

    def _enter(self, channel, kind: int, first) -> tuple:
        """Take the channel for this call and pick its transport (by ``first``'s B: every rank
        routes a call of one size alike), or raise: closed, busy, or poisoned by a failed call.
        A call rejected later announces itself on that transport: where its B is the peers', theirs."""
        if self._closed:
            self._check_open()
        if type(channel) is not int or not 0 <= channel < self.channels:
            # Which channel the peers use is unknown: none of them can be trusted to be in step.
            for c in range(self.channels):
                self._host_poison.setdefault(c, f"a call named channel {channel!r}, which does not exist")
            raise ValueError(f"channel: expected an integer in [0, {self.channels}), got {channel!r}")
        transport = self._only or self._route(kind, first)
        busy = self._busy[channel]
        if not busy.acquire(blocking=False):
            self._check_open()
            # The call in flight keeps the channel; this one is lost, so the ranks' call counts differ.
            self._host_poison.setdefault(channel, "two threads called on it at once")
            raise DcpError(f"channel {channel} is busy: another thread of this process is inside a call on "
                           f"it (calls that may run concurrently need channels of their own); {POISONED_NOTE}")
        error = self._channel_error(channel)
        if error is not None:
            try:
                self._announce(transport, channel, TAG_POISONED)
            finally:
                busy.release()
            raise error
        return busy, transport

    def _channel_error(self, channel: int) -> Optional[DcpError]:
        if channel in self._host_poison:
            return DcpError(f"channel {channel} is poisoned: {self._host_poison[channel]}; {POISONED_NOTE}")
        return self._device_error(channel)

    def _route(self, kind: int, first) -> object:
        """The plan's transport for a call whose first argument is ``first`` (by its B)."""
        routes = self._routes[kind]
        try:
            return routes[min(first.shape[0], self.max_tokens)]
        except Exception:  # no first dimension (not a tensor, or 0-d): rejected later, on the smallest calls' route
            return routes[1]

    def _device_error(self, channel: int) -> Optional[DcpError]:
        """The first recorded failure of a channel in any transport in use (host reads)."""
        if self._only is not None:
            return self._only.error(channel)
        for transport in self._transports.values():
            error = transport.error(channel)
            if error is not None:
                return error
        return None

    def _announce(self, transport, channel: int, tag: int) -> None:
        """A call that moves no data, so that the peers' call of the same epoch fails at once naming
        this rank, and every rank's epoch stays in step. If even that cannot launch, the channel is
        poisoned here, and its next call announces it (never raises)."""
        try:
            transport.launch(*self._idle_call, 0, tag, channel, False, True)
        except Exception as exc:  # the caller raises its own error
            self._host_poison.setdefault(channel, f"a call could not announce itself to the peers ({exc})")

    def _launches(self, transport, kind: int, operands: tuple, po, lse, y, y_lse, B: int, channel: int,
                  base_e: bool, meta: Optional[tuple] = None) -> None:
        """The call's launches: one up to max_tokens, else one per chunk of max_tokens, all with the
        call's tag. A failure between them leaves the ranks out of step: the channel is poisoned.
        (The gather's ``lse`` is the scratch word: it is not sliced.) ``meta``: ``_metadata``'s."""
        key, strides = operands
        write_lse, lse_arg = (False, self._lse_scratch) if y_lse is None else (True, y_lse)
        tag = call_tag(kind, B, not base_e)
        try:
            if B <= self.max_tokens:
                transport.launch(key, strides, po, lse, y, lse_arg, B, tag, channel, write_lse, base_e,
                                 meta and meta + (0,))
                return
            for b0 in range(0, B, self.max_tokens):
                b1 = min(B, b0 + self.max_tokens)
                transport.launch(key, strides, po[b0:b1], lse if kind == KIND_GATHER else lse[b0:b1],
                                 y[b0:b1], y_lse[b0:b1] if write_lse else lse_arg, b1 - b0, tag, channel,
                                 write_lse, base_e, meta and meta + (b0,))
        except BaseException as exc:
            self._host_poison.setdefault(channel, f"a call failed between its launches ({type(exc).__name__})")
            raise

    def _validate(self, po, lse, out, out_lse) -> int:
        """The call's B, or raise naming the argument that does not fit.

        A well-formed call passes one test that reads each tensor's shape, dtype and device once
        (a third of an eager call's host time went to checking, ``python -m bench.host_time``);
        anything else, tensor subclasses included, goes through ``_expect``, which names what was
        expected and what came."""
        hn, h, d, dev, dt = self.heads_per_rank, self.num_heads, self.head_dim, self.device, self.dtype
        shape = po.shape if type(po) is torch.Tensor else ()
        if (len(shape) == 3 and shape[1] == h and shape[2] == d and po.dtype is dt and po.device == dev
                and type(lse) is torch.Tensor and lse.shape == (shape[0], h) and lse.dtype in LSE_DTYPES
                and lse.device == dev
                and (out is None or (type(out) is torch.Tensor and out.shape == (shape[0], hn, d)
                                     and out.dtype is dt and out.device == dev))
                and (out_lse is None or (type(out_lse) is torch.Tensor and out_lse.shape == (shape[0], hn)
                                         and out_lse.dtype is torch.float32 and out_lse.device == dev))
                and shape[0] <= TAG_MAX_TOKENS):
            return shape[0]
        B = po.shape[0] if isinstance(po, torch.Tensor) and po.dim() == 3 else "B"  # "B": raises below
        expect("partial_out", po, (B, h, d), (dt,), dev)
        expect("partial_lse", lse, (B, h), LSE_DTYPES, dev)
        if out is not None:
            expect("out", out, (B, hn, d), (dt,), dev)
        if out_lse is not None:
            expect("out_lse", out_lse, (B, hn), (torch.float32,), dev)
        if B > TAG_MAX_TOKENS:
            raise ValueError(f"partial_out: expected at most {TAG_MAX_TOKENS} tokens per call; got {B}")
        return B

    def _validate_query(self, q, out) -> int:
        """The gather's B, or raise naming the argument that does not fit."""
        hn, h, dq, dev, dt = self.heads_per_rank, self.num_heads, self.query_dim, self.device, self.query_dtype
        B = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 3 else "B"  # "B": raises below
        expect("q_local", q, (B, hn, dq), (dt,), dev)
        if out is not None:
            expect("out", out, (B, h, dq), (dt,), dev)
        if B > TAG_MAX_TOKENS:
            raise ValueError(f"q_local: expected at most {TAG_MAX_TOKENS} tokens per call; got {B}")
        return B

    # --- status and lifecycle ------------------------------------------------------------------
    def check(self, synchronize: bool = False) -> None:
        """Raise the failure of a poisoned channel, if any: a recorded ``DcpTimeoutError`` or
        ``DcpMismatchError`` (it stays recorded until the communicator is rebuilt).

        Reads host-mapped status words: it waits for the device only when asked to.
        """
        self._check_open()
        if synchronize and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        for c in range(self.channels):
            error = self._channel_error(c)
            if error is not None:
                raise error

    def start_watchdog(self, interval_s: float = 1.0,
                       on_error: Optional[Callable[[DcpError], None]] = None) -> None:
        """Check the status words from a background thread every ``interval_s`` seconds.

        Never synchronizes the device. On a channel's failure it calls ``on_error(exc)`` once
        (default: log the error), so a server can fail the affected requests instead of serving NaN
        rows; ``on_error`` may close the communicator.
        """
        self._check_open()
        self.stop_watchdog()
        stop = threading.Event()

        def watch() -> None:
            reported: set = set()
            while not stop.wait(interval_s):
                for c in range(self.channels):
                    error = None if c in reported or stop.is_set() else self._channel_error(c)
                    if error is not None:
                        reported.add(c)
                        (on_error or (lambda e: log.error("DCP all-to-all watchdog: %s", e)))(error)

        self._watchdog = (stop, threading.Thread(target=watch, name="dcp-a2a-watchdog", daemon=True))
        self._watchdog[1].start()

    def stop_watchdog(self) -> None:
        watchdog, self._watchdog = getattr(self, "_watchdog", None), None
        if watchdog is not None:
            watchdog[0].set()
            if watchdog[1] is not threading.current_thread():  # on_error may stop it from inside
                watchdog[1].join()

    def trace(self, channel: int = 0) -> torch.Tensor:
        """The last traced calls of a channel (``DCP_A2A_TRACE=1``), ordered by epoch.

        int64 ``[calls, programs, 5]``: epoch, then device times (ns, ``%globaltimer``) at which
        each program started, had published its tiles, had seen all of its tiles arrive, and had
        combined them. Programs that did not run are zero. Synchronizes the device.
        """
        self._check_open()
        if not self.tracing or self._transport.name not in FUSED_TRANSPORTS:
            raise DcpError("tracing is off: construct with DCP_A2A_TRACE=1 and the triton backend")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self._transport.trace_records(channel)

    def tiling(self, n_tokens: int, gather: bool = False) -> tuple:
        """(warps per program, programmatic dependent launch) of the launches of a combine (or,
        with ``gather``, a query all-gather) of ``n_tokens`` tokens; a call above ``max_tokens``
        runs in launches of ``max_tokens``."""
        self._check_open()
        if type(n_tokens) is not int or n_tokens < 1:
            raise ValueError(f"n_tokens: expected a positive integer, got {n_tokens!r}")
        kind, n = KIND_GATHER if gather else KIND_COMBINE, min(n_tokens, self.max_tokens)
        return self._routes[kind][n].tiling(n, kind)

    def memory_bytes(self) -> dict:
        """Bytes of persistent buffers this rank holds, per channel and in total."""
        per = sum(t.memory_bytes() for t in self._transports.values())
        return {"per_channel": per, "channels": self.channels, "total": per * self.channels}

    def _check_open(self) -> None:
        if self._closed:
            raise DcpError("this DcpAllToAll is closed")

    def close(self) -> None:
        """Collective: unmap peers' buffers and free this rank's. Graphs captured against this
        communicator must be dropped first: their kernels hold its addresses. Callable from any
        thread: it first waits for calls in flight on other threads (each is bounded by the
        timeout)."""
        if self._closed:
            return
        self._closed = True
        self.stop_watchdog()
        deadline = 2 * self.timeout_s + 10
        held = [lock for lock in self._busy if lock.acquire(timeout=deadline)]
        if len(held) < len(self._busy):
            for lock in held:
                lock.release()
            raise DcpError(f"DcpAllToAll.close: a call on another thread did not end within {deadline:.0f} s; "
                           "the buffers stay mapped rather than be unmapped under it")
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            # No peer still writes into our buffers; bounded, so that a dead peer cannot hang us.
            dist.barrier(self.group, async_op=True).wait(timedelta(seconds=self.timeout_s))
        except Exception as exc:
            log.warning("DcpAllToAll.close: barrier with peers failed (%s); releasing local buffers", exc)
        finally:
            errors = []
            for transport in self._transports.values():
                try:
                    transport.close()
                except Exception as exc:  # the others are still released
                    errors.append(exc)
            if errors:
                raise errors[0]

    def __enter__(self) -> "DcpAllToAll":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"DcpAllToAll(world={self.world}, rank={self.rank}, heads={self.num_heads}, "
                f"head_dim={self.head_dim}, max_tokens={self.max_tokens}, dtype={self.dtype}, "
                f"device={self.device}, channels={self.channels}, backend={self.backend}, "
                f"provider={self.provider}, pdl={self.pdl})")
