"""The GPU build of every kernel, compiled for Hopper (sm_90) without a GPU: the CPU tier runs the
same source interpreted, so this is where the compiled-only parts (inline PTX, vector widths) are
checked in CI."""

import re
import subprocess

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from dcp.protocol import ChannelLayout, ChannelRegion
from dcp.kernels import build_kernels


def _compile(kernel, pointers: dict, constexprs: dict, aligned_ptrs=(), num_warps: int = 8, pdl: bool = False):
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        elif name in ("seq_lens", "qsl"):  # vLLM's batch metadata: always int32 words
            sig[name] = "*i32"
        elif name == "log2_scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    attrs = {(kernel.arg_names.index(p),): [["tt.divisibility", 16]] for p in aligned_ptrs}
    src = ASTSource(fn=kernel, signature=sig, attrs=attrs,
                    constexprs={(kernel.arg_names.index(c),): v for c, v in constexprs.items()})
    options = {"num_warps": num_warps, "launch_pdl": pdl}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def _spill_bytes(ptx: str, tmp_path) -> int:
    """Bytes ptxas (Triton's own) spills to local memory for sm_90a: spills never show in PTX."""
    src = tmp_path / "kernel.ptx"
    src.write_text(ptx)
    out = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, check=True)
    found = re.findall(r"(\d+) bytes spill stores", out.stdout + out.stderr)
    assert found, f"no spill report from ptxas -v: {out.stderr[-500:]}"
    return sum(int(n) for n in found)


@pytest.mark.parametrize("lse_ty,scope,warps,pdl", [("fp32", "sys", 8, False), ("bf16", "sys", 8, True),
                                                    ("fp32", "gpu", 8, True), ("fp32", "gpu", 16, False),
                                                    ("fp32", "sys", 2, True), ("bf16", "gpu", 4, True)])
def test_fused_kernel_compiles_with_vector_rows_and_scoped_sync(lse_ty, scope, warps, pdl, tmp_path):
    lay = ChannelLayout(world=6, heads_per_rank=16, head_dim=512, max_tokens=512)
    assert set(lay.tilings) == {8, 16}
    region = ChannelRegion((lay, ChannelLayout(6, 16, 576, 512, lse=False)))
    ptx = _compile(build_kernels(False).fused,
                   {"po": "*bf16", "lse": f"*{lse_ty}", "y": "*bf16", "y_lse": "*fp32", "ctl": "*i64"},
                   dict(region.constexprs(lay, warps), ALIGNED=True, GPU_SCOPE=scope == "gpu", TRACE=False, PDL=pdl),
                   aligned_ptrs=("po", "y"), num_warps=warps, pdl=pdl)
    assert _spill_bytes(ptx, tmp_path) == 0, "register spills"
    other = {"sys": "gpu", "gpu": "sys"}[scope]
    assert f"fence.acq_rel.{scope}" in ptx and f"fence.acq_rel.{other}" not in ptx
    assert f"st.relaxed.{scope}.global.b64" in ptx and f"ld.relaxed.{scope}.global.b64" in ptx  # flag: B << 32 | epoch
    assert f"relaxed.{other}" not in ptx
    assert "%globaltimer" in ptx
    if pdl:  # wait for the previous grid before the epoch is read; release the next once all arrived
        wait, state = ptx.find("griddepcontrol.wait"), ptx.find("ld.volatile")
        release = ptx.find("griddepcontrol.launch_dependents")
        assert 0 <= wait < state and release > ptx.rfind(f"ld.relaxed.{scope}.global.b64")
    else:
        assert "griddepcontrol" not in ptx
    assert "atom.global.gpu.relaxed.add" in ptx and "trap" not in ptx  # the epoch advance; never trap
    # packed rows move as 16-byte vectors, both the pushes and the combine's reads
    assert len(re.findall(r"st\.global\.v4", ptx)) >= 6 and len(re.findall(r"ld\.global\.v4", ptx)) >= 12
    assert not re.search(r"st\.global\.b16", ptx), "scalar 2-byte row stores"
    if lse_ty == "fp32":  # (a bf16 LSE itself is read 2 bytes per row)
        assert not re.search(r"ld\.global\.b16", ptx), "scalar 2-byte row loads"


@pytest.mark.parametrize("words,warps", [(576, 8), (288, 2), (576, 16)])  # Dq = 576 bf16 (fp8: 288 words)
def test_gather_compiles_with_vector_rows(words, warps, tmp_path):
    """The query all-gather variant: rows of 16-bit words pushed and copied out as 16-byte vectors."""
    lay, gl = ChannelLayout(3, 16, 512, 512), ChannelLayout(3, 16, words, 512, lse=False)
    ptx = _compile(build_kernels(False).fused,
                   {"po": "*i16", "lse": "*fp32", "y": "*i16", "y_lse": "*fp32", "ctl": "*i64"},
                   dict(ChannelRegion((lay, gl)).constexprs(gl, warps), ALIGNED=True, GPU_SCOPE=True, TRACE=False,
                        PDL=True), aligned_ptrs=("po", "y"), num_warps=warps, pdl=True)
    assert _spill_bytes(ptx, tmp_path) == 0, "register spills"
    assert len(re.findall(r"st\.global\.v4", ptx)) >= 2 and len(re.findall(r"ld\.global\.v4", ptx)) >= 2
    assert not re.search(r"st\.global\.b16", ptx), "scalar 2-byte row stores"
    assert "trap" not in ptx and "griddepcontrol.wait" in ptx


@pytest.mark.parametrize("warps", [1, 8, 16])
def test_fp32_outputs_compile_with_vector_rows(warps, tmp_path):
    """fp32 partial outputs (two 16-bit words a value in the packed rows) still move as 16-byte
    vectors, pushes and combine reads alike, without spills."""
    lay = ChannelLayout(3, 16, 512, 512, value_words=2, num_warps=warps)
    ptx = _compile(build_kernels(False).fused,
                   {"po": "*fp32", "lse": "*fp32", "y": "*fp32", "y_lse": "*fp32", "ctl": "*i64"},
                   dict(ChannelRegion((lay, ChannelLayout(3, 16, 512, 512, lse=False))).constexprs(lay, warps),
                        ALIGNED=True, GPU_SCOPE=True, TRACE=False, PDL=False),
                   aligned_ptrs=("po", "y"), num_warps=warps)
    assert _spill_bytes(ptx, tmp_path) == 0, "register spills"
    assert len(re.findall(r"st\.global\.v4", ptx)) >= 2 and len(re.findall(r"ld\.global\.v4", ptx)) >= 4
    assert not re.search(r"(st|ld)\.global\.b16", ptx), "scalar 2-byte row accesses"


def test_nccl_path_kernels_compile():
    lay = ChannelLayout(world=3, heads_per_rank=16, head_dim=128, max_tokens=64)
    common = dict(lay.tile_constexprs(lay.warps_for(1)), ALIGNED=True)
    k = build_kernels(False)
    ptx = _compile(k.pack, {"po": "*bf16", "lse": "*fp32", "send": "*i32"}, common, ("po", "send"))
    assert re.search(r"st\.global\.v4", ptx)
    ptx = _compile(k.combine, {"recv": "*i32", "y": "*bf16", "y_lse": "*fp32"}, common, ("recv", "y"))
    assert re.search(r"ld\.global\.v4", ptx)


def test_clock_kernel_compiles():
    """The benchmark's mark: a counter on the device picks its slot, so graphs can hold it."""
    ptx = _compile(build_kernels(False).clock, {"out": "*i64"}, {}, num_warps=1)
    assert "atom.global.gpu.relaxed.add.u64" in ptx and "%globaltimer" in ptx
