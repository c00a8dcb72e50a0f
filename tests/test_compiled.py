"""The GPU build of every kernel, compiled without a GPU for Hopper (sm_90), Blackwell (sm_100) and
the RTX PRO 6000 (sm_120): the CPU tier runs the same source interpreted, so this is where the
compiled-only parts (inline PTX, vector widths, registers) are checked, under each Triton CI
installs (3.6 and 3.9 in ``.ci/run``, 3.8 in ``.ci/users_stack``)."""

import re

import pytest
import torch

from dcp.compiled import compile_ptx, hot_variants, judge

# (world, query dtype, output dtype, architectures, transports): the hot path's aligned variants of
# each (the pull where its PCIe fabrics are: sm_90 and the RTX PRO 6000's sm_120).
GEOMETRIES = [(3, torch.bfloat16, torch.bfloat16, (90,), ("push",)),
              (6, torch.bfloat16, torch.bfloat16, (90, 100, 120), ("push",)),
              (6, torch.bfloat16, torch.bfloat16, (90, 120), ("pull",)),
              (8, torch.bfloat16, torch.bfloat16, (90,), ("push", "pull")),
              (3, torch.bfloat16, torch.float32, (90,), ("push",)),
              (6, torch.float8_e4m3fn, torch.bfloat16, (90,), ("push",))]


def _cases():
    for world, qdt, dt, arches, transports in GEOMETRIES:
        for v in hot_variants(world, 16, 512, 576, dt, qdt, transports=transports):
            if (dt == torch.float32 and "combine" not in v.name) or (qdt != torch.bfloat16 and "gather" not in v.name) \
                    or (transports == ("pull",) and v.name.startswith("nccl")):
                continue  # (only what the other dtype or transport changes)
            for cap in arches:
                yield pytest.param(v, cap, id=f"N{world}-{str(qdt if qdt != dt else dt)[6:]}-{v.name}-sm{cap}")


@pytest.mark.parametrize("variant,cap", list(_cases()))
def test_hot_variant_has_vector_rows_and_no_spills(variant, cap):
    """16-byte vector loads and stores for every row, no 2-byte scalar access, no spills, and a
    program that fits on one SM (the verdict ``python -m dcp.doctor`` prints)."""
    verdict = judge(variant, cap)
    assert verdict.ok, verdict.problems


@pytest.mark.parametrize("transport", ["push", "pull"])
@pytest.mark.parametrize("scope,warps,pdl", [("sys", 8, False), ("sys", 2, True), ("gpu", 8, True),
                                             ("gpu", 16, False)])
def test_fused_kernel_synchronizes_at_its_scope_without_atomics_on_peers(scope, warps, pdl, transport):
    """Flags are relaxed 64-bit stores and loads ordered by fences of one scope; the only
    read-modify-write is the local epoch advance (so no P2P atomics, which PCIe pairs may lack);
    nothing traps; PDL waits before the epoch read."""
    v = next(v for v in hot_variants(6, 16, 512, 576, torch.bfloat16, torch.bfloat16, gpu_scope=scope == "gpu",
                                      pdl=pdl, transports=(transport,)) if f"combine w{warps}" in v.name)
    v.constexprs["PDL"] = v.options["launch_pdl"] = pdl
    ptx, _ = compile_ptx(v, 90)
    other = {"sys": "gpu", "gpu": "sys"}[scope]
    assert f"fence.acq_rel.{scope}" in ptx and f"fence.acq_rel.{other}" not in ptx
    assert f"st.relaxed.{scope}.global.b64" in ptx and f"ld.relaxed.{scope}.global.b64" in ptx  # flag: B << 32 | epoch
    assert f"relaxed.{other}" not in ptx and "%globaltimer" in ptx
    if pdl:  # wait for the previous grid before the epoch is read; release the next once all arrived
        wait, state = ptx.find("griddepcontrol.wait"), ptx.find("ld.volatile")
        release = ptx.find("griddepcontrol.launch_dependents")
        assert 0 <= wait < state and release > ptx.rfind(f"ld.relaxed.{scope}.global.b64")
    else:
        assert "griddepcontrol" not in ptx
    # The epoch advance (atom, or red where its result is unused) is the one read-modify-write.
    rmw = re.findall(r"\b(?:atom|red)\.[\w.]+", ptx)
    assert rmw and all(re.fullmatch(r"(?:atom|red)\.global\.gpu\.relaxed\.add\.u32", a) for a in rmw), rmw
    assert "trap" not in ptx


def test_clock_kernel_compiles():
    """The benchmark's mark: a counter on the device picks its slot, so graphs can hold it."""
    from dcp.compiled import Variant
    from dcp.kernels import build_kernels
    from dcp.launch import compile_options

    ptx, _ = compile_ptx(Variant("clock", build_kernels(False).clock, {"out": "*i64"}, {}, compile_options(1)), 90)
    assert "atom.global.gpu.relaxed.add.u64" in ptx and "%globaltimer" in ptx
