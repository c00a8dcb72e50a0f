"""Rank functions for the SGLang plugin inside SGLang 0.5.23's own code (its wheel unpacked on
``PYTHONPATH``: on a CPU its Python imports without the compiled kernels it ships). SGLang's plugin
loader, hook registry, group coordinator over the world's gloo group, runtime context and
``DeepseekMLAForwardMixin.forward_absorb_core`` run as they are; stood in for are only the
attention kernel (a module returning each rank's partials and LSEs) and the model runner."""

import functools
import importlib
import logging
import os
import types
from collections import Counter

import torch
import torch.distributed as dist

from dcp import DcpAllToAll
from dcp import serving
from dcp import vllm as dropin
from dcp.reference import chunk_reference, make_inputs, make_queries, max_rel_error
from tests.rank_cases import TOL
from tests.vllm_cases import Records, count_calls, entry_point

B, LOCAL_HEADS, NOPE, ROPE = 11, 2, 32, 16  # B above max_tokens: the combine runs in chunks
CAPTURED, WIDTH = [1, 2, 4], 2  # the stand-in runner's capture sizes and tokens per request: max_tokens 8
LN2 = 0.6931471805599453
# Attention backends of SGLang's absorbed MLA path, by the base of the LSE they return.
BACKEND_OF_BASE = {True: "cutedsl_mla", False: "flashinfer"}


def _sglang(state) -> types.SimpleNamespace:
    """SGLang in this process, loaded once per rank process: counters on its transports (before the
    plugin, which keeps SGLang's own as its fallback), its plugins loaded by its own loader (our entry
    point among them), its DCP group coordinator over the world's gloo group."""
    if "sglang" in state:
        return state["sglang"]
    os.environ["DCP_A2A_SGLANG"] = "1"
    os.environ.pop("SGLANG_PLUGINS", None)
    records = Records()
    logging.getLogger("sglang.dcp_a2a").addHandler(records)
    logging.getLogger("sglang.dcp_a2a").setLevel(logging.INFO)
    import sglang
    import sglang.srt.layers.dcp  # noqa: F401  (the package that re-exports the collectives)
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers.dcp import comm as sgl_comm

    # SGLang's pynccl-backed all-to-all is a custom op registered for CUDA tensors only; on the CPU
    # its own a2a (the fallback here) goes to the group's torch.distributed path directly.
    ps.GroupCoordinator.all_to_all_single = lambda self, out, inp: self._all_to_all_single(out, inp)
    calls = _count_transports(sgl_comm, ps)
    entry_point("sglang.srt.plugins", "dcp.sglang_plugin:register")
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.models.deepseek_common.attention_forward_methods import forward_mla
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.runtime_context import get_parallel

    n, rank = dist.get_world_size(), dist.get_rank()
    group = ps.init_model_parallel_group([list(range(n))], rank, "gloo", use_pynccl=False,
                                         use_custom_allreduce=False, use_mscclpp=False,
                                         use_torch_symm_mem_allreduce=False, group_name="dcp")
    from dcp import sglang_plugin

    # close: the rank's teardown closes the communicators (collective), even after a failed test
    state["sglang"] = types.SimpleNamespace(calls=calls, log=records.lines, group=group, ps=ps, comm=sgl_comm,
                                            forward_mla=forward_mla, ForwardMode=ForwardMode,
                                            get_parallel=get_parallel, file=sglang.__file__,
                                            close=sglang_plugin.close_all)
    return state["sglang"]


def _count_transports(sgl_comm, ps) -> Counter:
    """Counts every call into this package's two collectives and into SGLang's own DCP transports
    (its combine and gather functions, the group's all-to-all, all-gather, reduce-scatter and
    all-reduce, the fi_a2a workspace and exchange), wrapping each where SGLang's code looks it up."""
    calls: Counter = Counter()
    counted = functools.partial(count_calls, calls)
    counted(DcpAllToAll, "lse_reduce", "ours: combine")
    counted(DcpAllToAll, "all_gather_heads", "ours: query gather")
    for name in ("dcp_a2a_lse_reduce", "cp_lse_ag_out_rs_mla", "all_gather_q_for_mla_decode",
                 "_dcp_fi_a2a_lse_reduce", "init_fi_a2a_workspace"):
        counted(sgl_comm, name, f"SGLang: {name}", importers=True)
    for name in ("all_to_all_single", "_all_to_all_single", "all_gather", "all_gather_into_tensor",
                 "reduce_scatter_along_dim", "all_reduce"):
        counted(ps.GroupCoordinator, name, f"SGLang: GroupCoordinator.{name}")
    return calls


def _attention_module(s, nope: int, base_e: bool):
    """SGLang's MLA forward mixin over a stand-in attention: ``attn_mqa_for_dcp_decode`` returns this
    rank's partials and LSEs (set per call), ``w_vc`` is the identity (so the layer's output is the
    combined attention output), ``o_proj`` passes it through."""
    mixin = s.forward_mla.DeepseekMLAForwardMixin
    n = dist.get_world_size()

    class StandInMLA(mixin, torch.nn.Module):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.current_attention_backend = BACKEND_OF_BASE[base_e]
            self.dcp_size, self.use_dsa, self.use_deep_gemm_bmm, self.next_skip_topk = n, False, False, None
            self.num_local_heads, self.kv_lora_rank, self.qk_rope_head_dim = LOCAL_HEADS, nope, ROPE
            self.v_head_dim = nope
            self.w_vc = torch.eye(nope, dtype=torch.bfloat16).expand(LOCAL_HEADS, nope, nope).contiguous()
            self.partials = None
            self.seen_queries = None

        def attn_mqa_for_dcp_decode(self, q_nope_out, k_nope, v, forward_batch, q_rope=None, **kwargs):
            self.seen_queries = (q_nope_out, q_rope)
            out, lse = self.partials
            return out.reshape(out.shape[0], -1), lse

        def _fuse_rope_for_trtllm_mla(self, forward_batch):
            return False

        def o_proj(self, x):
            return x, None

    return StandInMLA()


def _runner(modules) -> types.SimpleNamespace:
    """The least of SGLang's ModelRunner that the plugin reads before capture."""
    model = torch.nn.ModuleList(modules)
    spec = types.SimpleNamespace(is_speculative=lambda: False)
    return types.SimpleNamespace(model=model, dtype=torch.bfloat16, spec_algorithm=spec,
                                 decode_num_tokens_per_req=lambda: WIDTH)


def _layer(s, layer, seed: int, base_e: bool, n: int, rank: int, special: bool = True) -> dict:
    """One decode step of the layer: the query gather through SGLang's function, then
    ``forward_absorb_core`` (attention stand-in, SGLang's combine call, the value projection).
    ``special``: LSEs of -inf, NaN and +inf among the inputs, NaN partials of empty shards."""
    nope = layer.kv_lora_rank
    H = n * LOCAL_HEADS
    queries = make_queries(seed, n, B, LOCAL_HEADS, nope + ROPE, torch.bfloat16)
    q_nope, q_pe = queries[rank][..., :nope].clone(), queries[rank][..., nope:].clone()
    q_nope_all, q_pe_all = s.forward_mla.all_gather_q_for_mla_decode(q_nope_out=q_nope, q_pe=q_pe)
    want = torch.cat(queries, dim=1)
    exact = (torch.equal(q_nope_all.view(torch.int16), want[..., :nope].view(torch.int16))
             and torch.equal(q_pe_all.view(torch.int16), want[..., nope:].view(torch.int16)))
    outs, lses = make_inputs(seed + 1, n, B, H, nope, torch.bfloat16, special=special)
    if not base_e:
        lses = [l / LN2 for l in lses]  # the same weights in base 2
    layer.partials = (outs[rank], lses[rank])
    fb = types.SimpleNamespace(forward_mode=s.ForwardMode.DECODE)
    y = layer.forward_absorb_core(q_pe_all, None, q_nope_all, None, fb, None, None, None, None)
    ref, _ = chunk_reference(outs, lses, rank, LOCAL_HEADS, base_e)
    assert y.shape == (B, LOCAL_HEADS * nope), y.shape
    assert layer.seen_queries[0] is q_nope_all, "attention did not get the gathered queries"
    return {"err": max_rel_error(y.view(B, LOCAL_HEADS, nope), ref), "exact": exact}


def real_sglang_layer(state, seed: int, comm_backend: str) -> dict:
    """The plugin inside SGLang's own code: the communicator built before capture from a stand-in
    runner, then a decode step of SGLang's MLA forward in each LSE base, under ``comm_backend``."""
    s = _sglang(state)
    from dcp import sglang_plugin

    n, rank = dist.get_world_size(), dist.get_rank()
    layers = {base_e: _attention_module(s, NOPE, base_e) for base_e in (True, False)}
    capture = importlib.import_module(sglang_plugin.CAPTURE_MODULE)
    original_sizes = capture.get_batch_sizes_to_capture
    # SGLang's capture sizes come from its published server config; the stand-in runner's are these.
    capture.get_batch_sizes_to_capture = lambda runner, *a, **k: (list(CAPTURED), [])
    results = {}
    try:
        with s.get_parallel().override(dcp_group=s.group, dcp_size=n, dcp_comm_backend=comm_backend):
            built = sglang_plugin.prepare(_runner(list(layers.values())))
            s.calls.clear()  # (building is collective over the group's own torch.distributed group)
            for base_e, layer in layers.items():
                results[base_e] = _layer(s, layer, seed + (0 if base_e else 100), base_e, n, rank)
    finally:
        capture.get_batch_sizes_to_capture = original_sizes
    return {"results": results, "calls": dict(s.calls), "log": list(s.log), "sglang": s.file,
            "built": [None if c is None else (c.max_tokens, c.num_heads, c.head_dim, c.query_dim) for c in built]}


def runner_is_hooked(state) -> bool:
    """SGLang's ModelRunner, imported after the plugin loaded, builds before it captures."""
    s = _sglang(state)
    from dcp import sglang_plugin
    from sglang.srt.model_executor.model_runner import ModelRunner

    original = getattr(ModelRunner, serving.MARK, {}).get("init_cuda_graphs")
    return s is not None and original is not None and ModelRunner.init_cuda_graphs.__wrapped__ is original


def first_seen_in_capture(state, seed: int) -> dict:
    """A geometry no runner declared, first called while the stream captures: SGLang's own a2a
    serves it (correctly), nothing is built, and the log says so."""
    s = _sglang(state)
    n, rank = dist.get_world_size(), dist.get_rank()
    layer = _attention_module(s, 2 * NOPE, True)
    capturing = serving.capturing
    serving.capturing = lambda device: True  # in capture from here on: nothing may be built
    comms_before = len(serving._comms)
    try:
        with s.get_parallel().override(dcp_group=s.group, dcp_size=n, dcp_comm_backend="a2a"):
            s.calls.clear()
            res = _layer(s, layer, seed, True, n, rank, special=False)  # (SGLang's own: NaN rows of
            # empty shards propagate through its combine)
    finally:
        serving.capturing = capturing
    return {"res": res, "calls": dict(s.calls), "built": len(serving._comms) - comms_before,
            "log": [line for line in s.log if "capture" in line]}


def close(state) -> None:
    from dcp import sglang_plugin

    sglang_plugin.close_all()


class _StandInLayer(torch.nn.Module):
    """What the plugin reads of an MLA layer before capture (SGLang's DeepseekV2AttentionMLA)."""

    def __init__(self, n: int, local_heads: int, nope: int, rope: int):
        super().__init__()
        self.dcp_size, self.num_local_heads, self.kv_lora_rank, self.qk_rope_head_dim = n, local_heads, nope, rope

    def is_dcp_mla_decode_phase(self, forward_batch) -> bool:
        return True


def graphed_plugin(state, seed: int, sizes: list, layers: int, replays: int) -> dict:
    """GPU, without SGLang: the plugin's query gather and combine as SGLang's MLA forward calls them
    (its hooks, with a stand-in of SGLang's DCP group and runtime context), communicators built by
    ``prepare`` from a stand-in runner before capture; one CUDA graph per batch size of ``layers``
    layers (gather, an attention stand-in deriving partials from the gathered queries, combine;
    LSEs in base e and base 2 by turns), replayed in a random order shared by the ranks on fresh
    inputs, outputs poisoned first. Returns the allocations each captured call made."""
    import random

    from dcp import sglang_plugin

    n, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    hn, nope, rope, dt = 16, 512, 64, torch.bfloat16
    H = n * hn
    group = types.SimpleNamespace(world_size=n, rank_in_group=rank, device_group=dist.group.WORLD)
    sglang_plugin._get_parallel = lambda: types.SimpleNamespace(dcp_group=group, dcp_comm_backend="a2a")
    theirs = Counter()

    def own(name):
        def sglangs_own(*args, **kwargs):
            theirs[name] += 1
            raise AssertionError(f"SGLang's own {name} ran")
        return sglangs_own

    os.environ["DCP_A2A_MAX_TOKENS"] = str(max(sizes))
    built = sglang_plugin.prepare(types.SimpleNamespace(model=torch.nn.ModuleList([_StandInLayer(n, hn, nope, rope)]),
                                                        dtype=dt))
    comm = built[0]
    assert comm is not None and comm.query_dim == nope + rope, built
    memory = comm.memory_bytes()
    allocated = lambda: torch.cuda.memory_stats(dev).get("allocation.all.allocated", 0)

    def attention(q_nope_all, po, pl, layer: int) -> None:
        x = q_nope_all.view(torch.uint8)[..., :nope].to(torch.float32)
        po.copy_(x * ((rank + 1 + layer) / 256.0))
        pl.copy_(x[..., 0] / 64.0 - rank)

    def layer_call(b, layer: int, counts=None):
        before = allocated()
        qn, qp = sglang_plugin._query_gather(own("all_gather_q_for_mla_decode"), b["q_nope"], b["q_pe"])
        if counts is not None:
            counts.append(("gather", allocated() - before))
        attention(qn, b["po"], b["pl"], layer)
        before = allocated()
        y = sglang_plugin._a2a_combine(own("dcp_a2a_lse_reduce"), b["po"], b["pl"], group,
                                       is_lse_base_on_e=layer % 2 == 0, comm_backend="a2a")
        if counts is not None:
            counts.append(("combine", allocated() - before))
        return qn, qp, y

    graphs, allocs = [], []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
        pass  # what torch allocates for a stream's first capture
    for B in sizes:
        bufs = [dict(q_nope=torch.empty((B, hn, nope), dtype=dt, device=dev),
                     q_pe=torch.empty((B, hn, rope), dtype=dt, device=dev),
                     po=torch.empty((B, H, nope), dtype=dt, device=dev),
                     pl=torch.empty((B, H), dtype=torch.float32, device=dev)) for _ in range(layers)]
        for layer, b in enumerate(bufs):  # the eager warm-up SGLang runs before capture
            b["q_nope"].zero_()
            b["q_pe"].zero_()
            layer_call(b, layer)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            results = [layer_call(b, layer, allocs) for layer, b in enumerate(bufs)]
        graphs.append((B, graph, bufs, results))
    rnd = random.Random(seed)
    worst = 0.0
    for step in range(replays):
        B, graph, bufs, results = graphs[rnd.randrange(len(graphs))]
        queries = []
        for layer, (b, (qn, qp, y)) in enumerate(zip(bufs, results)):
            qs = make_queries(seed + 97 * step + layer, n, B, hn, nope + rope, dt)
            b["q_nope"].copy_(qs[rank][..., :nope])
            b["q_pe"].copy_(qs[rank][..., nope:])
            qn.view(torch.uint8).fill_(0xFF)  # poison: NaN in bf16
            qp.view(torch.uint8).fill_(0xFF)
            y.fill_(float("nan"))
            queries.append(qs)
        graph.replay()
        torch.cuda.synchronize()
        for layer, ((qn, qp, y), qs) in enumerate(zip(results, queries)):
            want = torch.cat(qs, dim=1)
            assert torch.equal(qn.cpu().view(torch.int16), want[..., :nope].view(torch.int16)) and \
                torch.equal(qp.cpu().view(torch.int16), want[..., nope:].view(torch.int16)), \
                f"step {step} B={B} layer {layer}: gather not exact"
            x = want.view(torch.uint8)[..., :nope].to(torch.float32)
            outs = [(x * ((r + 1 + layer) / 256.0)).to(dt) for r in range(n)]
            lses = [x[..., 0] / 64.0 - r for r in range(n)]
            ref, _ = chunk_reference(outs, lses, rank, hn, layer % 2 == 0)
            err = max_rel_error(y, ref)
            assert err <= TOL[dt], f"step {step} B={B} layer {layer}: combine error {err}"
            worst = max(worst, err)
    result = {"err": worst, "allocs": allocs, "theirs": dict(theirs), "memory_same": comm.memory_bytes() == memory,
              "communicators": len(serving._comms)}
    del graphs
    os.environ.pop("DCP_A2A_MAX_TOKENS")
    sglang_plugin.close_all()
    return result
