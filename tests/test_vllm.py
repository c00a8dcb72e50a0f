"""The vLLM integration on the CPU tier: the drop-ins, and the plugin inside a stand-in vLLM
(``tests/standin_vllm``) driven across rank processes over gloo."""

import logging
import re
import types
from pathlib import Path

import pytest
import torch

from dcp import serving
from dcp import vllm as dropin
from dcp import vllm_plugin
from tests import rank_cases as rc
from tests import vllm_cases as vc
from tests.conftest import fresh_seed

README = Path(__file__).parent.parent / "README.md"
OWN_TRANSPORTS = {"dcp_a2a_lse_reduce", "cp_lse_ag_out_rs", "direct_workspace.lse_reduce",
                  "get_direct_dcp_a2a_workspace", "get_direct_dcp_q_gather_workspace",
                  "GroupCoordinator.all_gather"}


@pytest.mark.parametrize("n,dtype,query_dtype", [(2, "bfloat16", "float8_e4m3fn"), (3, "float32", "bfloat16")])
def test_plugin_runs_both_collectives_of_vllms_mla_layer(worlds, n, dtype, query_dtype):
    res = worlds(n).run(vc.current_lineage, fresh_seed(), True, dtype, query_dtype)
    for r in res:
        assert r["err"] <= rc.TOL[rc.DTYPES[dtype]]
        assert not set(r["vllm_calls"]) & OWN_TRANSPORTS, r["vllm_calls"]  # none of vLLM's own ran
        assert r["communicators"] == 1  # one per geometry, every layer on it
    lines = res[0]["log"]
    for quoted in _readme_log_lines():  # what the README tells a user to look for, up to figures
        # the transport and why depend on the machine (the README's is a GPU's measured plan)
        quoted = re.sub(r"\(\w+ backend: .*?; max_tokens", "(@REASON@; max_tokens", quoted)
        parts = re.split(r"torch\.\w+", quoted)  # dtypes, and then numbers, may differ
        pattern = r"torch\.\w+".join(re.sub(r"\d+", r"\\d+", re.escape(p)) for p in parts)
        pattern = pattern.replace("@REASON@", r"\w+ backend: .*")
        assert any(re.fullmatch(pattern, line) for line in lines), (quoted, lines)
    assert any(f"N={n}, {2 * n} heads" in line for line in lines), lines


def test_the_log_says_when_the_users_ag_rs_choice_is_overridden(worlds):
    """vLLM's default --dcp-comm-backend ag_rs: the plugin still serves the MLA layers (README),
    and its log line says so; with a2a chosen it says nothing of the kind."""
    res = worlds(2).run(vc.current_lineage, fresh_seed(), True, "bfloat16", "bfloat16", "ag_rs")
    assert all(not set(r["vllm_calls"]) & OWN_TRANSPORTS and r["err"] <= rc.TOL[torch.bfloat16] for r in res)
    assert any(line.endswith("; vLLM's --dcp-comm-backend ag_rs overridden (DCP_A2A_VLLM=1 serves every MLA layer)")
               for line in res[0]["log"]), res[0]["log"]
    chosen = worlds(2).run(vc.current_lineage, fresh_seed(), True)[0]["log"]
    assert not any("overridden" in line for line in chosen), chosen



def test_non_mla_layers_build_their_communicator_before_capture(worlds):
    """vLLM 0.33.0's FlashAttention impl reaches the patched combine with no manager: the plugin
    builds its communicator when the impl is built, so a call in capture needs nothing new; a
    geometry never built goes to vLLM's own in capture, logged, instead of raising."""
    res = worlds(2).run(vc.non_mla_impl_before_capture, fresh_seed())
    for r in res:
        assert r["built_at_init"] == 1 and r["comms_after"] == 1, r
        assert not r["calls_ours"], r["calls_ours"]  # the first call in capture ran on ours
        assert r["calls_after"] == {"dcp_a2a_lse_reduce": 1}, r["calls_after"]  # the unbuilt one: vLLM's own
        assert r["err"] <= rc.TOL[torch.bfloat16] and r["err_other"] <= rc.TOL[torch.bfloat16], r
    log = res[0]["log"]
    assert any(line.startswith("dcp_a2a: FlashAttentionImpl: N=2, 4 heads, combine D=64 torch.bfloat16 on dcp-a2a")
               and line.endswith("built before capture") for line in log), log
    assert any("vLLM's own serves a combine of torch.bfloat16" in line and serving.IN_CAPTURE in line
               for line in log), log


def _readme_log_lines() -> list:
    block = re.search(r"<!-- vllm-log -->\s*```\n(.*?)```", README.read_text(), re.S).group(1)
    return block.strip().splitlines()


def test_without_the_variable_vllm_keeps_its_own(worlds):
    res = worlds(2).run(vc.current_lineage, fresh_seed(), False)
    for r in res:
        assert r["err"] <= rc.TOL[torch.bfloat16]
        assert r["vllm_calls_at_build"]["get_direct_dcp_a2a_workspace"] == 2  # the direct workspace won
        # B = 11 is above its 8 tokens: vLLM's workspace falls back to its packed combine (2 layers),
        # which also serves the module-level call; the gathers go through the group.
        assert r["vllm_calls"]["dcp_a2a_lse_reduce"] == 3 and "direct_workspace.lse_reduce" not in r["vllm_calls"]
        assert r["vllm_calls"]["GroupCoordinator.all_gather"] == 2
        assert r["communicators"] == 0 and r["log"] == []


def test_calls_unlike_the_declared_geometry_go_to_vllms_own(worlds):
    for r in worlds(2).run(vc.unlike_declared, fresh_seed()):
        assert r["vllm_calls"]["dcp_a2a_lse_reduce"] == 1 and r["vllm_calls"]["GroupCoordinator.all_gather"] == 1
        assert len(r["log"]) == 2, r["log"]


def test_plugin_rebinds_the_older_lineage_everywhere(worlds):
    res = worlds(2).run(vc.legacy_lineage, fresh_seed(), True)
    for r in res:
        assert r["err"] <= rc.TOL[torch.bfloat16]
        assert r["rebound"] == [True, True] and "dcp_a2a_lse_reduce" not in r["vllm_calls"], r
    lines = res[0]["log"]
    assert [line for line in lines if "ignoring keyword" in line] == [
        "dcp.vllm.dcp_a2a_lse_reduce: ignoring keyword(s) b12x_max_batch_size, b12x_query_head_dim, use_b12x "
        "(not needed by this backend)"], lines  # logged once
    assert any("vllm.v1.attention.backends.mla.common" in line for line in lines), lines


def test_legacy_lineage_without_the_variable(worlds):
    res = worlds(2).run(vc.legacy_lineage, fresh_seed(), False)
    assert all(r["vllm_calls"]["dcp_a2a_lse_reduce"] == 3 and r["rebound"] == [False, False] for r in res), res


def test_a_missing_symbol_leaves_vllm_untouched(worlds):
    untouched, *lines = worlds(2).run(vc.missing_symbols)[0]
    assert untouched and lines and "_init_query_gather" in lines[0], lines


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_semantics_of_vllms_own_combine_tests(worlds, dtype):
    for r in worlds(3).run(vc.semantics, fresh_seed(), dtype):
        assert all(v for k, v in r.items() if k != "dtype"), r
        assert r["dtype"] == f"torch.{dtype}"


def test_dropin_with_a_group_coordinator(worlds):
    errs = worlds(3).run(vc.vllm_dropin, fresh_seed())
    assert all(e <= rc.TOL[torch.bfloat16] for e in errs)


def test_a_group_of_one_returns_the_inputs():
    one = types.SimpleNamespace(world_size=1, device_group=None)
    out, lse = torch.randn(3, 4, 8), torch.randn(3, 4)
    assert dropin.dcp_a2a_lse_reduce(out, lse, one) is out
    y, yl = dropin.dcp_a2a_lse_reduce(out, lse, kvp_group=one, return_lse=True)
    assert y is out and yl is lse
    assert dropin.query_gather(out, one) is out


def test_dropin_errors_name_the_problem():
    with pytest.raises(TypeError, match="missing the group"):
        dropin.dcp_a2a_lse_reduce(torch.randn(1, 2, 8), torch.randn(1, 2))
    with pytest.raises(TypeError, match="device_group"):
        dropin.dcp_a2a_lse_reduce(torch.randn(1, 2, 8), torch.randn(1, 2), object())


def test_plugin_does_nothing_unless_asked(monkeypatch, caplog):
    monkeypatch.delenv("DCP_A2A_VLLM", raising=False)
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
        monkeypatch.setenv("DCP_A2A_VLLM", "0")
        vllm_plugin.register()
    assert caplog.records == []
    monkeypatch.setenv("DCP_A2A_VLLM", "1")
    with caplog.at_level(logging.WARNING, logger="vllm.dcp_a2a"):
        vllm_plugin.register()  # no vLLM in this process: says so, changes nothing
    assert any("neither" in r.getMessage() for r in caplog.records), caplog.records


def test_max_tokens_variable_is_validated(monkeypatch):
    monkeypatch.setenv("DCP_A2A_MAX_TOKENS", "0")
    with pytest.raises(Exception, match="DCP_A2A_MAX_TOKENS must be a positive integer"):
        dropin.max_tokens_from_env()
    monkeypatch.setenv("DCP_A2A_MAX_TOKENS", "96")
    assert dropin.max_tokens_from_env() == 96


def test_the_serving_layer_keeps_each_geometry_on_its_own_communicator(worlds):
    res = worlds(2).run(vc.serving_keeps_geometries_apart)
    for r in res:
        assert r["distinct"] and r["b"] == (128, torch.float16, 72) and r["combine_reuses"], r
        assert r["coordinator_reuses"] and r["built"] == 2, r
        assert r["why"] == "num_heads must be a positive multiple of the group size 2; got 5", r


def test_the_patched_combine_falls_back_wherever_this_package_declines(worlds):
    """A device this package does not serve, or a construction that failed: vLLM's own combine
    serves the call, as the plugin's log says, instead of raising; the failure is not retried."""
    for r in worlds(2).run(vc.combine_where_declined):
        assert r["meta"] == r["failed"][0] == r["failed"][1] == "vLLM's own", r
        assert r["calls"] == ["meta", "cpu", "cpu"] and r["tries"] == 1, r
        assert r["why"].startswith("construction failed: ") and "no-such-backend" in r["why"], r
        assert r["forgotten"], r
