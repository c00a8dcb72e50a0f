"""The ``vllm.general_plugins`` entry point: with ``DCP_A2A_VLLM=1``, vLLM's DCP layers run both
collectives on this package.

vLLM calls ``register()`` in every process (engine and workers) before process groups exist and
before the model is built. It patches what it recognizes, by the symbols it finds (not by version):

- ``vllm.v1.attention.ops.dcp`` (``MLADCPManager``): the manager's combine and query gather, chosen
  once when each layer builds its manager, become this package's, ahead of vLLM's own transports
  (the direct symmetric-memory workspace included). The communicator is built there, collectively
  (the DCP group exists by then, graph capture comes later), one per geometry. vLLM's own path stays
  only where this package cannot serve (a group of one, an unsupported dtype or width, a call unlike
  the declared geometry); with PCP the manager's own choice stands.
- ``dcp_a2a_lse_reduce`` in ``vllm.v1.attention.ops.dcp`` and in the older
  ``vllm.v1.attention.ops.dcp_alltoall``: replaced there and in every loaded module that imported
  it by name, keeping vLLM's own as the fallback for geometries this package does not serve.
- The non-MLA attention implementations that bind that combine when vLLM builds its layers
  (``FlashAttentionImpl``, ``FlashInferImpl``; patched when their modules load): the communicator
  of their geometry is built there, before capture, like the MLA managers'. A combine that still
  reaches capture with none built is served by vLLM's own (``dcp.vllm.fallback_combine``).

Where an expected symbol is missing it says so and leaves that part of vLLM untouched.
"""

import functools
import importlib
import inspect
import logging
import sys
from typing import Optional

import torch

from dcp import serving
from dcp import vllm as dropin
from dcp.checks import query_geometry_error
from dcp.comm import DcpAllToAll
from dcp.config import plugin_enabled
from dcp.patching import when_imported

# A child of vLLM's logger, so that its lines appear in vLLM's log.
log = logging.getLogger("vllm.dcp_a2a")

ENV_ON = "DCP_A2A_VLLM"
MANAGER_MODULE = "vllm.v1.attention.ops.dcp"
ALLTOALL_MODULE = "vllm.v1.attention.ops.dcp_alltoall"
_MANAGER_ARGS = ("num_heads", "query_head_dim", "output_head_dim", "query_dtype", "output_dtype",
                 "padded_num_heads", "use_pcp")
_COMBINE_ARGS = ("num_heads", "head_dim", "dtype", "is_lse_base_on_e", "use_pcp")
_GATHER_ARGS = ("num_heads", "head_dim", "dtype")
# Attention implementations that bind the combine in __init__: (module, class).
IMPLS = (("vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl"),
         ("vllm.v1.attention.backends.flashinfer", "FlashInferImpl"))


def enabled() -> bool:
    return plugin_enabled(ENV_ON)


def register() -> None:
    """vLLM's plugin hook: patch vLLM's DCP transports if ``DCP_A2A_VLLM=1`` (else do nothing)."""
    if not enabled():
        return
    found = False
    for module_name, patch in ((MANAGER_MODULE, _patch_manager), (MANAGER_MODULE, _patch_function),
                               (ALLTOALL_MODULE, _patch_function)):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        found = True
        patch(module)
    if not found:
        log.warning("dcp_a2a: DCP_A2A_VLLM=1 but neither %s nor %s can be imported; vLLM left untouched",
                    MANAGER_MODULE, ALLTOALL_MODULE)
        return
    # Patched when vLLM imports them (importing them here would be heavy). One loaded other than from
    # a file stays unpatched: its combine is then built on first use, or served by vLLM's in capture.
    for module_name, _ in IMPLS:
        when_imported(module_name, _patch_impls)


def _patch_impls(module) -> None:
    """Wrap the module's attention implementation so that building one builds its communicator."""
    name = dict(IMPLS)[module.__name__]

    def wrap(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            _impl_comm(self)
        return __init__

    if serving.wrap_once(getattr(module, name, None), {"__init__": wrap}) == "missing":
        log.warning("dcp_a2a: %s has no %s with an __init__ of its own; its combine is built on first use",
                    module.__name__, name)


def _impl_comm(impl) -> None:
    """Build the communicator of an attention implementation that bound this package's combine
    (collective: every rank builds the same layers in the same order)."""
    if not any(getattr(v, "_dcp_a2a", False) or getattr(getattr(v, "func", None), "_dcp_a2a", False)
               for v in vars(impl).values()):
        return
    group = importlib.import_module("vllm.distributed.parallel_state").get_dcp_group()
    world = serving.group_parts(group)[1]
    heads, d = getattr(impl, "num_heads", 0) * world, getattr(impl, "head_size", 0)
    # vLLM builds its layers under the model's dtype; FlashAttention also records it.
    dtype = getattr(impl, "_dcp_dtype", None) or torch.get_default_dtype()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    comm, why = serving.serve(group, heads, d, dtype, device, max_tokens=getattr(impl, "_dcp_max_num_tokens", None),
                              engine="vLLM")
    if serving.first_time("vllm", ("impl", type(impl).__name__, world, heads, d, dtype)):
        if why is None:
            log.info("dcp_a2a: %s: N=%d, %d heads, combine D=%d %s on dcp-a2a (%s backend: %s; max_tokens %d), "
                     "built before capture", type(impl).__name__, world, heads, d, dtype, comm.backend,
                     comm.backend_reason, comm.max_tokens)
        else:
            log.info("dcp_a2a: %s: N=%d, %d heads, D=%d %s: vLLM's own combine kept (%s)", type(impl).__name__,
                     world, heads, d, dtype, why)


def _patch_manager(module) -> None:
    cls = getattr(module, "MLADCPManager", None)
    methods = ("__init__", "_init_combine", "_init_query_gather")
    missing = ["MLADCPManager"] if cls is None else [m for m in methods if not callable(getattr(cls, m, None))]
    if not missing:
        missing = [f"{m}({p})" for m, names in zip(methods, (_MANAGER_ARGS, _COMBINE_ARGS, _GATHER_ARGS))
                   for p in serving.missing_parameters(getattr(cls, m), names)]
    if missing:
        log.warning("dcp_a2a: %s lacks %s; its DCP manager left untouched", module.__name__, ", ".join(missing))
        return
    signatures = {m: inspect.signature(getattr(cls, m)) for m in methods}

    def bound(method, args, kwargs) -> dict:
        b = signatures[method].bind(*args, **kwargs)
        b.apply_defaults()
        return b.arguments

    def init(original):
        def __init__(self, *args, **kwargs):
            a = bound("__init__", (self,) + args, kwargs)
            self._dcp_a2a_geometry = {k: a[k] for k in _MANAGER_ARGS}
            original(self, *args, **kwargs)
        return __init__

    def init_combine(original):
        def _init_combine(self, *args, **kwargs):
            a = bound("_init_combine", (self,) + args, kwargs)
            comm = None if a["use_pcp"] else _manager_comm(self)
            if comm is None:
                return original(self, *args, **kwargs)
            base_e = bool(a["is_lse_base_on_e"])
            # For a call unlike the declared geometry (a backend's output dtype may differ): vLLM's own.
            own = getattr(module.__dict__.get("dcp_a2a_lse_reduce"), "__wrapped__", None)
            fallback = own and functools.partial(own, cp_group=self.group, is_lse_base_on_e=base_e)
            _note_no_fallback("combine", fallback)
            return functools.partial(_combine, comm, base_e, fallback)
        return _init_combine

    def init_query_gather(original):
        def _init_query_gather(self, *args, **kwargs):
            comm = _manager_comm(self)
            if comm is None or not self._dcp_a2a_serves_query:
                return original(self, *args, **kwargs)
            fallback = getattr(self, "_gather_query", None)
            _note_no_fallback("query gather", fallback)
            return functools.partial(_gather, comm, self._dcp_a2a_geometry["padded_num_heads"], fallback)
        return _init_query_gather

    done = serving.wrap_once(cls, {"__init__": init, "_init_combine": init_combine,
                                   "_init_query_gather": init_query_gather})
    if done == "missing":
        log.warning("dcp_a2a: %s.MLADCPManager inherits %s; its DCP manager left untouched", module.__name__,
                    ", ".join(m for m in methods if m not in cls.__dict__))
    elif done == "wrapped":
        log.info("dcp_a2a: %s.MLADCPManager patched: MLA DCP combine and query gather run on dcp-a2a "
                 "(DCP_A2A_VLLM=1), ahead of vLLM's own transports", module.__name__)


def _manager_comm(manager) -> Optional[DcpAllToAll]:
    """The communicator of a manager's geometry (built collectively on first use), or None where
    this package does not serve it; each verdict logged once per geometry."""
    if hasattr(manager, "_dcp_a2a_comm"):
        return manager._dcp_a2a_comm
    missing = [a for a in ("group", "device", "_dcp_a2a_geometry") if not hasattr(manager, a)]
    if missing:
        log.warning("dcp_a2a: an MLADCPManager has no %s when it picks its transports; vLLM's own kept",
                    ", ".join(missing))
        manager._dcp_a2a_comm, manager._dcp_a2a_serves_query = None, False
        return None
    g, group = manager._dcp_a2a_geometry, manager.group
    world = serving.group_parts(group)[1]
    heads = g["num_heads"] * world
    query_why = query_geometry_error(g["query_head_dim"], g["query_dtype"])
    query = None if query_why else (g["query_head_dim"], g["query_dtype"])
    # (a construction failure raises here, before capture, as vLLM builds the layer)
    comm, why = serving.serve(group, heads, g["output_head_dim"], g["output_dtype"], manager.device, query=query,
                              max_tokens=getattr(manager, "max_num_tokens", None), engine="vLLM",
                              decline_failure=False)
    # (vLLM's manager records whether the user chose the packed all-to-all, --dcp-comm-backend a2a)
    overridden = comm is not None and getattr(manager, "use_a2a", True) is False
    key = (world, heads, g["output_head_dim"], g["output_dtype"], g["query_head_dim"], g["query_dtype"])
    if serving.first_time("vllm", key):
        _log_verdict(key, why, query_why, comm, overridden)
    manager._dcp_a2a_comm, manager._dcp_a2a_serves_query = comm, comm is not None and query_why is None
    return comm


def _log_verdict(key, why, query_why, comm, overridden: bool) -> None:
    world, heads, d, dtype, dq, qdtype = key
    if comm is None:
        log.info("dcp_a2a: N=%d, %d heads, D=%d %s: vLLM's own combine and gather kept (%s)", world, heads, d,
                 dtype, why)
        return
    log.info("dcp_a2a: N=%d, %d heads, combine D=%d %s on dcp-a2a (%s backend: %s; max_tokens %d); query "
             "gather Dq=%d %s %s%s", world, heads, d, dtype, comm.backend, comm.backend_reason, comm.max_tokens, dq,
             qdtype,
             "on dcp-a2a" if query_why is None else f"kept on vLLM's own ({query_why})",
             "; vLLM's --dcp-comm-backend ag_rs overridden (DCP_A2A_VLLM=1 serves every MLA layer)" if overridden
             else "")


def _note_no_fallback(what: str, fallback) -> None:
    if fallback is None and serving.first_time("vllm", ("no fallback", what)):
        log.warning("dcp_a2a: vLLM's own %s was not found: a %s unlike the layer's declared dtype or shape "
                    "will raise", what, what)


def _unlike(what: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple, fallback) -> bool:
    """Whether a call differs from the communicator's geometry (then vLLM's own serves it, the
    same on every rank: the verdict reads only shapes and dtypes); logged once per kind of call."""
    if t.dtype is dtype and t.shape[1:] == shape or fallback is None:
        return False  # (without a fallback, the call raises naming what does not fit)
    if serving.first_time("vllm", (what, t.dtype, tuple(t.shape[1:]))):
        log.info("dcp_a2a: a %s of %s %s, not the %s %s declared: vLLM's own serves it", what, t.dtype,
                 list(t.shape[1:]), dtype, list(shape))
    return True


def _combine(comm: DcpAllToAll, base_e: bool, fallback, partial_output: torch.Tensor, partial_lse: torch.Tensor,
             *, seq_lens: Optional[torch.Tensor] = None, query_start_loc: Optional[torch.Tensor] = None):
    """The manager's ``combine(out, lse, *, seq_lens, query_start_loc)``; the metadata searched
    once per model step (``dcp.vllm.forward_step``)."""
    if _unlike("combine", partial_output, comm.dtype, (comm.num_heads, comm.head_dim), fallback):
        return fallback(partial_output, partial_lse, seq_lens=seq_lens, query_start_loc=query_start_loc)
    return comm.lse_reduce(partial_output, partial_lse, is_lse_base_on_e=base_e, seq_lens=seq_lens,
                           query_start_loc=query_start_loc,
                           step=None if seq_lens is None else dropin.forward_step())


def _gather(comm: DcpAllToAll, padded_num_heads: Optional[int], fallback, query: torch.Tensor) -> torch.Tensor:
    """The manager's ``query_gather(q)``: ``[B, H/N, Dq]`` -> ``[B, H, Dq]``, in storage reserved for
    ``padded_num_heads`` where the manager asks for it."""
    if _unlike("query gather", query, comm.query_dtype, (comm.heads_per_rank, comm.query_dim), fallback):
        return fallback(query)
    return comm.all_gather_heads(query, dropin.head_padded(query, comm.num_heads, padded_num_heads))


def _patch_function(module) -> None:
    """Replace ``module.dcp_a2a_lse_reduce`` and every loaded module's by-name import of it."""
    original = getattr(module, "dcp_a2a_lse_reduce", None)
    if original is None:
        if module.__name__ == ALLTOALL_MODULE:
            log.warning("dcp_a2a: %s has no dcp_a2a_lse_reduce; left untouched", module.__name__)
        return
    if getattr(original, "__wrapped__", None) is not None and getattr(original, "_dcp_a2a", False):
        return
    ours = dropin.fallback_combine(original)
    ours._dcp_a2a = True
    rebound = []
    for name, other in list(sys.modules.items()):
        namespace = getattr(other, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get("dcp_a2a_lse_reduce") is original:
            namespace["dcp_a2a_lse_reduce"] = ours
            rebound.append(name)
    log.info("dcp_a2a: dcp_a2a_lse_reduce replaced in %s (vLLM's own kept for geometries dcp-a2a does not serve)",
             ", ".join(sorted(rebound)))
