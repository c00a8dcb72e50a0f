"""Transports: how a call's packed rows reach their destinations, behind one interface
(``Transport``): the fused Triton kernel pushing into peers' buffers (``triton``) or pulling from
them (``pull``), and the NCCL reference path. ``build_transports`` is the construction step that
builds the ones a communicator may use.

Each owns all of its memory from construction on and runs the same packing and combine code, so
they give the same results; only how packed rows reach their destination differs.
"""

import ctypes
from typing import Optional, Protocol

import torch
import torch.distributed as dist

from dcp import cudart
from dcp.buffers import SymmetricRegion, provider_for
from dcp.config import Config, Group
from dcp.constants import (CTL_STATUS, CTL_WORDS, EPOCH_STRIDE, KIND_COMBINE, KIND_GATHER, MAX_PEERS, STATUS_WORDS,
                           TAG_KIND_SHIFT, TAG_LOAD, TRACE_CALLS, TRACE_PROGRAMS, TRACE_WORDS)
from dcp.errors import DcpError, DcpPeerLostError
from dcp.kernels import build_kernels
from dcp.launch import (LOG2E, Launcher, Metadata, compile_options, fused_variants, launch_operands, no_metadata,
                        pointers)
from dcp.protocol import SMALL_CALL_WARPS, ChannelRegion, status_error, status_words
from dcp.rendezvous import all_gather

# torch 2.13 renames the group all-gather into one tensor; older releases have only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Transport(Protocol):
    """What the communicator asks of a transport. ``tilings``: the (kind, warps) pairs it loads."""

    name: str
    provider: str
    tilings: tuple
    # Calls pair by the group's order, on any channel (NCCL's): nothing can be announced, and a
    # rank that skipped a call on one channel would pair its next call on any with the peers' skipped one.
    by_group_order: bool

    def launch(self, operands: tuple, po: torch.Tensor, lse: torch.Tensor, y: torch.Tensor,
               y_lse: Optional[torch.Tensor], n_tokens: int, tag: int, channel: int, base_e: bool,
               meta: Optional[Metadata] = None, tok0: int = 0) -> None:
        """One launch of a call: ``operands`` (``dcp.launch.launch_operands``' or
        ``gather_operands``' of this launch's own tensors: their addresses are the ones launched; a
        chunk of a call has its own), this launch's tensors and ``n_tokens``; ``tag`` the call's
        (``dcp.protocol.call_tag``: the same for every launch of one call); ``y_lse`` None: the LSE is
        not written; ``meta``: the batch metadata, ``tok0`` this launch's first token in the call."""

    def announce(self, channel: int, tag: int) -> None:
        """A call that moves no data (``tag``: TAG_ABORT or TAG_POISONED), so that the peers' call of
        the same epoch fails at once naming this rank, and every rank's epoch stays in step."""

    def load(self, kind: int, operands: tuple, po: torch.Tensor, lse: torch.Tensor, y: torch.Tensor,
             warps: Optional[tuple] = None) -> None:
        """Compile and load a variant of one collective in each of its tilings (``warps``: those only),
        with launches that touch nothing. CPU tensors are interpreted: nothing to load."""

    def tiling(self, n_tokens: int, kind: int) -> tuple:
        """(warps per program, programmatic dependent launch) of a launch of ``n_tokens``."""

    def error(self, channel: int) -> Optional[DcpError]:
        """The recorded failure of a channel (it then stays poisoned), or None. Reads host memory."""

    def memory_bytes(self) -> int:
        """Bytes of persistent buffers per channel."""

    def close(self) -> None:
        """Release every buffer (collective only in that peers must have stopped using them)."""


def _idle(config: Config) -> tuple:
    """A launch of no tokens for ``announce``: the well-aligned fp32-LSE variant, which every
    communicator loads, on tensors of one token that the kernel never reads."""
    dev = config.device
    po = torch.empty((1, config.num_heads, config.head_dim), dtype=config.dtype, device=dev)
    lse = torch.empty((1, config.num_heads), dtype=torch.float32, device=dev)
    y = torch.empty((1, config.heads_per_rank, config.head_dim), dtype=config.dtype, device=dev)
    return dict(operands=launch_operands(po, lse, y, None), po=po, lse=lse, y=y, y_lse=None, n_tokens=0,
                base_e=True)


class TritonTransport:
    """One fused kernel per call on the ranks' symmetric buffers (docs/design.md, section 2): it
    pushes packed rows into peers' buffers (``triton``, the push), or stages them in its own and
    each rank reads its rows from its peers' (``pull``: for fabrics where peer writes collapse)."""

    by_group_order = False

    def __init__(self, group: dist.ProcessGroup, config: Config, layouts: dict, region: ChannelRegion, *,
                 pull: bool = False):
        """``layouts``: kind (KIND_COMBINE, KIND_GATHER) -> its ChannelLayout on ``region``."""
        self.name = "pull" if pull else "triton"
        device, channels = config.device, config.channels
        self.group, self.layout, self.region, self.device = group, layouts[KIND_COMBINE], region, device
        self.rank = dist.get_rank(group)
        self.no_meta = no_metadata(device)
        self.scratch = torch.empty(1, dtype=torch.float32, device=device)  # the LSE output of calls without one
        self.scratch_at = self.scratch.data_ptr()
        kernel = build_kernels(interpret=device.type == "cpu").fused
        # (kind, warps) -> its launcher; by kind, by call size (index B - 1 for B = 1 to max_tokens):
        # its tiling's launcher and its grid: the agreed ``programs`` (all of them resident at once;
        # under ONE_WAIT a program waits for its own index only, which must have pushed the same
        # tiles on every rank), never more than tiles.
        self.fused = {key: Launcher(kernel, device, constexprs, options) for key, (constexprs, options)
                      in fused_variants(layouts, region, config.gpu_scope, config.tracing, config.pdl, pull).items()}
        self.by_size = {}
        for kind, layout in layouts.items():
            self.by_size[kind] = [(self.fused[kind, w], min(layout.tiles(n, w), config.programs, EPOCH_STRIDE))
                                  for n, w in enumerate(layout.warps_by_size, 1)]
        self.tilings = tuple(self.fused)  # (kind, warps) pairs
        self.traces = [torch.zeros((TRACE_CALLS, TRACE_PROGRAMS, TRACE_WORDS), dtype=torch.int64, device=device)
                       for _ in range(channels if config.tracing else 0)]
        self.idle = _idle(config)
        self.regions: list[SymmetricRegion] = []
        self.status_addr, self._status_keep = 0, None
        provider = provider_for(device)
        self.provider = provider.name
        try:
            for _ in range(channels):
                self.regions.append(provider.open(group, region.nbytes))
            self._alloc_status(channels)
            self.status = [status_words(self.status_addr + 4 * STATUS_WORDS * c) for c in range(channels)]
            self.ctl = []
            for c, region in enumerate(self.regions):
                words = list(region.peers) + [0] * (CTL_STATUS - self.layout.world)
                words += [self.status_addr + 4 * STATUS_WORDS * c, int(config.timeout_s * 1e9),
                          self.traces[c].data_ptr() if self.traces else 0]
                self.ctl.append(torch.tensor(words[:CTL_WORDS], dtype=torch.int64, device=device))
            # Per channel, the pointer arguments after a call's own tensors where it has no metadata.
            self.tails = [pointers(ctl, *self.no_meta[:2], self.no_meta.tmask) for ctl in self.ctl]
        except BaseException:
            self.close()
            raise

    def _alloc_status(self, channels: int) -> None:
        nbytes = 4 * STATUS_WORDS * channels
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                self.status_addr = cudart.host_alloc_mapped(nbytes)
        else:
            self._status_keep = ctypes.create_string_buffer(nbytes)
            self.status_addr = ctypes.addressof(self._status_keep)

    def launch(self, operands: tuple, po: torch.Tensor, lse: torch.Tensor, y: torch.Tensor,
               y_lse: Optional[torch.Tensor], n_tokens: int, tag: int, channel: int, base_e: bool,
               meta: Optional[Metadata] = None, tok0: int = 0, via: Optional[tuple] = None) -> None:
        """``Transport.launch``; the tag picks the collective (announcements, which move no data,
        take the combine's). ``via``: (launcher, grid) of one tiling, for loading it."""
        fused, grid = via or self.by_size[tag >> TAG_KIND_SHIFT if tag >= 0 else KIND_COMBINE][max(n_tokens, 1) - 1]
        if meta is None:  # (the channel's pointers and no_metadata's, read once)
            (tail, tail_at), (_, _, num_seqs, s_sl, s_qsl, _, mask_mode) = self.tails[channel], self.no_meta
        else:
            sl, qsl, num_seqs, s_sl, s_qsl, tmask, mask_mode = meta
            tail, tail_at = pointers(self.ctl[channel], sl, qsl, tmask)
        po_at, lse_at, y_at, y_lse_at = operands[2]
        # dcp.launch.FUSED_ARGS
        if y_lse is None:
            y_lse, y_lse_at = self.scratch, self.scratch_at
        fused(operands[0], grid, (po, lse, y, y_lse, *tail), (po_at, lse_at, y_at, y_lse_at, *tail_at), n_tokens, tag,
              self.rank, *operands[1], int(y_lse is not self.scratch), LOG2E if base_e else 1.0, tok0, num_seqs, s_sl,
              s_qsl, mask_mode)

    def announce(self, channel: int, tag: int) -> None:
        self.launch(**self.idle, tag=tag, channel=channel)

    def tiling(self, n_tokens: int, kind: int = KIND_COMBINE) -> tuple:
        options = self.by_size[kind][n_tokens - 1][0].options
        return options["num_warps"], options["launch_pdl"]

    def load(self, kind: int, operands: tuple, po: torch.Tensor, lse: torch.Tensor, y: torch.Tensor,
             warps: Optional[tuple] = None) -> None:
        if self.device.type == "cuda":
            for k, w in self.tilings:
                if k == kind and (warps is None or w in warps):
                    self.launch(operands=operands, po=po, lse=lse, y=y, y_lse=None, n_tokens=0, tag=TAG_LOAD,
                                channel=0, base_e=True, via=(self.fused[k, w], 1))

    def trace_records(self, channel: int) -> torch.Tensor:
        """The traced calls' records, by epoch: int64 [calls, programs, TRACE_WORDS]."""
        ring = self.traces[channel].cpu()
        order = torch.argsort(ring[:, 0, 0])
        ring = ring[order]
        return ring[ring[:, 0, 0] > 0]

    def error(self, channel: int) -> Optional[DcpError]:
        """The recorded failure of a channel (it then stays poisoned), or None. Reads host memory."""
        return status_error(self.status[channel], self.layout.world, self.rank, channel) \
            if self.status[channel][0] else None

    def poke_epoch(self, channel: int, epoch: int) -> None:
        """Set a channel's device epoch (tests of the wrap-around); every rank must do the same."""
        value = ctypes.c_uint32(epoch * EPOCH_STRIDE)
        addr = self.regions[channel].local
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                cudart.memcpy_htod(addr, ctypes.addressof(value), 4)
        else:
            ctypes.memmove(addr, ctypes.addressof(value), 4)

    def memory_bytes(self) -> int:
        return self.region.nbytes

    def close(self) -> None:
        for region in self.regions:
            region.close()
        self.regions, self.traces, self.status, self.idle = [], [], [], {}
        if self.status_addr and self.device.type == "cuda":
            cudart.free_host(self.status_addr)
        self.status_addr, self._status_keep = 0, None


class NcclTransport:
    """The reference path. Combine: pack kernel, the group's ``all_to_all_single``, combine kernel
    (three steps per call). Query all-gather: a copy into the send buffer, the group's
    ``all_gather_into_tensor``, a copy out in head order.

    Its send and receive buffers are allocated here, once, so capture allocates nothing either.
    On CPU the group's own collectives (gloo) serve.
    """

    name = "nccl"
    provider = "process-group"
    by_group_order = True

    def __init__(self, group: dist.ProcessGroup, config: Config, layouts: dict):
        device, channels = config.device, config.channels
        self.group, self.layout, self.device = group, layouts[KIND_COMBINE], device
        self.scratch = torch.empty(1, dtype=torch.float32, device=device)
        self.gather_layout = gl = layouts[KIND_GATHER]
        self.no_meta = no_metadata(device)
        layout = self.layout
        kernels = build_kernels(interpret=device.type == "cpu")
        # One tiling: these kernels never wait, so size matters less.
        self.warps = warps = layout.num_warps or SMALL_CALL_WARPS
        self.tilings = ((KIND_COMBINE, warps),)
        # By call size (index B, 0 for a load-only launch): its grid and the int32 words it sends
        # (gloo has no int16).
        self.by_size = [(max(1, layout.tiles(n, warps)),
                         layout.world * n * layout.heads_per_rank * layout.row_elems // 2)
                        for n in range(layout.max_tokens + 1)]
        self.pack = Launcher(kernels.pack, device, layout.tile_constexprs(warps), compile_options(warps))
        self.combine = Launcher(kernels.combine, device, layout.tile_constexprs(warps), compile_options(warps))
        words = max(self.by_size[-1][1], gl.world * gl.rows_max * gl.head_dim // 2)
        self.send = [torch.zeros(words, dtype=torch.int32, device=device) for _ in range(channels)]
        self.recv = [torch.zeros(words, dtype=torch.int32, device=device) for _ in range(channels)]
        # The group's first collectives set up its communicator: here, not inside a capture.
        try:
            dist.all_to_all_single(self.recv[0][:layout.world], self.send[0][:layout.world], group=group)
            _all_gather_single(self.recv[0][:layout.world], self.send[0][:1], group=group)
        except Exception as exc:
            raise DcpPeerLostError(f"NCCL path setup: the group's collectives failed ({type(exc).__name__}: {exc})")

    def launch(self, operands: tuple, po: torch.Tensor, lse: torch.Tensor, y: torch.Tensor,
               y_lse: Optional[torch.Tensor], n_tokens: int, tag: int, channel: int, base_e: bool,
               meta: Optional[Metadata] = None, tok0: int = 0) -> None:
        """``tag`` is not exchanged: this path pairs calls by the group's collective order."""
        if tag >= 0 and tag >> TAG_KIND_SHIFT == KIND_GATHER:
            self._gather(po, y, n_tokens, channel)
            return
        grid, used = self.by_size[n_tokens]
        send, recv = self.send[channel][:used], self.recv[channel][:used]
        sl, qsl, num_seqs, s_sl, s_qsl, tmask, mask_mode = meta or self.no_meta
        variant, strides, _ = operands
        # dcp.launch.PACK_ARGS, COMBINE_ARGS
        self.pack(variant, grid, *pointers(po, lse, send, sl, qsl, tmask), n_tokens, *strides[:4], tok0, num_seqs,
                  s_sl, s_qsl, mask_mode)
        if n_tokens:
            dist.all_to_all_single(recv, send, group=self.group)
        self.combine(variant, grid, *pointers(recv, y, self.scratch if y_lse is None else y_lse), n_tokens,
                     *strides[4:], int(y_lse is not None), LOG2E if base_e else 1.0)

    def announce(self, channel: int, tag: int) -> None:
        pass  # (by_group_order: the communicator poisons every channel instead)

    def _gather(self, q16: torch.Tensor, y16: torch.Tensor, n_tokens: int, channel: int) -> None:
        """``q16`` [B, H/N, W] and ``y16`` [B, H, W]: 16-bit words of the query rows."""
        if n_tokens == 0:
            return
        n, hn, w = self.gather_layout.world, self.gather_layout.heads_per_rank, self.gather_layout.head_dim
        words = n_tokens * hn * w // 2
        send, recv = self.send[channel][:words], self.recv[channel][:n * words]
        send.view(torch.int16).view(n_tokens, hn, w).copy_(q16)
        _all_gather_single(recv, send, group=self.group)
        y16.unflatten(1, (n, hn)).copy_(recv.view(torch.int16).view(n, n_tokens, hn, w).transpose(0, 1))

    def tiling(self, n_tokens: int, kind: int = KIND_COMBINE) -> tuple:
        return self.warps, False

    def load(self, kind: int, operands: tuple, po: torch.Tensor, lse: torch.Tensor, y: torch.Tensor,
             warps: Optional[tuple] = None) -> None:
        """A combine variant, with launches of no rows (and no exchange), in the one tiling there is.
        The gather runs no kernel of its own."""
        if self.device.type == "cuda" and kind == KIND_COMBINE:
            self.launch(operands=operands, po=po, lse=lse, y=y, y_lse=None, n_tokens=0, tag=TAG_LOAD, channel=0,
                        base_e=True)

    def error(self, channel: int) -> Optional[DcpError]:
        return None  # NCCL reports its own failures

    def memory_bytes(self) -> int:
        return 2 * self.send[0].numel() * 4

    def close(self) -> None:
        self.send, self.recv = [], []


# The fused kernel's transports, as ``DcpAllToAll.backend`` names them: the push and the pull.
FUSED_TRANSPORTS = ("triton", "pull")


def build_transports(group: dist.ProcessGroup, config: Config, facts: Group, layouts: dict,
                     region: ChannelRegion) -> tuple:
    """Collective: build the transport(s) every rank agrees on: the one requested, or for ``auto``
    the fused ones to measure (the push alone where measuring is off), ``nccl`` where none can
    serve. Returns ``({name: transport}, why, {candidate left out: why})``.

    The NCCL path is never one of ``auto``'s candidates: it pairs calls by the group's order, so
    a call one rank rejects would pair its peers' call with that rank's next one, and its waits
    are NCCL's, not ``timeout_s`` (docs/design.md, section 5.11)."""
    requested = config.backend
    obstacle = _fused_obstacle(config, facts.hosts)
    if requested == "auto" and obstacle is None:
        views = all_gather(group, _p2p_obstacle(config.device, facts.devices))
        obstacle = next((v for v in views if v), None)
    if requested in FUSED_TRANSPORTS and obstacle is not None:
        raise DcpError(f"backend={requested!r} cannot serve this group: {obstacle}")
    measuring = requested == "auto" and obstacle is None and config.measures
    if requested in FUSED_TRANSPORTS:
        fused = [requested]
    elif requested == "auto" and obstacle is None:
        fused = list(FUSED_TRANSPORTS) if measuring else ["triton"]
    else:
        fused = []
    transports, left_out = {}, {}
    reason = "requested" if requested != "auto" else obstacle
    try:
        for name in fused:
            try:
                transports[name] = TritonTransport(group, config, layouts, region, pull=name == "pull")
            except DcpError as exc:  # raised on every rank alike: the fallback is collective too
                if requested in FUSED_TRANSPORTS or isinstance(exc, DcpPeerLostError):
                    raise
                reason = left_out[name] = f"buffer setup failed: {exc}"
        if requested == "auto" and transports:
            reason = "every rank reaches every peer's buffer"
            if not measuring:
                why = "DCP_A2A_MEASURE=0" if config.device.type == "cuda" else "Triton's interpreter on the CPU"
                reason += f" (not measured: {why})"
            else:  # (where both were built, the measurement says what it chose)
                reason += "".join(f"; {name} left out: {why}" for name, why in left_out.items())
        if not transports:
            transports["nccl"] = NcclTransport(group, config, layouts)
    except BaseException:
        for transport in transports.values():
            transport.close()
        raise
    return transports, reason, left_out


def _fused_obstacle(config: Config, hosts: tuple) -> Optional[str]:
    """Why the fused kernel cannot serve this group, as every rank sees it (None: it can)."""
    if len(set(hosts)) > 1:
        return f"ranks are on {len(set(hosts))} hosts"
    if config.world > MAX_PEERS:
        return f"the group has {config.world} ranks; the triton path serves up to {MAX_PEERS}"
    return None


def _p2p_obstacle(device: torch.device, devices: tuple) -> Optional[str]:
    """This rank's view: can its GPU reach every other GPU of the group (peer access)?"""
    if device.type != "cuda":
        return None
    for other in set(devices) - {device.index}:
        if not torch.cuda.can_device_access_peer(device.index, other):
            return f"GPU {device.index} has no peer access to GPU {other}"
    return None
