"""Transports behind ``DcpAllToAll``: the fused Triton push (``triton``) and the NCCL reference path.

Both own all of their memory from construction on and run the same packing and combine code, so
they give the same results; only how packed rows reach their destination differs.
"""

import ctypes
import threading
from typing import Optional

import torch
import torch.distributed as dist
from triton import knobs
from triton.runtime import driver

from dcp.kernels import (CTL_STATUS, CTL_WORDS, EPOCH_STRIDE, KIND_COMBINE, KIND_GATHER, STATUS_WORDS, TAG_KIND_SHIFT,
                     TAG_LOAD, TRACE_CALLS, TRACE_PROGRAMS, TRACE_WORDS, build_kernels)
from dcp import cudart
from dcp.buffers import SymmetricRegion, provider_for
from dcp.errors import DcpError, DcpPeerLostError
from dcp.protocol import SMALL_CALL_WARPS, ChannelLayout, ChannelRegion, status_error, status_words

_LOG2E = 1.4426950408889634
# torch 2.13 renames the group all-gather into one tensor; older releases have only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_data_ptr = torch.Tensor.data_ptr
# Triton's interpreter patches its language module while a kernel runs: one kernel at a time per
# process. A second thread's launch is refused rather than queued: it could wait behind a call
# that is itself waiting for that launch's peers.
_INTERPRETER = threading.Lock()


# The fused kernel's transports, as ``DcpAllToAll.backend`` names them: the push and the pull.
FUSED_TRANSPORTS = ("triton", "pull")


def compile_options(warps: int, pdl: bool = False) -> dict:
    """Triton's options for a kernel of ``warps`` warps. ``maxnreg``: without a register limit
    ptxas aimed some variants at 40 registers and spilled (docs/design.md, section 5.9); this one
    still lets one program fill an SM. FP fusion is stated, not left to a default that changes
    with the Triton version."""
    return dict(num_warps=warps, launch_pdl=pdl, maxnreg=min(255, 65536 // (32 * warps)), enable_fp_fusion=True)


def fused_variants(layouts: dict, region: ChannelRegion, gpu_scope: bool, trace: bool, pdl: bool,
                   pull: bool = False) -> dict:
    """(kind, warps) -> (constexprs, options) of every fused-kernel tiling a communicator loads
    (``layouts``: kind -> ChannelLayout on ``region``); ``pdl``: where the GPU has it; ``pull``:
    the pull transport's variants."""
    variants = {}
    for kind, layout in layouts.items():
        for w in layout.tilings:
            early = pdl and layout.launches_early(w)
            variants[kind, w] = (dict(region.constexprs(layout, w), GPU_SCOPE=gpu_scope, TRACE=trace, PDL=early,
                                      PULL=pull),
                                 compile_options(w, early))
    return variants


def no_metadata(device: torch.device) -> tuple:
    """The launch arguments of a call without vLLM's batch metadata: (seq_lens, query_start_loc,
    num_seqs = -1, their strides, first token); the pointers are never read."""
    word = torch.zeros(1, dtype=torch.int32, device=device)
    return (word, word, -1, 1, 1, 0)


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set (a chain of hooks, or one callable in older versions)."""
    return bool(getattr(hook, "calls", hook))


class _Launcher:
    """Launches one kernel; on CUDA through the compiled variant's own launcher once it is loaded.

    Triton's JIT entry point rebinds the arguments, recomputes the specialization key and rechecks
    the kernel's globals on every launch (it was most of an eager call's host time,
    ``python -m bench.host_time``); its compiled-kernel handle still looks up the device and stream,
    builds launch metadata and asks the driver about every tensor pointer. A loaded variant needs
    none of that: it is launched with the pointers as integers on the stream of ``device``, by the
    launcher's C entry point where the kernel needs no scratch memory (Triton 3.6's Python wrapper
    around it only allocates scratch). ``variant`` must determine everything Triton specializes on
    (``dcp.checks.launch_operands``; its second field says whether rows are 16-byte aligned). On CPU
    tensors the interpreter runs the kernel. With a launch hook set (profilers), Triton's handle
    launches it, so the hooks run.
    """

    def __init__(self, kernel, device: torch.device, constexprs: dict, options: dict):
        self.kernel, self.cuda, self.constexprs, self.options = kernel, device.type == "cuda", constexprs, options
        self.index = device.index
        self.raw_stream = driver.active.get_current_stream if self.cuda else None
        # variant -> (compiled kernel, launch entry, its arguments before the kernel's, constexpr values)
        self.compiled: dict = {}

    def __call__(self, variant: tuple, grid: int, tensors: tuple, *scalars) -> None:
        """``tensors``: the pointer arguments, first in the kernel's order; ``scalars``: the rest."""
        hit = self.compiled.get(variant)  # (never on CPU)
        if hit is not None:
            compiled, entry, head, consts = hit
            if not (_hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)):
                entry(grid, 1, 1, self.raw_stream(self.index), compiled.function, *head,
                      *map(_data_ptr, tensors), *scalars, *consts)
            else:
                compiled[(grid, 1, 1)](*tensors, *scalars, *consts)
            return
        kwargs = dict(self.constexprs, ALIGNED=variant[1])
        if not self.cuda:
            if not _INTERPRETER.acquire(blocking=False):
                raise DcpError("another thread of this process is running a call on the CPU: Triton's "
                               "interpreter runs one kernel at a time, so CPU calls cannot run concurrently")
            import numpy as np  # (here: Triton's interpreter needs it; the GPU path and the doctor do not)

            try:
                with np.errstate(all="ignore"):  # the interpreter also evaluates masked-off lanes
                    self.kernel[(grid,)](*tensors, *scalars, num_warps=self.options["num_warps"], **kwargs)
            finally:
                _INTERPRETER.release()
            return
        compiled = self.kernel[(grid,)](*tensors, *scalars, **self.options, **kwargs)
        # The launchers take every parameter in order; they ignore the constexprs' values.
        n_args = len(tensors) + len(scalars)
        consts = tuple(kwargs[name] for name in self.kernel.arg_names[n_args:])
        run, tail = compiled.run, (compiled.packed_metadata, None, None, None)  # launch metadata, hooks
        if getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0:
            self.compiled[variant] = (compiled, run.launch, (run.launch_cooperative_grid, run.launch_pdl, None, None)
                                      + tail, consts)
        else:
            self.compiled[variant] = (compiled, run, tail, consts)


class TritonTransport:
    """One fused kernel per call on the ranks' symmetric buffers (docs/design.md, section 2): it
    pushes packed rows into peers' buffers (``triton``, the push), or stages them in its own and
    each rank reads its rows from its peers' (``pull``: for fabrics where peer writes collapse)."""

    def __init__(self, group: dist.ProcessGroup, layouts: dict, region: ChannelRegion, device: torch.device,
                 channels: int, timeout_s: float, max_programs: int, gpu_scope: bool, trace: bool, pdl: bool,
                 pull: bool = False):
        """``layouts``: kind (KIND_COMBINE, KIND_GATHER) -> its ChannelLayout on ``region``."""
        self.name = "pull" if pull else "triton"
        self.group, self.layout, self.region, self.device = group, layouts[KIND_COMBINE], region, device
        self.rank = dist.get_rank(group)
        self.no_meta = no_metadata(device)
        kernel = build_kernels(interpret=device.type == "cpu").fused
        # (kind, warps) -> its launcher; by kind, by call size (index B - 1 for B = 1 to max_tokens):
        # its tiling's launcher and its grid, at most ``max_programs`` (all of them resident at once)
        # and never more than tiles.
        self.fused = {key: _Launcher(kernel, device, constexprs, options) for key, (constexprs, options)
                      in fused_variants(layouts, region, gpu_scope, trace, pdl, pull).items()}
        self.plan = {}
        for kind, layout in layouts.items():
            self.plan[kind] = [(self.fused[kind, w], min(layout.tiles(n, w), max_programs, EPOCH_STRIDE))
                               for n, w in enumerate(layout.warps_by_size, 1)]
        self.tilings = tuple(self.fused)  # (kind, warps) pairs
        self.traces = [torch.zeros((TRACE_CALLS, TRACE_PROGRAMS, TRACE_WORDS), dtype=torch.int64, device=device)
                       for _ in range(channels if trace else 0)]
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
                words += [self.status_addr + 4 * STATUS_WORDS * c, int(timeout_s * 1e9),
                          self.traces[c].data_ptr() if self.traces else 0]
                self.ctl.append(torch.tensor(words[:CTL_WORDS], dtype=torch.int64, device=device))
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

    def launch(self, variant, strides, po, lse, y, y_lse, n_tokens, tag, channel, write_lse, base_e,
               meta=None, plan=None) -> None:
        """``strides``: the kernel's eight stride arguments (``dcp.checks.launch_operands``); ``tag``: the
        call's (``dcp.protocol.call_tag``), the same for every launch of one call; it picks the
        collective (announcements, which move no data, take the combine's). ``meta``: the batch
        metadata's launch arguments (``no_metadata``'s form; default none)."""
        fused, grid = plan or self.plan[tag >> TAG_KIND_SHIFT if tag >= 0 else KIND_COMBINE][max(n_tokens, 1) - 1]
        sl, qsl, num_seqs, s_sl, s_qsl, tok0 = meta or self.no_meta
        fused(variant, grid, (po, lse, y, y_lse, self.ctl[channel], sl, qsl), n_tokens, tag, self.rank, *strides,
              int(write_lse), _LOG2E if base_e else 1.0, tok0, num_seqs, s_sl, s_qsl)

    def tiling(self, n_tokens: int, kind: int = KIND_COMBINE) -> tuple:
        options = self.plan[kind][n_tokens - 1][0].options
        return options["num_warps"], options["launch_pdl"]

    def load(self, kind, variant, strides, po, lse, y, y_lse, tilings=None) -> None:
        """Compile and load a variant of one collective in each of its tilings (``tilings``: warps;
        default all), with launches that touch nothing. CPU tensors are interpreted: nothing to load."""
        if self.device.type == "cuda":
            for k, w in self.tilings:
                if k == kind and (tilings is None or w in tilings):
                    self.launch(variant, strides, po, lse, y, y_lse, 0, TAG_LOAD, 0, False, True,
                                plan=(self.fused[k, w], 1))

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
        self.regions, self.traces, self.status = [], [], []
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

    def __init__(self, group: dist.ProcessGroup, layouts: dict, device: torch.device, channels: int):
        self.group, self.layout, self.device = group, layouts[KIND_COMBINE], device
        self.gather_layout = gl = layouts[KIND_GATHER]
        self.no_meta = no_metadata(device)
        layout = self.layout
        kernels = build_kernels(interpret=device.type == "cpu")
        # One tiling: these kernels never wait, so size matters less.
        self.warps = warps = layout.num_warps or SMALL_CALL_WARPS
        self.tilings = ((KIND_COMBINE, warps),)
        # By call size (index B, 0 for a load-only launch): its grid and the int32 words it sends
        # (gloo has no int16).
        self.plan = [(max(1, layout.tiles(n, warps)), layout.world * n * layout.heads_per_rank * layout.row_elems // 2)
                     for n in range(layout.max_tokens + 1)]
        self.pack = _Launcher(kernels.pack, device, layout.tile_constexprs(warps), compile_options(warps))
        self.combine = _Launcher(kernels.combine, device, layout.tile_constexprs(warps), compile_options(warps))
        words = max(self.plan[-1][1], gl.world * gl.rows_max * gl.head_dim // 2)
        self.send = [torch.zeros(words, dtype=torch.int32, device=device) for _ in range(channels)]
        self.recv = [torch.zeros(words, dtype=torch.int32, device=device) for _ in range(channels)]
        # The group's first collectives set up its communicator: here, not inside a capture.
        try:
            dist.all_to_all_single(self.recv[0][:layout.world], self.send[0][:layout.world], group=group)
            _all_gather_single(self.recv[0][:layout.world], self.send[0][:1], group=group)
        except Exception as exc:
            raise DcpPeerLostError(f"NCCL path setup: the group's collectives failed ({type(exc).__name__}: {exc})")

    def launch(self, variant, strides, po, lse, y, y_lse, n_tokens, tag, channel, write_lse, base_e,
               meta=None) -> None:
        """``tag`` is not exchanged: this path pairs calls by the group's collective order."""
        if tag >= 0 and tag >> TAG_KIND_SHIFT == KIND_GATHER:
            self._gather(po, y, n_tokens, channel)
            return
        grid, used = self.plan[n_tokens]
        send, recv = self.send[channel][:used], self.recv[channel][:used]
        sl, qsl, num_seqs, s_sl, s_qsl, tok0 = meta or self.no_meta
        self.pack(variant, grid, (po, lse, send, sl, qsl), n_tokens, *strides[:4], tok0, num_seqs, s_sl, s_qsl)
        if n_tokens:
            dist.all_to_all_single(recv, send, group=self.group)
        self.combine(variant, grid, (recv, y, y_lse), n_tokens, *strides[4:], int(write_lse),
                     _LOG2E if base_e else 1.0)

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

    def load(self, kind, variant, strides, po, lse, y, y_lse, tilings=None) -> None:
        """Compile and load a combine variant with launches of no rows (and no exchange), in the one
        tiling there is. The gather runs no kernel of its own. CPU tensors are interpreted."""
        if self.device.type == "cuda" and kind == KIND_COMBINE:
            self.launch(variant, strides, po, lse, y, y_lse, 0, TAG_LOAD, 0, False, True)

    def error(self, channel: int) -> Optional[DcpError]:
        return None  # NCCL reports its own failures

    def memory_bytes(self) -> int:
        return 2 * self.send[0].numel() * 4

    def close(self) -> None:
        self.send, self.recv = [], []
