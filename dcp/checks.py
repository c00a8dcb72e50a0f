"""What a call's arguments must be, and the errors that say what came instead: the geometry rules
the constructor agrees on, the tensor checks of a call, and the launch arguments read from them."""

from typing import Optional

import torch

from dcp.constants import TAG_MAX_TOKENS

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
    for name in dict.fromkeys(name for geometry in geometries for name in geometry):  # (an older release lacks some)
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

    The last dimension's stride is checked where strides are read (``dcp.launch.launch_operands``)."""
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


def refuse_overlap(names: tuple, tensors: tuple, n_inputs: int) -> None:
    """Outputs are written while other programs (and, chunk by chunk, later launches) still read
    the inputs: no output may share memory with an input or with another output. ``tensors`` (None
    where absent) are named by ``names``, the first ``n_inputs`` of them inputs. Two tensors whose
    spans meet count as sharing, whichever storage object holds each: the same bytes can come
    through several (``torch.from_numpy`` or DLPack twice, IPC handles, a workspace carved into
    tensors), and torch's own overlap test only compares views of one."""
    named = [(name, _span(t)) for name, t in zip(names, tensors) if t is not None]
    first_out = sum(1 for t in tensors[:n_inputs] if t is not None)
    for i in range(first_out, len(named)):
        a_name, (a0, a1) = named[i]
        for b_name, (b0, b1) in named[:i]:
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{a_name}: expected memory of its own, but it overlaps {b_name} (outputs "
                                 "must not share, or interleave with, the memory of inputs or other outputs)")


def rows_disjoint(n0: int, s0: int, n1: int, s1: int, width: int) -> bool:
    """A quick test that an output's rows (``width`` contiguous elements at ``i*s0 + j*s1``, for
    i < n0, j < n1) share no element: True where each dimension's stride clears everything inside
    the one of smaller stride; False where they may share one (``refuse_self_overlap`` decides)."""
    if n0 > 1 and n1 > 1:
        if s1 < s0:
            n0, s0, n1, s1 = n1, s1, n0, s0
        return s0 >= width and s1 >= (n0 - 1) * s0 + width
    return (n0 <= 1 or s0 >= width) and (n1 <= 1 or s1 >= width)


def refuse_self_overlap(name: str, t: torch.Tensor) -> None:
    """Raise where two elements of an output share memory (an expanded or overlapping view: tokens
    would write one row, and each would read back another's): the exact test, on the sorted starts
    of its rows (a contiguous last dimension is a row; otherwise each element)."""
    if t.numel() <= 1:
        return
    dims = list(zip(t.shape, t.stride()))
    width = dims.pop()[0] if dims[-1][1] == 1 else 1
    starts = torch.zeros(1, dtype=torch.int64)
    for n, st in dims:
        starts = (starts[:, None] + torch.arange(n, dtype=torch.int64) * st).flatten()
    starts = starts.sort().values
    if bool((starts[1:] - starts[:-1] < width).any()):
        raise ValueError(f"{name}: expected memory of its own, but its elements overlap each other (strides "
                         f"{tuple(t.stride())} for shape {_shape(t)}: several tokens or heads would write one place)")


def combine_batch(geometry: tuple, po, lse, out, out_lse) -> int:
    """A combine's B, or raise naming the argument that does not fit (``geometry``: the
    communicator's (H/N, H, D, device, dtype)).

    A well-formed call passes one test that reads each tensor's shape, dtype and device once
    (a third of an eager call's host time went to checking, ``python -m bench.host_time``);
    anything else, tensor subclasses included, goes through ``expect``, which names what was
    expected and what came."""
    hn, h, d, dev, dt = geometry
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


def gather_batch(geometry: tuple, q, out) -> int:
    """A gather's B, or raise naming the argument that does not fit (``geometry``: the
    communicator's (H/N, H, Dq, device, query dtype))."""
    hn, h, dq, dev, dt = geometry
    B = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 3 else "B"  # "B": raises below
    expect("q_local", q, (B, hn, dq), (dt,), dev)
    if out is not None:
        expect("out", out, (B, h, dq), (dt,), dev)
    if B > TAG_MAX_TOKENS:
        raise ValueError(f"q_local: expected at most {TAG_MAX_TOKENS} tokens per call; got {B}")
    return B
