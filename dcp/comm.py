"""``DcpAllToAll``: the face of the package and the path of a call. Construction's steps live in
modules of their own (``dcp.config``, ``dcp.protocol``, ``dcp.transports``, ``dcp.measure``,
``dcp.loading``); a call checks its tensors (``dcp.checks``), reads its launch operands
(``dcp.launch``) and launches on the transport its size is routed to."""

import logging
import operator
import threading
from datetime import timedelta
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from dcp import cudart
from dcp.checks import as_words, combine_batch, gather_batch, refuse_overlap, refuse_self_overlap
from dcp.config import agree_config, resolve
from dcp.constants import KIND_COMBINE, KIND_GATHER, MASK_NONE, MASK_READ, MASK_WRITE, TAG_ABORT, TAG_POISONED
from dcp.errors import DcpError
from dcp.launch import gather_apart, gather_operands, launch_operands, metadata, outputs_apart, with_mask_mode
from dcp.loading import KernelLoader
from dcp.measure import measure_plan
from dcp.protocol import POISONED_NOTE, ChannelRegion, call_tag, channel_layouts
from dcp.transports import build_transports
from dcp.watchdog import Watchdog

log = logging.getLogger("dcp")
_COMBINE_NAMES = ("partial_out", "partial_lse", "out", "out_lse")  # (refuse_overlap's, in the calls' order)
_GATHER_NAMES = ("q_local", "out")


def _as_index(channel: object) -> object:
    """A channel given as another integer type (``numpy.int64``) as an int; anything else (a bool
    or a tensor too) as it came, for ``_enter`` to refuse."""
    if isinstance(channel, (bool, torch.Tensor)) or not hasattr(type(channel), "__index__"):
        return channel
    try:
        return operator.index(channel)
    except (TypeError, ValueError):
        return channel


def _as_bool(name: str, flag: object) -> bool:
    """A flag given as another type that means True or False (``numpy.bool_``, 0 or 1), or raise:
    None or anything else would silently pick one meaning on every rank."""
    if not isinstance(flag, torch.Tensor) and flag in (0, 1):
        return bool(flag)
    raise TypeError(f"{name}: expected a bool, got {flag!r}")


def _view(t: torch.Tensor) -> tuple:
    """What a launch reads of a metadata tensor but its values (the device too: an empty tensor's
    address is 0 on any). A sound key within a step: the held launch metadata keeps the first call's
    tensors alive, so their addresses cannot be reused by other tensors meanwhile."""
    return t.device, t.data_ptr(), t.dtype, t.shape, t.stride()


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
    or ``DcpMismatchError`` (ranks entered the call differently), writes its rows that did
    not arrive as NaN and poisons its channel until the communicator is rebuilt; a rank whose own
    call completed before a peer gave up raises at its next call on that channel. ``check``
    (default: on the CPU, or with ``DCP_A2A_CHECK=1``) makes every call synchronize and raise at
    once; otherwise ``check()`` or ``start_watchdog()`` raises a recorded failure.

    Concurrency: each channel (``channels``, default 1) has its own slots, flags and device-side
    epoch; one call at a time per channel. Calls that may run concurrently (two streams, two graphs
    replayed at once) must use different channels.

    Tuning (defaults are measured: ``docs/design.md``, section 5): ``max_programs`` (default: the
    device's SMs over its ranks and the channels) caps the kernel's grid (every rank runs the
    smallest any rank asks for: ``self.max_programs``); ``num_warps`` fixes the warps per program
    (default: by call size, fewer for small calls, 16 from 128 tokens); ``pdl`` (default: on from
    compute capability 9.0) launches small calls with programmatic dependent launch.
    ``DCP_A2A_TRACE=1`` compiles in a per-call timestamp trace (``trace()``).
    """

    def __init__(self, group: dist.ProcessGroup, max_tokens: int = 64, num_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, dtype: torch.dtype = torch.bfloat16,
                 device: Optional[Union[torch.device, str, int]] = None, *,
                 backend: Optional[str] = None, channels: int = 1, timeout_s: Optional[float] = None,
                 max_programs: Optional[int] = None, num_warps: Optional[int] = None,
                 pdl: Optional[bool] = None, check: Optional[bool] = None,
                 query_dim: Optional[int] = None, query_dtype: Optional[torch.dtype] = None):
        self._closed, self._transports, self._watchdog = True, {}, None
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:  # not collective: a non-member cannot reach the group
            raise DcpError("DcpAllToAll: this process is not a member of the group it was given")
        self.world = dist.get_world_size(group)
        # 1-2. Every argument is checked here and the verdict agreed on by all ranks before any rank
        # acts on it, so that a bad argument on one rank fails construction on every rank alike.
        try:
            config, error = resolve(self.rank, self.world, max_tokens, num_heads, head_dim, dtype, device,
                                    backend=backend, channels=channels, timeout_s=timeout_s,
                                    max_programs=max_programs, num_warps=num_warps, pdl=pdl, check=check,
                                    query_dim=query_dim, query_dtype=query_dtype)
        except Exception as exc:  # anything unexpected is reported to every rank too
            config, error = None, f"{type(exc).__name__}: {exc}"
        c, facts = agree_config(group, config, error)
        self.config = c
        self.max_tokens, self.num_heads, self.head_dim, self.dtype = c.max_tokens, c.num_heads, c.head_dim, c.dtype
        self.query_dim, self.query_dtype, self.device, self.channels = c.query_dim, c.query_dtype, c.device, c.channels
        self.heads_per_rank, self.timeout_s, self.check_calls = c.heads_per_rank, c.timeout_s, c.check_calls
        self.pdl, self.max_programs, self.num_warps, self.tracing = c.pdl, c.programs, c.num_warps, c.tracing
        # 3. The rows of each collective and the region they share.
        layouts = channel_layouts(c)
        self.layout, self.gather_layout = layouts[KIND_COMBINE], layouts[KIND_GATHER]
        self.region = ChannelRegion(tuple(layouts.values()))
        # One call at a time per channel (a second thread's call is refused), and the channels
        # poisoned on the host (a refused call may have left the ranks out of step) with the reason.
        self._busy = [threading.Lock() for _ in range(c.channels)]
        self._host_poison: dict = {}
        self.plan = None
        # 4-6. The transports; auto's plan among them; their kernels.
        self._closed = False
        try:
            self._transports, self.backend_reason, left_out = build_transports(group, c, facts, layouts,
                                                                               self.region)
            self._loader = KernelLoader(c, self._transports)
            self._loader.compile_shared(group)
            self._loader.warmup(None, None, None, None, None)
            if len(self._transports) > 1:
                self.plan, self.backend_reason = measure_plan(group, c, self._transports, left_out)
                for name in [n for n in self._transports if n not in self.plan.transports]:
                    self._transports.pop(name).close()
        except BaseException:
            self.close()
            raise
        self._transport = next(iter(self._transports.values()))  # the first in use (trace, tests' pokes)
        self.backend: str = self._transport.name if len(self._transports) == 1 else "auto"
        self.provider: str = self._transport.provider
        # kind -> the transport of each call size, index min(B, max_tokens)
        self._routes = {kind: [self._transports[name] for name in self.plan.by_size[kind]] if self.plan
                        else [self._transport] * (c.max_tokens + 1) for kind in layouts}
        # A combine's route where it does not follow a gather; per channel, whether its last call was one.
        self._alone = [self._transports[name] for name in self.plan.combine_alone] if self.plan \
            else self._routes[KIND_COMBINE]
        self._after_gather = [False] * c.channels
        # The one transport every call takes, where there is one: calls then skip the routing.
        self._only = self._transport if len(self._transports) == 1 else None
        self._by_group_order = any(t.by_group_order for t in self._transports.values())  # (``_poison``)
        # Per channel, the empty-token mask of a step's metadata (``lse_reduce``'s ``step``) and what it
        # was written for: (step, the metadata views and call it describes, the launch metadata that
        # reads it), None until then.
        self._masks = list(torch.ones((c.channels, c.max_tokens), dtype=torch.int8, device=c.device))
        self._mask_for: list = [None] * c.channels
        # Per channel, whether a captured graph writes its mask: a replay then rewrites it unseen here,
        # so eager calls no longer read it.
        self._captured_masks = [False] * c.channels
        self._geometry = (c.heads_per_rank, c.num_heads, c.head_dim, c.device, c.dtype)
        self._query_geometry = (c.heads_per_rank, c.num_heads, c.query_dim, c.device, c.query_dtype)
        if self.rank == 0:
            log.info("DCP all-to-all backend: %s (%s)", self.backend, self.backend_reason)
            if self.plan is not None:
                log.info("%s", self.plan)

    # --- readiness -----------------------------------------------------------------------------
    def warmup(self, partial_out: Optional[torch.Tensor] = None,
               partial_lse: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None, *,
               q_local: Optional[torch.Tensor] = None, q_out: Optional[torch.Tensor] = None) -> None:
        """Compile and load every kernel variant a call can use, so that capture never does.

        Without arguments: the variants of well-aligned inputs, for each accepted LSE dtype and
        the gather. With example tensors: also the variant of their exact layout (pointers not
        16-byte aligned or strides not multiples of 8 need their own): ``partial_out`` (with
        ``partial_lse``, ``out``) for the combine, ``q_local`` (with ``q_out``) for the gather.
        Runs only load-only launches: local, touches no peer and no epoch. The constructor loads the
        well-aligned variants (``dcp.loading``).
        """
        self._check_open()
        self._loader.warmup(partial_out, partial_lse, out, q_local, q_out)

    # --- the call ------------------------------------------------------------------------------
    def lse_reduce(self, partial_out: torch.Tensor, partial_lse: torch.Tensor,
                   return_lse: bool = False, is_lse_base_on_e: bool = True,
                   out: Optional[torch.Tensor] = None, *, out_lse: Optional[torch.Tensor] = None,
                   seq_lens: Optional[torch.Tensor] = None, query_start_loc: Optional[torch.Tensor] = None,
                   step: object = None, channel: int = 0, check: Optional[bool] = None):
        """Combine this rank's head chunk over all ranks: ``[B, H, D]`` -> ``[B, H/N, D]``.

        ``partial_out`` ``[B, H, D]`` in the constructor's dtype (last dimension contiguous) and
        ``partial_lse`` ``[B, H]`` (fp32, bf16 or fp16, any strides): this rank's attention over its
        KV shard and the log-sum-exp of each softmax, in base e (``is_lse_base_on_e``, the default)
        or base 2 (every rank must agree). For each (token, head) of this rank's chunk the result is
        ``sum_i exp(lse_i - L) * out_i`` over the ranks i, ``L`` the combined LSE, accumulated in
        fp32; an LSE that is NaN or +inf counts as -inf, a rank of weight 0 adds nothing (even NaN
        rows), and where every rank is empty the result is 0 with LSE -inf.

        Returns ``out`` ``[B, H/N, D]`` (allocated unless given) and, with ``return_lse``, the
        combined LSE ``[B, H/N]`` fp32 in the input's base (``out_lse`` if given: it needs
        ``return_lse``). Outputs must not overlap the inputs, each other or themselves. ``check``
        (default: the constructor's) synchronizes and raises a recorded timeout or mismatch;
        ``channel`` picks the channel (default 0).

        ``seq_lens`` [S] (this rank's KV length per sequence) and ``query_start_loc`` [S + 1]
        (cumulative query tokens), int32 or int64 on the device, as vLLM passes them: this rank adds
        nothing to tokens past ``query_start_loc[S]`` (graph padding) or of sequences whose local
        length is 0. Read on the device inside the launch: no synchronization, capturable.
        ``step``: any object that stays the same for the calls of one model step (vLLM's plugin
        passes its forward context), between which the metadata tensors keep their values (and
        shapes). The step's first call on a channel checks and searches the metadata and keeps each
        token's verdict; its later calls with the same views (address, dtype, shape, strides) and B
        read that instead of searching (in a CUDA graph,
        only verdicts written in the same capture; eager calls, only while no captured graph
        writes them). None: every call searches.

        Collective, whatever happens: a call rejected here (bad arguments) still announces itself
        to the peers, whose call then fails naming this rank; a call with B = 0 takes part too. (The
        NCCL path cannot announce: there every later call of the rejecting rank raises.)
        """
        if type(channel) is not int:
            channel = _as_index(channel)
        busy, transport = self._enter(channel, KIND_COMBINE, partial_out)
        try:
            try:
                B = combine_batch(self._geometry, partial_out, partial_lse, out, out_lse)
                if out_lse is not None and not return_lse:
                    raise ValueError("out_lse: expected return_lse=True with it (without, no LSE is written)")
                if is_lse_base_on_e is not True and is_lse_base_on_e is not False:
                    is_lse_base_on_e = _as_bool("is_lse_base_on_e", is_lse_base_on_e)
                meta = mask_for = None
                if seq_lens is not None or query_start_loc is not None:
                    if step is not None and B <= self.max_tokens:
                        meta, mask_for = self._step_metadata(channel, step, seq_lens, query_start_loc, B, transport)
                    else:
                        meta = metadata(self.device, seq_lens, query_start_loc, self._masks[channel], MASK_NONE)
                y = out if out is not None else torch.empty((B, self.heads_per_rank, self.head_dim),
                                                            dtype=self.dtype, device=self.device)
                y_lse = None
                if return_lse:
                    y_lse = out_lse if out_lse is not None else torch.empty(
                        (B, self.heads_per_rank), dtype=torch.float32, device=self.device)
                operands = launch_operands(partial_out, partial_lse, y, y_lse)  # raises on a strided row
                if (out is not None or out_lse is not None) and not outputs_apart(self._geometry, B, operands):
                    refuse_overlap(_COMBINE_NAMES, (partial_out, partial_lse, out, out_lse), 2)
                    for name, t in (("out", out), ("out_lse", out_lse)):
                        if t is not None:
                            refuse_self_overlap(name, t)
                if operands[0] not in self._loader.ready:
                    self._loader.load(KIND_COMBINE, (partial_out, partial_lse, y), operands)
            except BaseException:
                self._announce(transport, channel, TAG_ABORT)
                raise
            self._launches(transport, KIND_COMBINE, operands, partial_out, partial_lse, y, y_lse, B, channel,
                           is_lse_base_on_e, meta)
            if mask_for is not None:  # launched: the mask is now written in stream order
                self._mask_for[channel] = mask_for
        finally:
            busy.release()
        if check if check is not None else self.check_calls:
            self._checked(channel)
        return (y, y_lse) if return_lse else y

    def _step_metadata(self, channel: int, step: object, seq_lens, query_start_loc, B: int, transport) -> tuple:
        """(launch metadata reading the channel's mask, None) where the mask was written for this
        step, metadata tensors that are the same views (address, dtype, shape, strides: a view
        checked by the step's first call, so not checked again), this B, by this transport (a
        poisoned one writes nothing, and its later calls fail) and in this graph capture (eager:
        none, and while no captured graph writes the mask); else (launch metadata writing it, what
        the mask will then describe), the mask forgotten until that launch is made."""
        capture = 0
        if self.device.type == "cuda" and (torch.cuda.current_device() != self.device.index
                                           or torch.cuda.is_current_stream_capturing()):
            capture = cudart.capture_id(torch.cuda.current_stream(self.device).cuda_stream)
        held = self._mask_for[channel]
        if held is not None and held[0] is step and (capture or not self._captured_masks[channel]) \
                and type(seq_lens) is torch.Tensor and type(query_start_loc) is torch.Tensor \
                and held[1] == (transport, B, capture, _view(seq_lens), _view(query_start_loc)):
            return held[2], None
        meta = metadata(self.device, seq_lens, query_start_loc, self._masks[channel], MASK_WRITE)
        self._mask_for[channel] = None
        self._captured_masks[channel] |= capture != 0
        return meta, (step, (transport, B, capture, _view(seq_lens), _view(query_start_loc)),
                      with_mask_mode(meta, MASK_READ))

    def all_gather_heads(self, q_local: torch.Tensor, out: Optional[torch.Tensor] = None, *,
                         channel: int = 0, check: Optional[bool] = None) -> torch.Tensor:
        """Gather every rank's query heads: ``[B, H/N, Dq]`` -> ``[B, H, Dq]``, rank r's at
        ``[:, r*H/N:(r+1)*H/N]``, bit for bit (a copy: no arithmetic, any query dtype).

        ``q_local`` may be strided in its token and head dimensions (last dimension contiguous);
        ``out`` (allocated unless given) may be a head-sliced view of a larger buffer
        (``buf[:, :H]``). The result is never a view of the shared buffers. Collective, like
        ``lse_reduce``, on the same channels and epochs: gathers and combines interleave freely.
        """
        if type(channel) is not int:
            channel = _as_index(channel)
        busy, transport = self._enter(channel, KIND_GATHER, q_local)
        try:
            try:
                B = gather_batch(self._query_geometry, q_local, out)
                y = out if out is not None else torch.empty((B, self.num_heads, self.query_dim),
                                                            dtype=self.query_dtype, device=self.device)
                q16, y16 = as_words("q_local", q_local), as_words("out", y)
                operands = gather_operands(q16, self._loader.scratch, y16)
                if out is not None and not gather_apart(B, self.heads_per_rank, self.num_heads,
                                                        self.config.query_words, operands):
                    refuse_overlap(_GATHER_NAMES, (q_local, out), 1)
                    refuse_self_overlap("out", out)
                if operands[0] not in self._loader.ready:
                    self._loader.load(KIND_GATHER, (q16, self._loader.scratch, y16), operands)
            except BaseException:
                self._announce(transport, channel, TAG_ABORT)
                raise
            self._launches(transport, KIND_GATHER, operands, q16, self._loader.scratch, y16, None, B, channel, True)
        finally:
            busy.release()
        if check if check is not None else self.check_calls:
            self._checked(channel)
        return y

    def _checked(self, channel: int) -> None:
        """A call's ``check``: wait for the call and raise its failure."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        error = self._device_error(channel)  # this call's own failure (or the first before it)
        if error is not None:
            raise error

    def _enter(self, channel, kind: int, first) -> tuple:
        """Take the channel for this call and pick its transport (by ``first``'s B and whether the
        channel's last call was a gather: every rank routes a call of one size alike), or raise:
        closed, busy, or poisoned by a failed call. A call rejected later announces itself on that
        transport: where its B is the peers', theirs."""
        if self._closed:
            self._check_open()
        if type(channel) is not int or not 0 <= channel < self.channels:
            # Which channel the peers use is unknown: none of them can be trusted to be in step.
            for c in range(self.channels):
                self._poison(c, f"a call named channel {channel!r}, which does not exist")
            raise ValueError(f"channel: expected an integer in [0, {self.channels}), got {channel!r}")
        busy = self._busy[channel]
        if not busy.acquire(False):  # (positional: a keyword costs a C call more time)
            self._check_open()
            # The call in flight keeps the channel; this one is lost, so the ranks' call counts differ.
            self._poison(channel, f"two threads called on channel {channel} at once")
            raise DcpError(f"channel {channel} is busy: another thread of this process is inside a call on "
                           f"it (calls that may run concurrently need channels of their own); {POISONED_NOTE}")
        transport = self._only or self._route(kind, first, channel)
        if channel in self._host_poison or self._device_error(channel) is not None:
            error = self._channel_error(channel)
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

    def _route(self, kind: int, first, channel: int) -> object:
        """The plan's transport for a call whose first argument is ``first`` (by its B); a combine
        right after a gather on the channel (a layer) takes the layer's, any other its own. Every
        rank makes the same calls on a channel, of the same kinds (a rejected one, whatever its B,
        announces itself), so every rank routes alike. Never raises: the caller holds the channel."""
        after_gather, self._after_gather[channel] = self._after_gather[channel], kind == KIND_GATHER
        routes = self._routes[kind] if kind == KIND_GATHER or after_gather else self._alone
        try:
            return routes[min(first.shape[0], self.max_tokens)]
        except Exception:  # no first dimension (not a tensor, or 0-d): rejected later, on the smallest calls' route
            return routes[1]

    def _device_error(self, channel: int) -> Optional[DcpError]:
        """The first recorded failure of a channel in any transport in use (host reads)."""
        if self._only is not None:
            return self._only.error(channel)
        return next((e for e in (t.error(channel) for t in self._transports.values()) if e is not None), None)

    def _announce(self, transport, channel: int, tag: int) -> None:
        """A call that moves no data (``Transport.announce``). If even that cannot launch, or the
        transport cannot announce (``by_group_order``), the channel is poisoned here, and its next
        call announces it (never raises)."""
        if transport.by_group_order:
            self._poison(channel, f"a call on channel {channel} was rejected on this rank, and on the NCCL path, "
                                  "whose calls pair by the group's order, the peers cannot be told")
            return
        try:
            transport.announce(channel, tag)
        except Exception as exc:  # the caller raises its own error
            self._poison(channel, f"a call could not announce itself to the peers ({exc})")

    def _poison(self, channel: int, why: str) -> None:
        """Poison a channel on this host (its first failure is kept); on a transport whose calls pair
        by the group's order, every channel: this rank's next call on any would pair with the peers'
        call that this one skipped."""
        for c in range(self.channels) if self._by_group_order else (channel,):
            self._host_poison.setdefault(c, why)

    def _launches(self, transport, kind: int, operands: tuple, po, lse, y, y_lse, B: int, channel: int,
                  base_e: bool, meta=None) -> None:
        """The call's launches: one up to max_tokens, else one per chunk of max_tokens, all with the
        call's tag. A failure between them leaves the ranks out of step: the channel is poisoned.
        (The gather's ``lse`` is the scratch word: it is not sliced.)"""
        tag = call_tag(kind, B, not base_e)
        try:
            if B <= self.max_tokens:
                transport.launch(operands, po, lse, y, y_lse, B, tag, channel, base_e, meta)
                return
            for b0 in range(0, B, self.max_tokens):
                b1 = min(B, b0 + self.max_tokens)
                chunk = (po[b0:b1], lse if kind == KIND_GATHER else lse[b0:b1], y[b0:b1],
                         None if y_lse is None else y_lse[b0:b1])
                # The call's variant and strides, the chunk's addresses.
                at = (gather_operands(*chunk[:3]) if kind == KIND_GATHER else launch_operands(*chunk))[2]
                transport.launch((*operands[:2], at), *chunk, b1 - b0, tag, channel, base_e, meta, b0)
        except BaseException as exc:
            self._poison(channel, f"a call failed between its launches ({type(exc).__name__})")
            raise

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
        self._watchdog = Watchdog(self.channels, self._channel_error, interval_s, on_error)

    def stop_watchdog(self) -> None:
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.stop()

    def trace(self, channel: int = 0) -> torch.Tensor:
        """The last traced calls of a channel (``DCP_A2A_TRACE=1``), ordered by epoch.

        int64 ``[calls, programs, 5]``: epoch, then device times (ns, ``%globaltimer``) at which
        each program started, had published its tiles, had seen all of its tiles arrive, and had
        combined them. Programs that did not run are zero. Synchronizes the device.
        """
        self._check_open()
        if not self.tracing or not hasattr(self._transport, "trace_records"):
            raise DcpError("tracing is off: construct with DCP_A2A_TRACE=1 and the triton backend")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self._transport.trace_records(channel)

    def tiling(self, n_tokens: int, gather: bool = False) -> tuple:
        """(warps per program, programmatic dependent launch) of the launches of a combine (or,
        with ``gather``, a query all-gather) of ``n_tokens`` tokens; a call above ``max_tokens``
        runs in launches of ``max_tokens``. (The transports share their tilings, so the route of the
        call does not matter here.)"""
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
            self._mask_for = []  # (a step's objects are not kept alive past the communicator)
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
