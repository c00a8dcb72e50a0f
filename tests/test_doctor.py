"""``python -m dcp.doctor`` as a user runs it, on this machine (no GPU in CI)."""

import json
import subprocess
import sys

import pytest
import torch

import dcp.doctor as doctor
from dcp.compiled import hot_variants

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def _doctor(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dcp.doctor", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU answer")
def test_without_a_gpu_or_arch_it_says_what_it_could_not_check():
    run = _doctor()
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith(f"versions: torch {torch.__version__}, triton ")
    assert [line for line in lines if "not checked" in line] == [
        "compiled code not checked: no GPU here; name an architecture with --arch (for example --arch sm_90 "
        "--arch sm_120)"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU answer")
def test_measure_without_a_gpu_says_so(tmp_path):
    run = _doctor("--measure", "--json", str(tmp_path / "r.json"))
    assert run.returncode == 0 and "not measured: no GPU here" in run.stdout.splitlines(), run.stdout + run.stderr
    assert json.loads((tmp_path / "r.json").read_text())["measure"] is None


def test_arch_compiles_every_variant_writes_ptx_and_json(tmp_path):
    run = _doctor("--arch", "sm_90", "--world-size", "3", "--ptx-dir", str(tmp_path / "ptx"), "--json",
                  str(tmp_path / "r.json"))
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    names = [v.name for v in hot_variants(3, 16, 512, 576, torch.bfloat16, torch.bfloat16)]
    assert [v["variant"] for v in report["verdicts"]] == names and all(v["ok"] for v in report["verdicts"])
    assert all(v["spill_bytes"] == 0 and v["scalar_16bit"] == 0 and v["vector_stores"] > 0
               for v in report["verdicts"])
    ptx = sorted((tmp_path / "ptx").glob("*.ptx"))
    assert len(ptx) == len(names) and all("st.global.v4" in p.read_text() for p in ptx)
    assert f"{len(names)} of {len(names)} variants ok" in run.stdout
    assert report["geometry"]["world_size"] == 3 and report["versions"]["torch"] == torch.__version__


def test_before_hopper_the_variants_compile_without_programmatic_launch(tmp_path):
    """sm_80 has no griddepcontrol: the communicator turns PDL off there, and so does the doctor."""
    assert doctor.main(["--arch", "sm_80", "--world-size", "2", "--ptx-dir", str(tmp_path)]) == 0
    ptx = [p.read_text() for p in tmp_path.glob("*.ptx")]
    assert ptx and not any("griddepcontrol" in p for p in ptx)


def test_a_bad_verdict_exits_1(monkeypatch, capsys):
    """The verdict decides the exit status: a variant whose rows lost their vectors fails."""
    real = doctor.judge

    def scalar_rows(variant, cap):
        verdict = real(variant, cap)
        if "gather" in variant.name:
            verdict.problems.append("64 scalar 2-byte global accesses")
        return verdict

    monkeypatch.setattr(doctor, "judge", scalar_rows)
    assert doctor.main(["--arch", "sm_90", "--world-size", "3"]) == 1
    out = capsys.readouterr().out
    assert "BAD: 64 scalar 2-byte global accesses" in out and "the backend would run slower" in out


@pytest.mark.parametrize("args,message", [
    (["--world-size", "9"], "--world-size must be from 2 to 8; got 9"),
    (["--head-dim", "12", "--arch", "sm_90"], "head_dim must be"),
    (["--query-dim", "20", "--query-dtype", "fp8"], "query_dim must be a positive multiple of 16"),
])
def test_a_geometry_the_communicator_refuses_is_refused_up_front(args, message):
    run = _doctor(*args)
    assert run.returncode == 2 and message in run.stderr and run.stdout == ""
