"""``python -m dcp.doctor`` as a user runs it, on this machine (no GPU in CI)."""

import json
import re
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
    # whether these are releases we test, without a GPU too (issue 42)
    assert lines[1].strip() == doctor.tested(doctor.versions()) and "the tested range" in lines[1], lines[1]
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
    # the table's columns and variant names explained beneath it (issue 42)
    legend = run.stdout[run.stdout.index("columns of the compiled-code table:"):]
    for term in ("variant ", "wN: N warps per program", "pdl: launched with programmatic dependent", "v4 st ",
                 "v4 ld ", "2-byte ", "spill ", "regs ", "smem "):
        assert term in legend, term
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
    (["--query-dim", "20", "--query-dtype", "float8_e5m2"], "query_dim must be a positive multiple of 16"),
])
def test_a_geometry_the_communicator_refuses_is_refused_up_front(args, message):
    run = _doctor(*args)
    assert run.returncode == 2 and message in run.stderr and run.stdout == ""


@pytest.mark.parametrize("size", ["0", "-1", "1", "9"])
def test_world_size_outside_2_to_8_is_refused(capsys, size):
    """0 once ran as N = 4 and exited 0 (issue 42)."""
    assert doctor.main(["--world-size", size]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"dcp.doctor: --world-size must be from 2 to 8; got {size}\n"


def test_says_whether_torch_and_triton_are_tested():
    span = "torch 2.11-2.14, Triton 3.6-3.9"
    assert doctor.tested({"torch": "2.14.1", "triton": "3.8.0"}) == (
        f"tested: torch 2.14.1 with Triton 3.8.0 (CI: the CPU tier on the users' stack (SGLang 0.5.23's pins; "
        f"vLLM 0.33.0's torch); the tested range: {span})")
    assert doctor.tested({"torch": "2.13.0+cpu", "triton": "3.6.0"}).startswith("tested: torch 2.13.0+cpu with ")
    assert doctor.tested({"torch": "2.12.1", "triton": "3.7.0"}).startswith(
        f"within the tested range ({span}): torch 2.12.1 with Triton 3.7.0, a pair not run itself (those run: "
        "2.11 with 3.6, 2.13 with 3.6, 2.14 with 3.8, 2.13 with 3.9)")
    assert doctor.tested({"torch": "2.15.0", "triton": "3.10.0"}) == (
        "not tested: torch 2.15.0 is outside the tested range 2.11-2.14; triton 3.10.0 is outside the tested "
        f"range 3.6-3.9 (tested: {span})")


def test_pyproject_declares_the_tested_range():
    text = (ROOT / "pyproject.toml").read_text()
    for name, ((major, low), (_, high)) in doctor.TESTED.items():
        assert f'"{name}>={major}.{low},<{major}.{high + 1}"' in text, name


def test_help_gives_every_option_its_text_and_default():
    """Issue 42: --heads-per-rank and --query-dtype had no help, and no option showed its default."""
    ap = doctor.parser()
    helps = {a.dest: doctor._Help("x")._get_help_string(a) for a in ap._actions if a.dest != "help"}
    assert len(helps) == 12
    for dest, text in helps.items():
        assert re.fullmatch(r"\w.* \(default: [^)]+\)", text, re.S), (dest, text)
    assert "columns of the compiled-code table:" in ap.format_help()


def test_the_doctor_and_the_benchmark_take_the_same_dtype_names():
    """Issue 42: bf16 in one, bfloat16 in the other; and the benchmark had no float32."""
    from bench.__main__ import parser as bench_parser

    bench = {a.dest: a for a in bench_parser(False, 0)._actions}
    ours = {a.dest: a for a in doctor.parser()._actions}
    for dest in ("dtype", "query_dtype"):
        assert list(bench[dest].choices) == list(ours[dest].choices), dest
    assert list(ours["dtype"].choices) == ["bfloat16", "float16", "float32"]
    for short, name in [("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32")]:
        assert doctor.parser().parse_args(["--dtype", short]).dtype == name
        assert bench_parser(False, 0).parse_args(["--dtype", short]).dtype == name
    assert bench_parser(False, 0).parse_args(["--query-dtype", "fp8"]).query_dtype == "float8_e4m3fn"


def test_import_and_doctor_start_where_numpy_is_not_installed():
    """The serving route installs this package alone (``pip install --no-deps .``) into an
    environment that may hold torch and Triton but no numpy: ``import dcp`` and the doctor must
    start there (issue 45). numpy is made unimportable as it is where it is missing."""
    code = ("import sys, runpy; sys.modules['numpy'] = None\n"
            "import dcp, dcp.protocol, dcp.plan\n"
            "assert sys.modules['numpy'] is None\n"
            "sys.argv = ['dcp.doctor']; runpy.run_module('dcp.doctor', run_name='__main__')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"versions: torch {torch.__version__}, triton "), run.stdout


def test_the_host_modules_of_planning_and_the_protocol_load_no_triton():
    """The protocol's numbers live in ``dcp.constants`` (plain Python): the host modules that plan
    and decode import them, not the kernel file, so they load without Triton, as ``import dcp``
    does until a communicator is used."""
    code = ("import sys\n"
            "import dcp, dcp.constants, dcp.protocol, dcp.plan, dcp.config\n"
            "assert 'triton' not in sys.modules, sorted(m for m in sys.modules if m.startswith('triton'))[:3]\n"
            "from dcp import DcpAllToAll\n"
            "assert 'triton' in sys.modules and DcpAllToAll.__module__ == 'dcp.comm'\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
