"""Rank functions for the vLLM integration: the drop-ins, and the plugin inside a stand-in vLLM
(``tests/standin_vllm``) that mirrors the module paths and call sites of vLLM 0.33.0 and of the
older ``dcp_alltoall.py`` lineage."""

import atexit
import functools
import importlib
import importlib.metadata
import logging
import os
import shutil
import sys
import tempfile
import types
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from dcp import DcpAllToAll
from dcp import serving
from dcp import vllm as dropin
from dcp.reference import chunk_reference, make_inputs, make_queries, mask_by_metadata, max_rel_error
from tests.rank_cases import DTYPES, TOL

STANDIN = Path(__file__).parent / "standin_vllm"
# Sequences of a batch of 11 rows: 9 real tokens in 4 sequences (one of 3 tokens: speculative
# decoding), rows 9 and 10 are graph padding. max_tokens 8: the call runs in two launches.
QUERY_START_LOC = [0, 3, 4, 7, 9]
B, MAX_TOKENS = 11, 8


class FakeCoordinator:
    """The least of vLLM's GroupCoordinator that the drop-in needs: ``world_size`` and ``device_group``."""

    def __init__(self):
        self.device_group = dist.group.WORLD
        self.world_size = dist.get_world_size()


def vllm_dropin(state, seed: int, device: str = "cpu") -> float:
    """The drop-in against the reference, through a fake coordinator: return_lse, base 2, B=0."""
    coord = FakeCoordinator()
    n, rank = coord.world_size, dist.get_rank()
    H, D = 4 * n, 32
    worst = 0.0
    dropin.communicator(coord, H, D, torch.bfloat16, device)
    for i, (B, base_e, ret) in enumerate([(1, True, False), (5, False, True), (300, True, True)]):
        outs, lses = make_inputs(seed + i, n, B, H, D, torch.bfloat16, special=True)
        res = dropin.dcp_a2a_lse_reduce(outs[rank].to(device), lses[rank].to(device), coord,
                                        return_lse=ret, is_lse_base_on_e=base_e)
        y, yl = res if ret else (res, None)
        ref, ref_lse = chunk_reference(outs, lses, rank, H // n, base_e)
        err = max_rel_error(y, ref)
        assert err <= TOL[torch.bfloat16], err
        if ret:
            assert torch.equal(torch.isneginf(yl.cpu()), torch.isneginf(ref_lse))
        worst = max(worst, err)
    empty = dropin.dcp_a2a_lse_reduce(torch.empty(0, H, D, dtype=torch.bfloat16, device=device),
                                      torch.empty(0, H, device=device), dist.group.WORLD)
    assert empty.shape == (0, H // n, D)
    dropin.close_all()
    return worst


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def entry_point(group: str = "vllm.general_plugins", target: str = "dcp.vllm_plugin:register") -> None:
    """Frameworks find plugins by entry point: where this checkout is not installed (``PYTHONPATH=.``),
    a metadata folder of our own declares the same one (``pyproject.toml``'s)."""
    if any(e.name == "dcp_a2a" for e in importlib.metadata.entry_points(group=group)):
        return
    root = tempfile.mkdtemp(prefix="dcp-ep-")
    atexit.register(shutil.rmtree, root, True)
    info = Path(root) / "dcp_a2a_standin-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dcp-a2a-standin\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\ndcp_a2a = {target}\n")
    sys.path.append(root)
    importlib.invalidate_caches()


def _fresh_vllm(lineage: str, enabled: bool, before_plugins: tuple = ()) -> tuple:
    """A fresh stand-in vLLM of ``lineage`` in this process, its DCP group the world, its plugins
    loaded (our entry point among them) as a vLLM worker loads them; ``before_plugins``: modules
    imported first. Returns (vllm, the log lines of ``dcp`` and ``vllm.dcp_a2a``)."""
    dropin.close_all()
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]
    if str(STANDIN) not in sys.path:
        sys.path.insert(0, str(STANDIN))
    os.environ["STANDIN_VLLM_LINEAGE"] = lineage
    os.environ["DCP_A2A_VLLM"] = "1" if enabled else "0"
    os.environ.pop("VLLM_PLUGINS", None)
    entry_point()
    records = Records()
    for name in ("dcp", "vllm.dcp_a2a"):
        logging.getLogger(name).addHandler(records)
        logging.getLogger(name).setLevel(logging.INFO)
    import vllm
    import vllm.plugins
    from vllm.distributed.parallel_state import init_dcp_group

    init_dcp_group(dist.group.WORLD)
    for name in before_plugins:
        importlib.import_module(name)
    vllm.plugins.load_general_plugins()
    return vllm, records.lines


def _batch(seed: int, n: int, H: int, D: int, dtype) -> tuple:
    """Every rank's partials and its local seq_lens (some 0: an empty shard), from one seed."""
    outs, lses = make_inputs(seed, n, B, H, D, dtype, special=True)
    g = torch.Generator().manual_seed(seed + 1)
    seq_lens = [torch.randint(0, 3, (len(QUERY_START_LOC) - 1,), generator=g, dtype=torch.int32) for _ in range(n)]
    return outs, lses, seq_lens


def _reference(outs, lses, seq_lens, rank: int, hn: int, base_e: bool = True):
    qsl = torch.tensor(QUERY_START_LOC)
    masked = [mask_by_metadata(l, s, qsl) for l, s in zip(lses, seq_lens)]
    return chunk_reference(outs, masked, rank, hn, base_e)


def current_lineage(state, seed: int, enabled: bool, dtype: str = "bfloat16",
                    query_dtype: str = "bfloat16", comm_backend: str = "a2a") -> dict:
    """vLLM 0.33.0's MLA layer over the stand-in: its manager's query gather and combine (with
    seq_lens masking, padding rows, chunks), and the module's ``dcp_a2a_lse_reduce`` as the
    non-MLA backends call it (base 2, ``return_lse``). With the plugin on, none of vLLM's own
    transports may run; off, vLLM's own serve and nothing of ours is built."""
    vllm, lines = _fresh_vllm("current", enabled)
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.v1.attention.ops import dcp as vdcp

    n, rank = dist.get_world_size(), dist.get_rank()
    hn, d_lora, d_rope = 2, 16, 16
    dt, qdt = DTYPES[dtype], getattr(torch, query_dtype)
    padded = n * hn + 2
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(dcp_comm_backend=comm_backend),
                                   max_num_tokens=MAX_TOKENS)
    layers = [MLAAttention(config, "cpu", hn, d_lora, d_rope, dt, qdt, padded) for _ in range(2)]
    built = dict(vllm.CALLS)
    outs, lses, seq_lens = _batch(seed, n, n * hn, d_lora, dt)
    queries = make_queries(seed + 2, n, B, hn, d_lora + d_rope, qdt)
    qsl = torch.tensor(QUERY_START_LOC, dtype=torch.int32)
    worst = 0.0
    for layer in layers:
        q_local = torch.full((B, hn + 1, d_lora + d_rope), float("nan"), dtype=torch.float32).to(qdt)[:, :hn]
        q_local.copy_(queries[rank])  # head-strided, as a slice of a larger projection
        q, y = layer.dcp_decode(q_local, outs[rank], lses[rank], seq_lens[rank], qsl)
        want = torch.cat(queries, dim=1)
        assert q.shape == want.shape and torch.equal(q.view(torch.uint8), want.view(torch.uint8)), "gather not exact"
        assert q.is_contiguous() and q.untyped_storage().nbytes() >= B * padded * (d_lora + d_rope) * qdt.itemsize, \
            "query storage not reserved for the padded heads"
        ref, _ = _reference(outs, lses, seq_lens, rank, hn)
        assert y.shape == (B, hn, d_lora) and y.dtype == dt
        err = max_rel_error(y, ref)
        assert err <= TOL[dt], f"combine error {err}"
        worst = max(worst, err)
    # The module-level function, as flash_attn/flashinfer call it: group positional, base 2, with LSE.
    lse2 = [l / 0.6931471805599453 for l in lses]
    y, yl = vdcp.dcp_a2a_lse_reduce(outs[rank], lse2[rank], vdcp.get_dcp_group(), return_lse=True,
                                    is_lse_base_on_e=False, seq_lens=seq_lens[rank], query_start_loc=qsl)
    ref, ref_lse = _reference(outs, lse2, seq_lens, rank, hn, base_e=False)
    assert max_rel_error(y, ref) <= TOL[dt]
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(yl), torch.isneginf(ref_lse))
    assert (yl.double()[fin] - ref_lse[fin]).abs().max() <= 1e-4 * (1 + ref_lse[fin].abs().max())
    result = {"err": worst, "vllm_calls_at_build": built, "vllm_calls": dict(vllm.CALLS),
              "communicators": len(serving._comms), "log": lines}
    dropin.close_all()
    return result


def unlike_declared(state, seed: int) -> dict:
    """Calls unlike what the manager declared (a backend whose output is bf16 in an fp16 model, an
    fp8 decode query where the model dtype was declared): vLLM's own serves them, on every rank."""
    vllm, lines = _fresh_vllm("current", True)
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    n, rank = dist.get_world_size(), dist.get_rank()
    hn, d_lora, d_rope = 2, 16, 16
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(dcp_comm_backend="a2a"),
                                   max_num_tokens=MAX_TOKENS)
    layer = MLAAttention(config, "cpu", hn, d_lora, d_rope, torch.float16, torch.float16)
    outs, lses, seq_lens = _batch(seed, n, n * hn, d_lora, torch.bfloat16)
    queries = make_queries(seed + 2, n, B, hn, d_lora + d_rope, torch.float8_e4m3fn)
    qsl = torch.tensor(QUERY_START_LOC, dtype=torch.int32)
    q, y = layer.dcp_decode(queries[rank], outs[rank], lses[rank], seq_lens[rank], qsl)
    assert torch.equal(q.view(torch.uint8), torch.cat(queries, dim=1).view(torch.uint8))
    err = max_rel_error(y, _reference(outs, lses, seq_lens, rank, hn)[0])
    assert y.dtype == torch.bfloat16 and err <= TOL[torch.bfloat16], err
    result = {"vllm_calls": dict(vllm.CALLS), "log": [line for line in lines if "vLLM's own serves" in line]}
    dropin.close_all()
    return result


def legacy_lineage(state, seed: int, enabled: bool) -> dict:
    """The older lineage: ``dcp_a2a_lse_reduce`` imported by name by a module loaded before the
    plugin and by one loaded after; its callers pass options of their own (logged once, ignored)."""
    vllm, lines = _fresh_vllm("legacy", enabled, before_plugins=("vllm.v1.attention.backends.mla.common",))
    from vllm.distributed.parallel_state import get_dcp_group
    from vllm.v1.attention.backends.mla import common, flashmla

    n, rank = dist.get_world_size(), dist.get_rank()
    H, D = 2 * n, 32
    outs, lses = make_inputs(seed, n, B, H, D, torch.bfloat16, special=True)
    ref, ref_lse = chunk_reference(outs, lses, rank, H // n)
    worst = 0.0
    for _ in range(2):
        y, yl = common.combine_decode(outs[rank], lses[rank], get_dcp_group(), return_lse=True)
        worst = max(worst, max_rel_error(y, ref))
        assert torch.equal(torch.isneginf(yl), torch.isneginf(ref_lse))
    y = flashmla.dcp_a2a_lse_reduce(outs[rank], lses[rank], get_dcp_group(), None, False, True, True)  # use_b12x
    worst = max(worst, max_rel_error(y, ref))
    # The drop-in itself, called as that lineage calls its function (options in positions 7 and 8).
    y = dropin.dcp_a2a_lse_reduce(outs[rank], lses[rank], get_dcp_group(), None, False, True, False, 64)
    worst = max(worst, max_rel_error(y, ref))
    assert worst <= TOL[torch.bfloat16], worst
    result = {"err": worst, "vllm_calls": dict(vllm.CALLS), "log": lines,
              "rebound": [getattr(m.dcp_a2a_lse_reduce, "_dcp_a2a", False) for m in (common, flashmla)]}
    dropin.close_all()
    return result


def missing_symbols(state) -> list:
    """A vLLM whose manager lacks a method the plugin patches: it says so and leaves vLLM as is."""
    vllm, lines = _fresh_vllm("current", False)
    from vllm.v1.attention.ops import dcp as vdcp
    from dcp import vllm_plugin

    original = vdcp.MLADCPManager._init_query_gather
    del vdcp.MLADCPManager._init_query_gather
    os.environ["DCP_A2A_VLLM"] = "1"
    try:
        vllm_plugin.register()
        untouched = not hasattr(vdcp.MLADCPManager, "_dcp_a2a_original")
    finally:
        vdcp.MLADCPManager._init_query_gather = original
        os.environ["DCP_A2A_VLLM"] = "0"
    return [untouched] + [line for line in lines if "lacks" in line]


def semantics(state, seed: int, dtype: str) -> dict:
    """vLLM's own combine test cases (``tests/distributed/test_dcp_a2a.py``), re-expressed against
    the drop-in: an empty shard with NaN outputs, a dominant rank, equal LSEs, base 2 with the
    LSE returned, and the pack width of each output dtype (fp16, bf16, fp32)."""
    coord = FakeCoordinator()
    n, rank = coord.world_size, dist.get_rank()
    dt = DTYPES[dtype]
    H, D, b = 2 * n, 24, 5
    hn, mine = H // n, slice(rank * 2, rank * 2 + 2)
    g = torch.Generator().manual_seed(seed)
    outs = [torch.randn(b, H, D, generator=g).to(dt) for _ in range(n)]
    lses = [torch.randn(b, H, generator=g) for _ in range(n)]
    res = {}

    def call(o, l, **kw):
        return dropin.dcp_a2a_lse_reduce(o[rank], l[rank], coord, **kw)

    empty_o = [o.clone() for o in outs]
    empty_l = [l.clone() for l in lses]
    empty_o[0].fill_(float("nan"))
    empty_l[0].fill_(float("-inf"))
    y = call(empty_o, empty_l)
    res["empty_shard"] = bool(torch.isfinite(y.float()).all()) and \
        max_rel_error(y, chunk_reference(empty_o, empty_l, rank, hn)[0]) <= TOL[dt]
    dom = [l.clone() for l in lses]
    dom[n - 1] += 60.0
    res["dominant_rank"] = torch.equal(call(outs, dom), outs[n - 1][:, mine])
    same = [torch.full((b, H), 0.25) for _ in range(n)]
    y, yl = call(outs, same, return_lse=True)
    mean = torch.stack([o[:, mine].double() for o in outs]).mean(0)
    res["equal_lses"] = max_rel_error(y, mean) <= TOL[dt] and \
        bool(torch.allclose(yl.double(), torch.full((b, hn), 0.25 + torch.log(torch.tensor(float(n))).item(),
                                                    dtype=torch.float64), atol=1e-5))
    y, yl = call(outs, lses, return_lse=True, is_lse_base_on_e=False)
    ref, ref_lse = chunk_reference(outs, lses, rank, hn, base_e=False)
    res["base2_with_lse"] = max_rel_error(y, ref) <= TOL[dt] and \
        bool(torch.allclose(yl.double(), ref_lse, atol=1e-5)) and yl.dtype == torch.float32
    y = call(outs, lses, head_major=True)
    res["head_major"] = y.shape == (b, hn, D) and y.stride() == (D, b * D, 1) and \
        max_rel_error(y, chunk_reference(outs, lses, rank, hn)[0]) <= TOL[dt]
    res["dtype"] = str(y.dtype)
    dropin.close_all()
    return res


def graphed_layer(state, seed: int, replays: int = 6) -> dict:
    """GPU: vLLM 0.33.0's MLA layer over the stand-in with the plugin on, its decode (fp8 query
    gather into head-padded storage, combine with seq_lens masking, B above max_tokens) captured in
    one CUDA graph and replayed on fresh inputs written in place."""
    vllm, _ = _fresh_vllm("current", True)
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    n, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    hn, d_lora, d_rope, dt, qdt = 4, 512, 64, torch.bfloat16, torch.float8_e4m3fn
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(dcp_comm_backend="a2a"),
                                   max_num_tokens=MAX_TOKENS)
    layer = MLAAttention(config, dev, hn, d_lora, d_rope, dt, qdt, n * hn + 4)
    q_local = torch.empty((B, hn, d_lora + d_rope), dtype=qdt, device=dev)
    po = torch.empty((B, n * hn, d_lora), dtype=dt, device=dev)
    pl = torch.empty((B, n * hn), dtype=torch.float32, device=dev)
    sl = torch.empty(len(QUERY_START_LOC) - 1, dtype=torch.int32, device=dev)
    qsl = torch.tensor(QUERY_START_LOC, dtype=torch.int32, device=dev)

    def fill(step: int) -> tuple:
        outs, lses, seq_lens = _batch(seed + 10 * step, n, n * hn, d_lora, dt)
        queries = make_queries(seed + 10 * step + 5, n, B, hn, d_lora + d_rope, qdt)
        q_local.copy_(queries[rank])
        po.copy_(outs[rank])
        pl.copy_(lses[rank])
        sl.copy_(seq_lens[rank])
        return outs, lses, seq_lens, queries

    fill(0)
    layer.dcp_decode(q_local, po, pl, sl, qsl)  # the eager warm-up call before capture
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=stream):
        q, y = layer.dcp_decode(q_local, po, pl, sl, qsl)
    worst = 0.0
    for step in range(1, replays + 1):
        outs, lses, seq_lens, queries = fill(step)
        q.view(torch.uint8).fill_(0xFF)  # NaN in every fp8 format
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = torch.cat(queries, dim=1)
        assert torch.equal(q.cpu().view(torch.uint8), want.view(torch.uint8)), f"step {step}: gather not exact"
        err = max_rel_error(y, _reference(outs, lses, seq_lens, rank, hn)[0])
        assert err <= TOL[dt], f"step {step}: combine error {err}"
        worst = max(worst, err)
    result = {"err": worst, "vllm_calls": dict(vllm.CALLS), "contiguous": q.is_contiguous(),
              "storage": q.untyped_storage().nbytes()}
    del graph
    dropin.close_all()
    return result


def real_vllm_layer(state, seed: int) -> dict:
    """The plugin inside a real vLLM's own code (not the stand-in): its plugin loader, config, process
    groups and MLADCPManager on CPU tensors over the world's gloo group; combine (with seq_lens) and
    head-padded query gather against the references."""
    os.environ["DCP_A2A_VLLM"] = "1"
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # an unpacked wheel cannot infer its platform
    records = Records()
    logging.getLogger("vllm.dcp_a2a").addHandler(records)
    logging.getLogger("vllm.dcp_a2a").setLevel(logging.INFO)
    import vllm.plugins
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.v1.attention.ops import dcp as vdcp

    assert "standin_vllm" not in str(Path(vllm.__file__)), "the stand-in, not a real vLLM"
    calls = _count_transports(vdcp, ps)  # before the plugin, which keeps vLLM's own as its fallback
    vllm.plugins.load_general_plugins()
    n, rank = dist.get_world_size(), dist.get_rank()
    hn, D, Dq, padded = 4, 32, 64, 4 * n + 4
    config = VllmConfig(parallel_config=ParallelConfig(dcp_comm_backend="a2a"))
    with set_current_vllm_config(config):
        ps.init_distributed_environment(world_size=n, rank=rank, local_rank=rank, backend="gloo")
        ps.initialize_model_parallel(n, 1, 1, n, backend="gloo")
        try:
            calls.clear()  # (setting up the groups gathers too)
            manager = vdcp.MLADCPManager(config, torch.device("cpu"), hn, Dq, D, torch.bfloat16, torch.bfloat16,
                                         padded, True, False)
            outs, lses, seq_lens = _batch(seed, n, n * hn, D, torch.bfloat16)
            qsl = torch.tensor(QUERY_START_LOC, dtype=torch.int32)
            y = manager.combine(outs[rank], lses[rank], seq_lens=seq_lens[rank], query_start_loc=qsl)
            err = max_rel_error(y, _reference(outs, lses, seq_lens, rank, hn)[0])
            queries = make_queries(seed + 2, n, B, hn, Dq, torch.bfloat16)
            q = manager.query_gather(queries[rank])
            err = max(err, _steps(manager, seed + 3, n, hn, D, rank, config))
        finally:
            ps.destroy_model_parallel()
    return {"err": err,
            "exact": torch.equal(q.view(torch.int16), torch.cat(queries, dim=1).view(torch.int16)),
            "storage_ok": q.is_contiguous() and q.untyped_storage().nbytes() >= B * padded * Dq * 2,
            "ours": getattr(manager, "_dcp_a2a_comm", None) is not None, "log": records.lines,
            "vllm": vllm.__file__, "calls": dict(calls)}


def _steps(manager, seed: int, n: int, hn: int, D: int, rank: int, config) -> float:
    """Two model steps of two layers each, every layer on fresh inputs, in vLLM's own forward
    contexts: each step's first combine searches its metadata (the plugin passes the context as
    the step), the second reads the verdicts; the second step's seq_lens are refilled in place,
    as vLLM's persistent buffers are. Returns the largest error against the reference."""
    from vllm.forward_context import get_forward_context, set_forward_context

    qsl = torch.tensor(QUERY_START_LOC, dtype=torch.int32)
    held, err = None, 0.0
    for s in range(2):
        with set_forward_context({}, config, num_tokens=B):
            for layer in range(2):
                outs, lses, seq_lens = _batch(seed + 10 * s + layer, n, n * hn, D, torch.bfloat16)
                if layer == 0:
                    held = seq_lens[rank].clone() if held is None else held.copy_(seq_lens[rank])
                    step_lens = seq_lens
                y = manager.combine(outs[rank], lses[rank], seq_lens=held, query_start_loc=qsl)
                err = max(err, max_rel_error(y, _reference(outs, lses, step_lens, rank, hn)[0]))
                mask_for = manager._dcp_a2a_comm._mask_for[0]
                assert mask_for is not None and mask_for[0] is get_forward_context(), "not searched once per step"
    return err


def count_calls(calls: Counter, owner, name: str, label: str, importers: bool = False) -> None:
    """Wrap ``owner.name`` so that each call adds 1 to ``calls[label]``; with ``importers`` (``owner``
    a module), also in every module that imported the function by name."""
    original = getattr(owner, name)

    @functools.wraps(original)  # (the plugins read the original's parameters)
    def wrapper(*args, **kwargs):
        calls[label] += 1
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)
    if importers and isinstance(owner, types.ModuleType):
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if isinstance(namespace, dict) and namespace.get(name) is original:
                namespace[name] = wrapper


def _count_transports(vdcp, ps) -> Counter:
    """Counts every call into this package's two collectives and into each of vLLM's own DCP
    transports (its group all-gather, the packed NCCL all-to-all, AG+RS and AG+AR, the direct
    symmetric-memory workspaces), by wrapping them where vLLM's code looks them up."""
    calls: Counter = Counter()
    counted = functools.partial(count_calls, calls)
    counted(DcpAllToAll, "lse_reduce", "ours: combine")
    counted(DcpAllToAll, "all_gather_heads", "ours: query gather")
    counted(ps.GroupCoordinator, "all_gather", "vLLM: GroupCoordinator.all_gather")
    for name in ("dcp_a2a_lse_reduce", "cp_lse_ag_out_rs", "cp_lse_ag_out_ar", "get_direct_dcp_a2a_workspace",
                 "get_direct_dcp_q_gather_workspace"):
        counted(vdcp, name, f"vLLM: {name}")
    counted(vdcp.DirectDCPA2AWorkspace, "lse_reduce", "vLLM: direct workspace combine")
    counted(vdcp.DirectDCPQGatherWorkspace, "gather", "vLLM: direct workspace query gather")
    return calls


def non_mla_impl_before_capture(state, seed: int) -> dict:
    """vLLM's FlashAttention impl binds the combine when the layers are built: the plugin builds
    its communicator there, so the first combine inside a (simulated) capture builds nothing; a
    geometry never built is served by vLLM's own instead of failing in capture."""
    vllm, lines = _fresh_vllm("current", True)
    from vllm.distributed.parallel_state import get_dcp_group
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    n, rank = dist.get_world_size(), dist.get_rank()
    hn, D = 2, 64
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(dcp_comm_backend="a2a"),
                                   max_num_tokens=MAX_TOKENS)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as vLLM's model loader does around the layers
    try:
        impl = FlashAttentionImpl(hn, D, config)
    finally:
        torch.set_default_dtype(before)
    built = len(serving._comms)
    outs, lses = make_inputs(seed, n, B, n * hn, D, torch.bfloat16)
    other, other_lses = make_inputs(seed + 1, n, B, n * hn, 32, torch.bfloat16)
    capturing = serving.capturing
    serving.capturing = lambda device: True  # in capture from here on: nothing may be built
    try:
        y, y_lse = impl.context_combine(outs[rank], lses[rank])
        ours_calls = dict(vllm.CALLS)
        y_other = impl.dcp_combine(other[rank], other_lses[rank], get_dcp_group(), return_lse=True)[0]
    finally:
        serving.capturing = capturing
    result = {"built_at_init": built, "comms_after": len(serving._comms), "calls_ours": ours_calls,
              "calls_after": dict(vllm.CALLS), "log": lines,
              "err": max_rel_error(y, chunk_reference(outs, lses, rank, hn, True)[0]),
              "err_other": max_rel_error(y_other, chunk_reference(other, other_lses, rank, hn, True)[0])}
    dropin.close_all()
    return result


def serving_keeps_geometries_apart(state) -> dict:
    """The serving layer's cache: a combine with its query gather takes only a communicator built
    for both; a combine alone takes any communicator of its geometry, whether the engine passes its
    process group or a coordinator around it; a declined geometry says why."""
    group, n, cpu = dist.group.WORLD, dist.get_world_size(), torch.device("cpu")
    bf16, fp16 = torch.bfloat16, torch.float16
    a, _ = serving.serve(group, 2 * n, 64, bf16, cpu, query=(72, bf16), max_tokens=2)
    b, _ = serving.serve(group, 2 * n, 128, fp16, cpu, query=(72, bf16), max_tokens=2)
    c, _ = serving.serve(group, 2 * n, 64, bf16, cpu)
    # An engine's coordinator around the same process group finds the same communicators.
    coordinator = types.SimpleNamespace(world_size=n, rank_in_group=dist.get_rank(), device_group=group)
    d, _ = serving.serve(coordinator, 2 * n, 64, bf16, cpu)
    e, _ = serving.serve(coordinator, 2 * n, 64, bf16, cpu, query=(72, bf16))
    _, why = serving.serve(group, 2 * n + 1, 64, bf16, cpu)
    res = {"distinct": a is not b, "b": (b.head_dim, b.dtype, b.query_dim), "combine_reuses": c is a, "why": why,
           "coordinator_reuses": d is a and e is a, "built": len(serving._comms)}
    serving.close_all()
    return res


def combine_where_declined(state) -> dict:
    """The patched combine where this package declines: tensors of a device it does not serve, and
    a geometry whose construction fails (here an unknown ``DCP_A2A_BACKEND``). vLLM's own serves
    each call, and a failed construction is not tried again at the next call."""
    calls, tries = [], []

    def original(cp_attn_out, cp_attn_lse, cp_group, ctx=None, return_lse=False, is_lse_base_on_e=True):
        calls.append(cp_attn_out.device.type)
        return "vLLM's own"

    built = serving.communicator

    def counted(*args, **kwargs):
        tries.append(1)
        return built(*args, **kwargs)

    combine, group = dropin.fallback_combine(original), dist.group.WORLD
    res = {"meta": combine(torch.empty(2, 4, 8, dtype=torch.bfloat16, device="meta"),
                           torch.empty(2, 4, device="meta"), group)}
    os.environ["DCP_A2A_BACKEND"], serving.communicator = "no-such-backend", counted
    try:
        res["failed"] = [combine(torch.randn(2, 4, 8), torch.randn(2, 4), group) for _ in range(2)]
    finally:
        os.environ.pop("DCP_A2A_BACKEND")
        serving.communicator = built
    res.update(calls=calls, tries=len(tries), why=next(iter(serving._failed.values()))[0])
    serving.close_all()
    res["forgotten"] = not serving._failed
    return res
