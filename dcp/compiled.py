"""The communicator's kernels as a GPU would run them, compiled here without one, and judged.

Triton compiles for any NVIDIA architecture without a device (``GPUTarget``), and its own ptxas
reports registers and spills, so the machine code a user's Triton would produce can be checked
anywhere: in CI under each supported Triton, and by ``python -m dcp.doctor`` on a user's machine.
Only the aligned variants (16-byte aligned rows, as vLLM's tensors are) are the hot path; those are
the ones compiled here.
"""

import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
from triton.compiler import ASTSource

from dcp.launch import compile_options, fused_variants
from dcp.constants import KIND_COMBINE, KIND_GATHER
from dcp.kernels import build_kernels
from dcp.protocol import SMALL_CALL_WARPS, ChannelLayout, ChannelRegion

# What the doctor accepts for --arch: the compute capability of each.
ARCHES = {"sm_80": 80, "sm_86": 86, "sm_89": 89, "sm_90": 90, "sm_100": 100, "sm_120": 120}
_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
REGISTERS_PER_SM = 65536


@dataclass
class Variant:
    """One kernel variant a communicator of some geometry loads: what Triton is given."""

    name: str
    kernel: object
    pointers: dict  # pointer argument -> Triton type ("*bf16", ...)
    constexprs: dict
    options: dict


@dataclass
class Verdict:
    """What the compiled code of one variant for one architecture looks like, and what is wrong."""

    variant: str
    arch: str
    warps: int
    vector_stores: int  # 16-byte global stores (st.global.v4)
    vector_loads: int
    scalar_16bit: int  # 2-byte global loads and stores: rows that lost their vectors
    spill_bytes: int
    registers: int
    shared_bytes: int
    problems: list = field(default_factory=list)
    ptx: str = field(default="", repr=False)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "ptx"} | {"ok": self.ok}


def hot_variants(world: int, heads_per_rank: int, head_dim: int, query_dim: int, dtype: torch.dtype,
                 query_dtype: torch.dtype, max_tokens: int = 512, programs: int = 132,
                 gpu_scope: bool = False, pdl: bool = True, transports: tuple = ("push", "pull")) -> list:
    """The aligned variants a communicator of this geometry loads: the fused kernel in every tiling
    of both collectives for each of ``transports`` (push, pull), and the NCCL path's pack and
    combine kernels. ``programs``: the grid each rank keeps (``DcpAllToAll``'s default: the GPU's
    SMs over the ranks sharing it); ``gpu_scope``: every rank on one GPU; ``pdl``: the GPU has
    programmatic dependent launch (9.0 and up)."""
    lay = ChannelLayout(world, heads_per_rank, head_dim, max_tokens, programs=programs,
                        value_words=dtype.itemsize // 2)
    gl = ChannelLayout(world, heads_per_rank, query_dim * query_dtype.itemsize // 2, max_tokens, programs=programs,
                       lse=False)
    k = build_kernels(interpret=False)
    val = "*" + _TRITON_TYPES[dtype]
    out = []
    for transport in transports:
        for (kind, warps), (constexprs, options) in fused_variants({KIND_COMBINE: lay, KIND_GATHER: gl},
                                                                    ChannelRegion((lay, gl)), gpu_scope, False, pdl,
                                                                    transport == "pull").items():
            rows = val if kind == KIND_COMBINE else "*i16"  # the gather moves 16-bit words
            name = (f"{transport} {'combine' if kind == KIND_COMBINE else 'gather'} w{warps}"
                    f"{' pdl' if options['launch_pdl'] else ''}")
            out.append(Variant(name, k.fused, {"po": rows, "lse": "*fp32", "y": rows, "y_lse": "*fp32",
                                               "ctl": "*i64"}, dict(constexprs, ALIGNED=True), options))
    w = SMALL_CALL_WARPS
    common = dict(lay.tile_constexprs(w), ALIGNED=True)
    out.append(Variant(f"nccl pack w{w}", k.pack, {"po": val, "lse": "*fp32", "send": "*i32"}, common,
                       compile_options(w)))
    out.append(Variant(f"nccl combine w{w}", k.combine, {"recv": "*i32", "y": val, "y_lse": "*fp32"}, common,
                       compile_options(w)))
    return out


def compile_ptx(variant: Variant, capability: int) -> tuple:
    """(PTX, Triton's compiled metadata) of a variant for a compute capability; no GPU needed."""
    kernel = variant.kernel
    sig = {}
    for name in kernel.arg_names:
        if name in variant.constexprs:
            sig[name] = "constexpr"
        elif name in variant.pointers:
            sig[name] = variant.pointers[name]
        elif name in ("seq_lens", "qsl"):  # vLLM's batch metadata: always int32 words
            sig[name] = "*i32"
        elif name == "tmask":  # a step's empty-token mask: a byte per token
            sig[name] = "*i8"
        elif name == "log2_scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    aligned = [p for p in ("po", "y", "send", "recv") if p in variant.pointers]  # rows: 16-byte aligned
    attrs = {(kernel.arg_names.index(p),): [["tt.divisibility", 16]] for p in aligned}
    options, constexprs = dict(variant.options), dict(variant.constexprs)
    if capability < 90:  # no programmatic dependent launch before Hopper: the communicator turns it off
        options["launch_pdl"] = False
        if "PDL" in constexprs:
            constexprs["PDL"] = False
    src = ASTSource(fn=kernel, signature=sig, attrs=attrs,
                    constexprs={(kernel.arg_names.index(c),): v for c, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)
    return compiled.asm["ptx"], compiled.metadata


def ptxas_report(ptx: str, capability: int) -> dict:
    """Registers, spilled bytes and static shared memory of PTX, from Triton's own ptxas: spills
    never show in PTX."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        run = subprocess.run([get_ptxas(capability).path, f"-arch={sm_arch_from_capability(capability)}", "-v",
                              str(src), "-o", str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True)
    text = run.stdout + run.stderr
    if run.returncode != 0:
        raise RuntimeError(f"ptxas failed for sm_{capability}: {text[-500:]}")
    spills = re.findall(r"(\d+) bytes spill stores", text)
    regs = re.search(r"Used (\d+) registers", text)
    if not spills or not regs:
        raise RuntimeError(f"no register report from ptxas -v: {text[-500:]}")
    return {"spill_bytes": sum(map(int, spills)), "registers": int(regs.group(1))}


def judge(variant: Variant, capability: int) -> Verdict:
    """Compile a variant for ``capability`` and say what is wrong with its machine code."""
    ptx, meta = compile_ptx(variant, capability)
    report = ptxas_report(ptx, capability)
    st = len(re.findall(r"st\.global(?:\.\w+)*\.v4", ptx))
    ld = len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx))
    scalar = len(re.findall(r"(?:ld|st)\.global(?:\.\w+)*\.b16\b", ptx))
    verdict = Verdict(variant.name, f"sm_{capability}", variant.options["num_warps"], st, ld, scalar,
                      report["spill_bytes"], report["registers"], int(getattr(meta, "shared", 0)), ptx=ptx)
    p = verdict.problems
    if not st:
        p.append("rows are not stored as 16-byte vectors")
    if not ld:
        p.append("rows are not loaded as 16-byte vectors")
    if scalar:
        p.append(f"{scalar} scalar 2-byte global accesses")
    if verdict.spill_bytes:
        p.append(f"{verdict.spill_bytes} bytes of register spills")
    if verdict.registers * 32 * verdict.warps > REGISTERS_PER_SM:
        p.append(f"{verdict.registers} registers: a program does not fit on one SM")
    return verdict


def judge_all(variants: list, capabilities: list) -> list:
    return [judge(v, c) for c in capabilities for v in variants]

