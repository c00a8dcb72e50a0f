"""How the kernels are launched: the order of each kernel's arguments, the operands read from a
call's tensors (``launch_operands``, ``gather_operands``: the variant Triton specializes on, the
stride arguments and the addresses; ``outputs_apart``, the quick overlap test on them), the batch
metadata's one shape (``Metadata``), Triton's options per tiling, and ``Launcher``, which launches a
loaded variant without Triton's per-launch overhead.

The argument order of each kernel is written here once (``FUSED_ARGS``, ``PACK_ARGS``,
``COMBINE_ARGS``; a test checks them against the kernels' signatures); each transport launches a
kernel from one place, in that order.
"""

import functools
import threading
from typing import NamedTuple, Optional

import torch
from triton import knobs
from triton.runtime import driver

from dcp.checks import META_DTYPES, rows_disjoint, unit_last_stride
from dcp.constants import KIND_GATHER, MASK_NONE
from dcp.errors import DcpError
from dcp.protocol import ChannelRegion

LOG2E = 1.4426950408889634
_tuple_new = tuple.__new__
_data_ptr = torch.Tensor.data_ptr
# Triton's interpreter patches its language module while a kernel runs: one kernel at a time per
# process. A second thread's launch is refused rather than queued: it could wait behind a call
# that is itself waiting for that launch's peers.
_INTERPRETER = threading.Lock()

# The kernels' runtime arguments, in order (tensors first; then the scalars).
STRIDES = ("s_po_b", "s_po_h", "s_lse_b", "s_lse_h", "s_y_b", "s_y_h", "s_yl_b", "s_yl_h")
META = ("tok0", "num_seqs", "s_sl", "s_qsl", "mask_mode")
FUSED_ARGS = ("po", "lse", "y", "y_lse", "ctl", "seq_lens", "qsl", "tmask", "n_tokens", "call_tag", "rank", *STRIDES,
              "write_lse", "log2_scale", *META)
PACK_ARGS = ("po", "lse", "send", "seq_lens", "qsl", "tmask", "n_tokens", *STRIDES[:4], *META)
COMBINE_ARGS = ("recv", "y", "y_lse", "n_tokens", *STRIDES[4:], "write_lse", "log2_scale")


class Metadata(NamedTuple):
    """vLLM's batch metadata as launch arguments: int32 views and their element strides;
    ``num_seqs`` -1 where a call has none (then the pointers are never read). ``tmask``: a
    channel's empty-token mask (int8, one byte per token of the call), ``mask_mode`` whether the
    kernel writes it after its search (MASK_WRITE), reads it instead (MASK_READ) or neither."""
    seq_lens: torch.Tensor
    qsl: torch.Tensor
    num_seqs: int
    s_sl: int
    s_qsl: int
    tmask: torch.Tensor
    mask_mode: int


def no_metadata(device: torch.device) -> Metadata:
    """The launch arguments of a call without batch metadata."""
    word = torch.zeros(1, dtype=torch.int32, device=device)
    return Metadata(word, word, -1, 1, 1, word.view(torch.int8), MASK_NONE)


def metadata(device: torch.device, seq_lens, query_start_loc, tmask: torch.Tensor, mask_mode: int) -> Metadata:
    """vLLM's batch metadata as launch arguments (int32 views, element strides; ``tmask`` and
    ``mask_mode`` as they come), or raise as vLLM does for an inconsistent pair (and naming what
    else does not fit)."""
    if seq_lens is None or query_start_loc is None:
        raise ValueError("seq_lens and query_start_loc must be provided together")
    for name, t in (("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if seq_lens.dim() != 1 or query_start_loc.dim() != 1 or query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError("query_start_loc must contain one boundary per sequence")
    words = []
    for name, t in (("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.dtype not in META_DTYPES or t.device != device:
            raise TypeError(f"{name}: expected torch.int32 or torch.int64 on {device}, got {t.dtype} "
                            f"on {t.device}")
        if t.dtype == torch.int64:  # its low 32-bit words (little-endian), in place: no copy
            t = torch.empty(0, dtype=torch.int32, device=t.device).set_(
                t.untyped_storage(), 2 * t.storage_offset(), t.shape, (2 * t.stride(0),))
        words.append((t, t.stride(0)))
    (sl, s_sl), (qsl, s_qsl) = words
    return _tuple_new(Metadata, (sl, qsl, seq_lens.shape[0], s_sl, s_qsl, tmask, mask_mode))  # (a fifth of Metadata(...)'s host time)


def with_mask_mode(meta: Metadata, mask_mode: int) -> Metadata:
    """``meta`` with another ``mask_mode`` (a third of ``_replace``'s host time)."""
    return _tuple_new(Metadata, (*meta[:6], mask_mode))


def launch_operands(po: torch.Tensor, lse: torch.Tensor, y: torch.Tensor, y_lse: Optional[torch.Tensor]) -> tuple:
    """A combine's operands ``(variant, strides, addresses)``: the variant, the eight stride
    arguments in ``STRIDES`` order and the four tensors' addresses (0 for a missing ``y_lse``), each
    tensor's strides and address read once. A launch passes these addresses for the tensors it
    launches (``y_lse``'s only where it writes one), so operands must be those tensors' (a chunk of a
    call has its own addresses, and the call's variant).

    The variant is everything Triton specializes a launch on: LSE dtype, 16-byte rows, pointer
    alignments. A pointer counts as aligned only if every token's row is, so that the chunks
    of a call with B > max_tokens share the variant of the whole call. Aligned row strides go
    to the kernel divided by 8, which proves their alignment to it. ``y_lse`` None: the LSE
    is not written (the kernel gets the scratch word and strides that are never used).
    """
    (po_b, po_h, po_d), (y_b, y_h, y_d), (l_b, l_h) = po.stride(), y.stride(), lse.stride()
    yl_b, yl_h = y_lse.stride() if y_lse is not None else (1, 1)
    if po_d != 1 or y_d != 1:
        unit_last_stride("partial_out", po, po_d)
        unit_last_stride("out", y, y_d)
    addresses = (po.data_ptr(), lse.data_ptr(), y.data_ptr(), y_lse.data_ptr() if y_lse is not None else 0)
    po_ok = po_b % 8 == 0 and addresses[0] % 16 == 0
    y_ok = y_b % 8 == 0 and addresses[2] % 16 == 0
    if po_ok and y_ok and po_h % 8 == 0 and y_h % 8 == 0:
        return ((lse.dtype, True, True, True), (po_b // 8, po_h // 8, l_b, l_h, y_b // 8, y_h // 8, yl_b, yl_h),
                addresses)
    return (lse.dtype, False, po_ok, y_ok), (po_b, po_h, l_b, l_h, y_b, y_h, yl_b, yl_h), addresses


def outputs_apart(geometry: tuple, B: int, operands: tuple) -> bool:
    """A quick test that a combine's outputs share no element with its inputs, each other or
    themselves: each output's rows clear each other (``dcp.checks.rows_disjoint``), and its address
    range (first to last element) misses the others' (from ``launch_operands``' strides and
    addresses and the checked shapes of ``geometry``, the communicator's (H/N, H, D, device,
    dtype)). False where they may share one: the exact checks (``dcp.checks.refuse_overlap``,
    ``refuse_self_overlap``) then decide."""
    if B == 0:
        return True
    hn, h, d, _, dtype = geometry
    (lse_dtype, aligned, _, _), (po_b, po_h, l_b, l_h, y_b, y_h, yl_b, yl_h), (po, lse, y, y_lse) = operands
    if aligned:  # (aligned row strides were divided by 8)
        po_b, po_h, y_b, y_h = 8 * po_b, 8 * po_h, 8 * y_b, 8 * y_h
    size = dtype.itemsize
    po_end = po + ((B - 1) * po_b + (h - 1) * po_h + d) * size
    lse_end = lse + ((B - 1) * l_b + (h - 1) * l_h + 1) * lse_dtype.itemsize
    y_end = y + ((B - 1) * y_b + (hn - 1) * y_h + d) * size
    apart = (y_end <= po or po_end <= y) and (y_end <= lse or lse_end <= y) and rows_disjoint(B, y_b, hn, y_h, d)
    if y_lse and apart:  # (float32)
        yl_end = y_lse + ((B - 1) * yl_b + (hn - 1) * yl_h + 1) * 4
        apart = rows_disjoint(B, yl_b, hn, yl_h, 1) and all(
            yl_end <= a or b <= y_lse for a, b in ((po, po_end), (lse, lse_end), (y, y_end)))
    return apart


def gather_apart(B: int, hn: int, h: int, words: int, operands: tuple) -> bool:
    """``outputs_apart`` for the gather, on its operands (16-bit words, ``words`` a row): ``out``'s
    rows clear each other and its address range misses ``q_local``'s. False where they may share
    one: the exact checks decide."""
    if B == 0:
        return True
    (_, aligned, _, _), (q_b, q_h, _, _, y_b, y_h, _, _), (q, _, y, _) = operands
    if aligned:  # (aligned row strides were divided by 8)
        q_b, q_h, y_b, y_h = 8 * q_b, 8 * q_h, 8 * y_b, 8 * y_h
    q_end = q + ((B - 1) * q_b + (hn - 1) * q_h + words) * 2
    y_end = y + ((B - 1) * y_b + (h - 1) * y_h + words) * 2
    return (y_end <= q or q_end <= y) and rows_disjoint(B, y_b, h, y_h, words)


def gather_operands(q16: torch.Tensor, lse: torch.Tensor, y16: torch.Tensor) -> tuple:
    """The gather's variant, stride arguments and addresses, as ``launch_operands`` (on the 16-bit
    word views; ``lse``: the unused word its launches pass)."""
    (q_b, q_h, _), (y_b, y_h, _) = q16.stride(), y16.stride()
    addresses = (q16.data_ptr(), lse.data_ptr(), y16.data_ptr(), 0)
    q_ok = q_b % 8 == 0 and addresses[0] % 16 == 0
    y_ok = y_b % 8 == 0 and addresses[2] % 16 == 0
    if q_ok and y_ok and q_h % 8 == 0 and y_h % 8 == 0:
        return (KIND_GATHER, True, True, True), (q_b // 8, q_h // 8, 0, 0, y_b // 8, y_h // 8, 0, 0), addresses
    return (KIND_GATHER, False, q_ok, y_ok), (q_b, q_h, 0, 0, y_b, y_h, 0, 0), addresses


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
                                 compile_options(layout.program_warps(w), early))
    return variants


def pointers(*tensors: torch.Tensor) -> tuple:
    """Pointer arguments as ``Launcher`` takes them: the tensors (for Triton's own launch paths)
    and their addresses (for the loaded variant's entry point)."""
    return tensors, tuple(map(_data_ptr, tensors))


def _hooked() -> bool:
    """Whether a Triton launch hook is set (each a chain of hooks, or one callable in older versions)."""
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter) or getattr(leave, "calls", leave))


class Launcher:
    """Launches one kernel; on CUDA through the compiled variant's own launcher once it is loaded.

    Triton's JIT entry point rebinds the arguments, recomputes the specialization key and rechecks
    the kernel's globals on every launch (it was most of an eager call's host time,
    ``python -m bench.host_time``); its compiled-kernel handle still looks up the device and stream,
    builds launch metadata and asks the driver about every tensor pointer. A loaded variant needs
    none of that: it is launched with the pointers as integers on the stream of ``device``, by the
    launcher's C entry point where the kernel needs no scratch memory (Triton 3.6's Python wrapper
    around it only allocates scratch). ``variant`` must determine everything Triton specializes on
    (``launch_operands``; its second field says whether rows are 16-byte aligned). On CPU
    tensors the interpreter runs the kernel. With a launch hook set (profilers), Triton's handle
    launches it, so the hooks run.
    """

    def __init__(self, kernel, device: torch.device, constexprs: dict, options: dict):
        self.kernel, self.cuda, self.constexprs, self.options = kernel, device.type == "cuda", constexprs, options
        self.index = device.index
        self.raw_stream = driver.active.get_current_stream if self.cuda else None
        # variant -> (compiled kernel, launch entry, its arguments before the kernel's, constexpr values)
        self.compiled: dict = {}

    def bound(self, variant: tuple, grid: int, tensors: tuple, addresses: tuple,
              *scalars) -> Optional[functools.partial]:
        """A launch of a loaded variant through the launcher's entry point, its arguments (stream
        too) read now: the floor of a launch from Python, for ``bench.host_time``. None where the
        variant is not loaded (never on CPU tensors: the interpreter runs them)."""
        hit = self.compiled.get(variant)
        if hit is None:
            return None
        compiled, entry, head, consts = hit
        return functools.partial(entry, grid, 1, 1, self.raw_stream(self.index), compiled.function, *head,
                                 *addresses, *scalars, *consts)

    def __call__(self, variant: tuple, grid: int, tensors: tuple, addresses: tuple, *scalars) -> None:
        """``tensors``: the pointer arguments, first in the kernel's order, and ``addresses`` theirs
        (read by the caller: ``pointers``, ``launch_operands``); ``scalars``: the rest."""
        hit = self.compiled.get(variant)  # (never on CPU)
        if hit is not None:
            compiled, entry, head, consts = hit
            if not _hooked():
                entry(grid, 1, 1, self.raw_stream(self.index), compiled.function, *head, *addresses, *scalars, *consts)
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
