"""What a call's arguments must be, and the errors that say what came instead: the geometry rules
the constructor agrees on, the tensor checks of a call, and the launch arguments read from them."""

from typing import Optional

import torch

from dcp.kernels import KIND_GATHER

LSE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
META_DTYPES = (torch.int32, torch.int64)
QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)
MAX_HEAD_DIM = 1024
# The dtype names the command lines take (python -m dcp.doctor, the benchmark): torch's own, or the
# short ones (bf16, fp16, fp32, fp8) read as torch's.
DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
               "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn",
                 "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
OUT_DTYPE_NAMES = [name for name, t in DTYPE_NAMES.items() if t in OUT_DTYPES]


def dtype_name(text: str) -> str:
    """A command line's dtype name as torch spells it (``bf16``: ``bfloat16``); argparse's choices
    refuse what is neither."""
    return DTYPE_ALIASES.get(text, text)


def combine_geometry_error(world: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> Optional[str]:
    """Why a combine of this geometry cannot be served (None: it can)."""
    if num_heads <= 0 or num_heads % world:
        return f"num_heads must be a positive multiple of the group size {world}; got {num_heads}"
    if head_dim <= 0 or head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"head_dim must be a positive multiple of 8 up to {MAX_HEAD_DIM}; got {head_dim}"
    if dtype not in OUT_DTYPES:
        return f"dtype must be torch.float16, torch.bfloat16 or torch.float32; got {dtype}"
    return None


def _ranks(ranks: list) -> str:
    """``rank 2``, ``ranks 0, 3``, ``ranks 1-7`` (runs of three or more as a range)."""
    runs: list = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(f"{a}-{b}" if b - a > 1 else f"{a}, {b}" if b > a else f"{a}" for a, b in runs)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def geometry_disagreement(geometries: list) -> str:
    """The constructor's error where ranks' geometries differ (per rank, a dict of the fields every
    rank's constructor must agree on): each field that differs, with the ranks that have each value,
    e.g. ``head_dim: rank 0 has 64, rank 1 has 128``."""
    parts = []
    for name in geometries[0]:
        by_value: dict = {}
        for rank, geometry in enumerate(geometries):
            by_value.setdefault(geometry.get(name), []).append(rank)
        if len(by_value) > 1:
            parts.append(f"{name}: " + ", ".join(f"{_ranks(ranks)} {'has' if len(ranks) == 1 else 'have'} {value}"
                                                 for value, ranks in by_value.items()))
    return ("ranks disagree on the DcpAllToAll geometry (every rank must construct it alike): "
            + ("; ".join(parts) or "no field differs"))


def query_geometry_error(query_dim: int, query_dtype: torch.dtype) -> Optional[str]:
    """Why a query all-gather of this geometry cannot be served (None: it can)."""
    if query_dtype not in QUERY_DTYPES:
        return f"query_dtype must be one of {', '.join(map(str, QUERY_DTYPES))}; got {query_dtype}"
    fp8 = query_dtype.itemsize == 1
    if query_dim <= 0 or query_dim % (16 if fp8 else 8) or query_dim > MAX_HEAD_DIM:
        return (f"query_dim must be a positive multiple of {16 if fp8 else 8} up to {MAX_HEAD_DIM}"
                + (" for fp8 queries (rows move as 16-byte aligned 16-bit words)" if fp8 else "")
                + f"; got {query_dim}")
    return None


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def expect(name: str, t, shape: tuple, dtypes: tuple, device: torch.device) -> None:
    """Accept ``t`` or raise naming what was expected and what came (messages built only then).

    The last dimension's stride is checked where strides are read (``launch_operands``)."""
    if isinstance(t, torch.Tensor) and t.shape == shape and t.dtype in dtypes and t.device == device:
        return
    want = "[" + ", ".join(str(s) for s in shape) + "]"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(shape):
        raise ValueError(f"{name}: expected {len(shape)} dimensions {want}, got shape {_shape(t)}")
    if t.shape != shape:
        raise ValueError(f"{name}: expected shape {want}, got {_shape(t)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    raise ValueError(f"{name}: expected device {device}, got {t.device}")


def _span(t: torch.Tensor) -> tuple:
    """[first, last) byte addresses a tensor's elements can touch."""
    if t.numel() == 0:
        return (0, 0)
    extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st > 0) + 1
    return (t.data_ptr(), t.data_ptr() + extent * t.element_size())


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two views of one allocation may share an element: their spans first, then torch's
    own check, which also refuses views that interleave without touching."""
    (a0, a1), (b0, b1) = _span(a), _span(b)
    if a0 >= b1 or b0 >= a1:
        return False
    return bool(torch._C._overlaps(a, b))


def as_words(name: str, t: torch.Tensor) -> torch.Tensor:
    """A query tensor as 16-bit words (what the gather moves), or raise naming it."""
    unit_last_stride(name, t, t.stride(-1))
    try:
        return t.view(torch.int16)
    except RuntimeError:
        raise ValueError(f"{name}: expected strides that are whole 16-bit words, got strides {tuple(t.stride())} "
                         f"of {t.dtype}") from None


def unit_last_stride(name: str, t: torch.Tensor, stride: int) -> None:
    if stride != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name}: expected a contiguous last dimension (stride 1), got strides {tuple(t.stride())}")


def launch_operands(po: torch.Tensor, lse: torch.Tensor, y: torch.Tensor, y_lse: Optional[torch.Tensor]) -> tuple:
    """The launch's variant and its eight stride arguments, each tensor's strides read once.

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
    po_ok = po_b % 8 == 0 and po.data_ptr() % 16 == 0
    y_ok = y_b % 8 == 0 and y.data_ptr() % 16 == 0
    if po_ok and y_ok and po_h % 8 == 0 and y_h % 8 == 0:
        return (lse.dtype, True, True, True), (po_b // 8, po_h // 8, l_b, l_h, y_b // 8, y_h // 8, yl_b, yl_h)
    return (lse.dtype, False, po_ok, y_ok), (po_b, po_h, l_b, l_h, y_b, y_h, yl_b, yl_h)

def gather_operands(q16: torch.Tensor, y16: torch.Tensor) -> tuple:
    """The gather's variant and stride arguments, as ``launch_operands`` (on the 16-bit word views)."""
    (q_b, q_h, _), (y_b, y_h, _) = q16.stride(), y16.stride()
    q_ok = q_b % 8 == 0 and q16.data_ptr() % 16 == 0
    y_ok = y_b % 8 == 0 and y16.data_ptr() % 16 == 0
    if q_ok and y_ok and q_h % 8 == 0 and y_h % 8 == 0:
        return (KIND_GATHER, True, True, True), (q_b // 8, q_h // 8, 0, 0, y_b // 8, y_h // 8, 0, 0)
    return (KIND_GATHER, False, q_ok, y_ok), (q_b, q_h, 0, 0, y_b, y_h, 0, 0)


def refuse_overlap(inputs: tuple, outputs: tuple) -> None:
    """Outputs are written while other programs (and, chunk by chunk, later launches) still read
    the inputs: no output may share memory with an input or with another output. Only views of
    one allocation can share it: each tensor's allocation is read once, and only tensors of one
    allocation are compared further (``overlaps``)."""
    named = [(name, t, t.untyped_storage().data_ptr()) for name, t in inputs + outputs if t is not None]
    bases = [base for _, _, base in named]
    if len(set(bases)) == len(bases):
        return  # every tensor has an allocation of its own
    first_out = sum(1 for _, t in inputs if t is not None)
    for i in range(first_out, len(named)):
        a_name, a, a_base = named[i]
        for b_name, b, b_base in named[:i]:
            if a_base == b_base and overlaps(a, b):
                raise ValueError(f"{a_name}: expected memory of its own, but it overlaps {b_name} (outputs "
                                 "must not share, or interleave with, the memory of inputs or other outputs)")


def metadata(device: torch.device, seq_lens, query_start_loc) -> tuple:
    """vLLM's batch metadata as launch arguments (int32 views, element strides), or raise as vLLM
    does for an inconsistent pair (and naming what else does not fit)."""
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
    return (sl, qsl, seq_lens.shape[0], s_sl, s_qsl)
