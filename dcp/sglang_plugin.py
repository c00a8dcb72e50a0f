"""The ``sglang.srt.plugins`` entry point: with ``DCP_A2A_SGLANG=1``, the MLA decode of SGLang's
DeepSeek-style models (``--dcp-size N``) runs both DCP collectives on this package.

SGLang calls ``register()`` in every process (engine, schedulers, detokenizer) before it builds
anything. Without the variable it returns at once, having imported nothing of SGLang's. With it:

- SGLang's hook registry (``sglang.srt.plugins.hook_registry``) wraps three functions of
  ``sglang.srt.layers.dcp.comm``: the combine of ``--dcp-comm-backend a2a`` and ``fi_a2a``
  (``dcp_a2a_lse_reduce``), the combine of ``ag_rs`` (``cp_lse_ag_out_rs_mla``) and the query
  gather (``all_gather_q_for_mla_decode``). The registry rebinds every module that imported them by
  name (``forward_mla`` does). That module is loaded in every SGLang process before plugins are, so
  registering there costs nothing.
- ``ModelRunner.init_cuda_graphs`` (every runner: the target model's and the draft's, NextN / MTP)
  first builds the communicators of the runner's MLA layers, collectively: after the attention
  backends exist, before capture. This one is an import hook (``dcp.patching``), not the registry:
  the registry imports its targets at once, and importing the model runner (about 2 s on 2 cores)
  would delay the engine's main process before it spawns the schedulers, and the detokenizer,
  neither of which builds a model.

Every verdict reads facts that every rank of the DCP group shares (the call's shapes but B, its
dtypes and device, the group, ``--dcp-comm-backend``, whether the stream is capturing, the
communicators built collectively before), is taken once per geometry and logged once with its
reason. Served: fp16, bf16 and fp32 partials, any batch (calls above ``max_tokens`` run in chunks),
LSEs of either base (SGLang passes the attention backend's), on CUDA (and on the CPU, where the
kernels run interpreted: the tests). Declined, SGLang's own runs: a group of one, fp8 or other
outputs, widths this package does not take, queries whose two parts differ in dtype, ROCm (nothing
is hooked), NPU and XPU tensors, a geometry that first appears inside CUDA-graph capture (nothing
may be built there), and ``fi_a2a`` where the group spans hosts (this package's fused transport
needs one host; FlashInfer's MNNVL all-to-all reaches across). Under ``ag_rs`` and ``fi_a2a`` on one
host both collectives are served: ``DCP_A2A_SGLANG=1`` asks for this transport, and the log says
which choice it overrode. SGLang's non-MLA DCP path (``triton_backend``'s inline query gather and
``cp_lse_ag_out_rs_mha``) is not hooked: its gather is a bare ``group.all_gather`` inside the
backend, and its combine is shared with the chunked-prefill merge and the XPU backend.
"""

import importlib
import logging
from typing import Any, Optional

import torch

from dcp import serving
from dcp.comm import DcpAllToAll
from dcp.config import max_tokens_from_env, max_tokens_set, plugin_enabled
from dcp.patching import when_imported

# A child of SGLang's logger, so that its lines appear in SGLang's log.
log = logging.getLogger("sglang.dcp_a2a")

ENV_ON = "DCP_A2A_SGLANG"
COMM_MODULE = "sglang.srt.layers.dcp.comm"
RUNNER_MODULE = "sglang.srt.model_executor.model_runner"
CAPTURE_MODULE = "sglang.srt.model_executor.runner.base_cuda_graph_runner"
# The functions hooked, with SGLang 0.5.23's parameters (the hooks take them by these names).
HOOKED = {
    "dcp_a2a_lse_reduce": ("cp_attn_out", "cp_attn_lse", "cp_group", "is_lse_base_on_e", "cuda_graph_buffers",
                           "comm_backend"),
    "cp_lse_ag_out_rs_mla": ("cp_attn_out", "cp_attn_lse", "cp_group", "ctx", "is_lse_base_on_e"),
    "all_gather_q_for_mla_decode": ("q_nope_out", "q_pe"),
}

_verdicts: dict = {}  # (kind, group id, geometry but B, dtype, device, backend) -> (communicator or None, group)
# id(communicator) -> its queries' staging [max_tokens, H/N, Dq], allocated with it (before capture):
# a gather writes its two parts there and gathers them at once, so that in capture it allocates only
# its result. (Shared by the channel's calls, which are serialized on one stream.)
_staging: dict = {}
_max_tokens: dict = {"tokens": None, "why": "default"}  # the last runner's capture size, for later builds
_get_parallel: Any = None  # sglang.srt.runtime_context.get_parallel, once registered


def enabled() -> bool:
    return plugin_enabled(ENV_ON)


def register() -> None:
    """SGLang's plugin hook: route its MLA DCP collectives here if ``DCP_A2A_SGLANG=1`` (else nothing)."""
    global _get_parallel
    if not enabled() or _get_parallel is not None:  # (once per process)
        return
    if torch.version.hip:
        log.info("dcp_a2a: DCP_A2A_SGLANG=1 on ROCm: SGLang's own DCP transports kept (this package serves CUDA)")
        return
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        comm_module = importlib.import_module(COMM_MODULE)
        _get_parallel = importlib.import_module("sglang.srt.runtime_context").get_parallel
    except (ImportError, AttributeError) as exc:
        log.warning("dcp_a2a: DCP_A2A_SGLANG=1 but SGLang's DCP code cannot be imported (%s); SGLang left "
                    "untouched", exc)
        return
    hooks = {"dcp_a2a_lse_reduce": _a2a_combine, "cp_lse_ag_out_rs_mla": _ag_rs_combine,
             "all_gather_q_for_mla_decode": _query_gather}
    hooked = []
    for name, hook in hooks.items():
        fn = getattr(comm_module, name, None)
        found = None if fn is None else serving.parameters(fn)
        if found != HOOKED[name]:  # (the hooks take SGLang's parameters by these names, and pass them back)
            log.warning("dcp_a2a: %s.%s %s, not (%s) as in SGLang 0.5.23; that collective left to SGLang",
                        COMM_MODULE, name, "is missing" if fn is None else f"takes ({', '.join(found or ())})",
                        ", ".join(HOOKED[name]))
            continue
        HookRegistry.register(f"{COMM_MODULE}.{name}", hook, HookType.AROUND)
        hooked.append(name)
    when_imported(RUNNER_MODULE, _patch_runner)
    log.info("dcp_a2a: %s hooked in %s: SGLang's MLA DCP combine and query gather run on dcp-a2a "
             "(DCP_A2A_SGLANG=1); communicators built in ModelRunner.init_cuda_graphs, before capture",
             ", ".join(hooked), COMM_MODULE)


# --- before capture -----------------------------------------------------------------------------
def _patch_runner(module) -> None:
    def wrap(original):
        def init_cuda_graphs(self, *args, **kwargs):
            prepare(self)
            return original(self, *args, **kwargs)
        return init_cuda_graphs

    if serving.wrap_once(getattr(module, "ModelRunner", None), {"init_cuda_graphs": wrap}) == "missing":
        log.warning("dcp_a2a: %s has no ModelRunner.init_cuda_graphs; communicators are built on first use "
                    "(a geometry first seen in capture is left to SGLang)", module.__name__)


def _is_dcp_mla(module) -> bool:
    """An MLA attention module of SGLang's DeepSeek family that runs DCP decode."""
    return (callable(getattr(module, "is_dcp_mla_decode_phase", None)) and getattr(module, "dcp_size", 1) > 1
            and all(isinstance(getattr(module, a, None), int)
                    for a in ("num_local_heads", "kv_lora_rank", "qk_rope_head_dim")))


def prepare(runner: Any) -> list:
    """Collective: build the communicators of a model runner's MLA DCP layers (one per geometry,
    the combine's and the query gather's together) and decide for the DCP backend in use. SGLang
    calls it on every rank, for the target model and the draft alike, before capturing graphs.
    Returns the communicators (or None where SGLang's own serves)."""
    if _get_parallel is None:
        return []
    parallel = _get_parallel()
    group, backend = getattr(parallel, "dcp_group", None), getattr(parallel, "dcp_comm_backend", None)
    model = getattr(runner, "model", None)
    if group is None or getattr(group, "world_size", 1) == 1 or model is None:
        return []
    geometries = sorted({(m.num_local_heads * m.dcp_size, m.kv_lora_rank, m.qk_rope_head_dim)
                         for m in model.modules() if _is_dcp_mla(m)})
    dtype = getattr(runner, "dtype", None) or torch.get_default_dtype()
    _max_tokens.update(zip(("tokens", "why"), _capture_tokens(runner)))
    device = _device()
    built = []
    for heads, nope, rope in geometries:  # the same order on every rank: the builds are collective
        built.append(_gather_verdict(group, heads, nope, rope, dtype, device, backend))
    return built


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _capture_tokens(runner) -> tuple:
    """(tokens, why): the largest batch SGLang captures for this runner times the tokens of each
    request (draft tokens when speculating), or ``DCP_A2A_MAX_TOKENS``."""
    if max_tokens_set():
        return max_tokens_from_env(), "DCP_A2A_MAX_TOKENS"
    try:
        capture = importlib.import_module(CAPTURE_MODULE)
        requests = max(capture.get_batch_sizes_to_capture(runner)[0])
        width = runner.decode_num_tokens_per_req()
        if runner.spec_algorithm.is_speculative():
            spec = importlib.import_module("sglang.srt.runtime_context").get_spec()
            width = max(width, *(getattr(spec, f, None) or 1 for f in ("speculative_num_draft_tokens",
                                                                      "speculative_eagle_topk")))
    except Exception as exc:  # the same on every rank: their runners are configured alike
        return None, f"default: SGLang's capture sizes not read ({type(exc).__name__}: {exc})"
    return requests * width, f"{requests} captured requests x {width} tokens"


# --- verdicts -----------------------------------------------------------------------------------
def _world(group) -> int:
    return serving.group_parts(group)[1]


def _gather_verdict(group, heads: int, nope: int, rope: int, dtype: torch.dtype, device: torch.device,
                    backend: Optional[str]) -> Optional[DcpAllToAll]:
    """The communicator of a layer's query gather (and of its combine: D = the gather's nope width,
    in the queries' dtype), building it if none was, or None (then SGLang's own serves)."""
    key = ("gather", id(group), heads, nope, rope, dtype, device, backend)
    if key in _verdicts:
        return _verdicts[key][0]
    comm, why = serving.serve(group, heads, nope, dtype, device, query=(nope + rope, dtype),
                              max_tokens=_max_tokens["tokens"], engine="SGLang")
    if comm is not None:
        _staging.setdefault(id(comm), torch.empty((comm.max_tokens, comm.heads_per_rank, comm.query_dim),
                                                  dtype=comm.query_dtype, device=comm.device))
    comm, why = _backend_verdict(comm, why, backend)
    _verdicts[key] = (comm, group)  # (the group kept alive with its id in the key)
    _log_once(key, f"N={_world(group)}, {heads} heads: query gather Dq={nope + rope} ({nope} + {rope}) {dtype}"
              + (f" and combine D={nope} {dtype}" if why is None else ""), comm, why, backend)
    return comm


def _combine_verdict(group, heads: int, d: int, dtype: torch.dtype, device: torch.device,
                     backend: Optional[str]) -> Optional[DcpAllToAll]:
    key = ("combine", id(group), heads, d, dtype, device, backend)
    if key in _verdicts:
        return _verdicts[key][0]
    comm, why = serving.serve(group, heads, d, dtype, device, max_tokens=_max_tokens["tokens"], engine="SGLang")
    comm, why = _backend_verdict(comm, why, backend)
    _verdicts[key] = (comm, group)
    _log_once(key, f"N={_world(group)}, {heads} heads: combine D={d} {dtype}", comm, why, backend)
    return comm


def _backend_verdict(comm, why, backend) -> tuple:
    if comm is not None and backend == "fi_a2a" and comm.backend == "nccl":
        return None, f"fi_a2a with a group this package reaches only through NCCL ({comm.backend_reason}): " \
                     "FlashInfer's all-to-all kept"
    return comm, why


_BACKEND_NOTES = {
    "a2a": "--dcp-comm-backend a2a: served",
    "ag_rs": "--dcp-comm-backend ag_rs overridden: served (DCP_A2A_SGLANG=1 serves every MLA layer)",
    "fi_a2a": "--dcp-comm-backend fi_a2a overridden: served (the group is on one host)",
}


def _log_once(key, what: str, comm, why, backend) -> None:
    if not serving.first_time("sglang", key) or (comm is not None
                                                  and not serving.first_time("sglang", (id(comm), backend))):
        return  # (a combine served by the communicator whose gather line said so already)
    if comm is None:
        (log.warning if "capture" in (why or "") else log.info)(
            "dcp_a2a: %s: SGLang's own kept (%s)", what, why)
        return
    tokens = _max_tokens["why"]
    log.info("dcp_a2a: %s on dcp-a2a (%s backend: %s; max_tokens %d, %s); %s", what, comm.backend,
             comm.backend_reason, comm.max_tokens, tokens, _BACKEND_NOTES.get(backend, f"backend {backend}"))


# --- the hooks (SGLang's hook registry calls them as AROUND hooks: the original first) ----------
def _a2a_combine(original, cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group: Any,
                 is_lse_base_on_e: bool = True, cuda_graph_buffers: Optional[dict] = None,
                 comm_backend: str = "a2a") -> torch.Tensor:
    """``dcp_a2a_lse_reduce``: ``[B, H, D]`` partials and ``[B, H]`` LSEs in, ``[B, H/N, D]`` out."""
    comm = None
    if isinstance(cp_attn_out, torch.Tensor) and cp_attn_out.dim() == 3:
        _, heads, d = cp_attn_out.shape
        comm = _combine_verdict(cp_group, heads, d, cp_attn_out.dtype, cp_attn_out.device, comm_backend)
    if comm is None:
        return original(cp_attn_out, cp_attn_lse, cp_group, is_lse_base_on_e=is_lse_base_on_e,
                        cuda_graph_buffers=cuda_graph_buffers, comm_backend=comm_backend)
    return comm.lse_reduce(cp_attn_out, cp_attn_lse, is_lse_base_on_e=is_lse_base_on_e)


def _ag_rs_combine(original, cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group: Any,
                   ctx: Any = None, is_lse_base_on_e: bool = False) -> torch.Tensor:
    """``cp_lse_ag_out_rs_mla`` (``ag_rs``): returns ``[H/N, B, D]``, as SGLang's reduce-scatter
    does (its caller transposes it back): here a transposed view of the ``[B, H/N, D]`` result."""
    comm = None
    if isinstance(cp_attn_out, torch.Tensor) and cp_attn_out.dim() == 3:
        _, heads, d = cp_attn_out.shape
        comm = _combine_verdict(cp_group, heads, d, cp_attn_out.dtype, cp_attn_out.device, "ag_rs")
    if comm is None:
        return original(cp_attn_out, cp_attn_lse, cp_group, ctx=ctx, is_lse_base_on_e=is_lse_base_on_e)
    return comm.lse_reduce(cp_attn_out, cp_attn_lse, is_lse_base_on_e=is_lse_base_on_e).transpose(0, 1)


def _query_gather(original, q_nope_out: torch.Tensor, q_pe: torch.Tensor) -> tuple:
    """``all_gather_q_for_mla_decode``: ``[B, H/N, nope]`` and ``[B, H/N, rope]`` in, every rank's
    heads out (``[B, H, nope]``, ``[B, H, rope]``), bit for bit: views of one gathered
    ``[B, H, nope + rope]`` tensor."""
    parallel = _get_parallel()
    group = parallel.dcp_group
    comm = None
    if (isinstance(q_nope_out, torch.Tensor) and isinstance(q_pe, torch.Tensor) and q_nope_out.dim() == 3
            and q_pe.dim() == 3 and q_nope_out.shape[:2] == q_pe.shape[:2] and q_nope_out.dtype == q_pe.dtype
            and q_nope_out.device == q_pe.device):
        _, local_heads, nope = q_nope_out.shape
        comm = _gather_verdict(group, local_heads * _world(group), nope, q_pe.shape[2], q_nope_out.dtype,
                               q_nope_out.device, parallel.dcp_comm_backend)
    if comm is None:
        return original(q_nope_out, q_pe)
    tokens, local_heads, nope = q_nope_out.shape
    stage = _staging.get(id(comm))
    if stage is None or tokens > stage.shape[0]:
        stage = torch.empty((tokens, local_heads, comm.query_dim), dtype=comm.query_dtype, device=comm.device)
    q = torch.cat([q_nope_out, q_pe], dim=-1, out=stage[:tokens])
    gathered = comm.all_gather_heads(q)
    return gathered[..., :nope], gathered[..., nope:]


def close_all() -> None:
    """Collective: close every communicator built here (drop captured graphs first)."""
    for cache in (_verdicts, _staging):
        cache.clear()
    serving.forget("sglang")
    serving.close_all()
