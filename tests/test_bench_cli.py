"""The benchmark's command line on a machine without a GPU: arguments checked before any rank is
spawned, each refusal one line; a failure every rank shares one line too; groups above the triton
path's 8 ranks run the nccl backend (gloo here); every option's help with its default."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU tier's command line")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _refused(capsys, *args) -> str:
    """The one line ``main`` prints for arguments it refuses (exit code 2), nothing on stdout."""
    from bench.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_unknown_mode_refused_in_one_line(capsys):
    line = _refused(capsys, "--modes", "eager", "bogus")
    assert "argument --modes: invalid choice: 'bogus' (choose from 'eager', 'graph', 'graph8')" in line


def test_unknown_backend_refused_in_one_line(capsys):
    assert "argument --backends: invalid choice: 'gloo'" in _refused(capsys, "--backends", "gloo")


@pytest.mark.parametrize("mode", ["graph", "graph8"])
def test_graph_modes_refused_without_a_gpu(capsys, mode):
    line = _refused(capsys, "--modes", "eager", mode)
    assert "--modes graph and graph8 need a GPU (they capture CUDA graphs)" in line


def test_group_of_one_refused_in_one_line(capsys):
    assert "argument --world-size: a DCP group needs at least 2 ranks, got 1" in _refused(capsys, "--world-size", "1")


def test_help_describes_every_option_with_its_default(capsys):
    from bench.__main__ import main, parser

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "``" not in out and ":func:" not in out
    options = out[out.index("\noptions:\n"):out.index("\n\n", out.index("\noptions:\n") + 1)]
    # One entry per option: its flags on the first line, its help indented below or beside them.
    entries = re.split(r"\n  (?=-)", options)[1:]
    flags = {e.split()[0].rstrip(",") for e in entries}
    assert flags == {a.option_strings[0] for a in parser(False, 0)._actions}
    for e in entries:
        if not e.startswith("-h"):
            assert re.search(r"\(default: [^)]+\)", " ".join(e.split())), e
    assert "--world-size N [N ...]" in out and "(default: 3 6)" in " ".join(out.split())


def _bench(*args, script="-m bench", timeout=600) -> subprocess.CompletedProcess:
    """The benchmark as a user starts it: ``python -m bench`` or the console script."""
    start = (["-m", "bench"] if script == "-m bench" else
             ["-c", f"import sys; from bench.__main__ import main; sys.argv[0] = {script!r}; main()"])
    return subprocess.run([sys.executable, *start, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("module", ["bench", "dcp.bench"])
def test_usage_names_the_command_that_was_run(module):
    """``python -m dcp.bench`` (the name that works after pip install) says so, not ``python -m
    bench`` (issue 42); the console script's name: tests/test_wheel.py."""
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.startswith(f"usage: python -m {module} [-h]"), proc.stdout[:200]
    proc = subprocess.run([sys.executable, "-m", module, "--world-size", "1"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.startswith(f"python -m {module}: error: "), proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--head-dim", "12"], "--head-dim: must be a positive multiple of 8 up to 1024; got 12"),
    (["--head-dim", "64", "2048"], "--head-dim: must be a positive multiple of 8 up to 1024; got 2048"),
    (["--query-dim", "12"], "--query-dim: must be a positive multiple of 8 up to 1024; got 12"),
    (["--query-dim", "24", "--query-dtype", "float8_e4m3fn"], "--query-dim: must be a positive multiple of 16"),
])
def test_geometry_refused_before_any_rank_starts(capsys, args, message):
    """The communicator's own rules, checked up front: one line, no rank spawned."""
    assert message in _refused(capsys, *args)


def test_query_dim_unchecked_where_no_gather_runs(tmp_path):
    """--query-dim matters only to the gather: a combine-only run ignores it."""
    from bench.__main__ import geometry_error, parser

    assert geometry_error(parser(False, 0).parse_args(["--op", "combine", "--query-dim", "12"])) is None


def test_help_explains_every_column():
    """Every header the table can print is explained in --help (the epilog's columns list)."""
    from bench.__main__ import COLUMN_HELP, COLUMNS

    for head, *_ in COLUMNS:
        name = head.format(baseline="nccl")
        assert re.search(rf"(?<![\w%|]){re.escape(name)}(?![\w|])", COLUMN_HELP), name


def test_rank_failures_that_differ_keep_the_first_traceback():
    from bench.__main__ import rank_failure
    from dcp.spawn import RankError

    tb = lambda name, msg: f"Traceback (most recent call last):\n  File \"x.py\", line 1\n{name}: {msg}\n"
    shared = RankError({r: ("DcpError", tb("dcp.errors.DcpError", "bad")) for r in (0, 1)})
    assert rank_failure(shared) == "DcpError: bad"
    differ = RankError({1: ("AssertionError", tb("AssertionError", "B=1: result differs")),
                        2: ("DcpPeerLostError", tb("dcp.errors.DcpPeerLostError", "rank 1 lost"))})
    *trace, last = rank_failure(differ).splitlines()
    assert trace[0].startswith("Traceback") and trace[-1] == "AssertionError: B=1: result differs"
    assert last == "rank 1: AssertionError: B=1: result differs; rank 2: DcpPeerLostError: rank 1 lost"


def test_group_above_eight_runs_the_nccl_backend_only(tmp_path):
    """N = 9, started as the console script: triton left out in one line, the nccl backend (gloo
    here) runs; the speedup plot of an earlier run is removed (this run has no triton rows)."""
    (tmp_path / "speedup.png").write_bytes(b"from an earlier run")
    proc = _bench("--world-size", "9", "--heads-per-rank", "1", "--head-dim", "8", "--batch", "1", "--iters", "1",
                  "--op", "combine", "--backends", "triton", "nccl",
                  "--out", str(tmp_path), script="/usr/local/bin/dcp-a2a-bench")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "N=9: triton not run (the triton path serves up to 8 ranks); gloo only" in proc.stdout.splitlines()
    run = json.loads((tmp_path / "results.json").read_text())[-1]
    assert [(r["world"], r["backend"]) for r in run["rows"]] == [(9, "gloo")]
    assert run["provenance"]["command"].startswith("dcp-a2a-bench --world-size 9 ")
    assert (tmp_path / "latency.png").exists() and not (tmp_path / "speedup.png").exists()


def _kept_run(folder, kind: str, commit: str, date: str) -> None:
    row = dict(world=2, backend="triton", op="combine", head_dim=512, B=1, mode="graph8", size_bytes=1,
               median_us=4.7, baseline_us=12.5, speedup=2.63, max_rel_err=2.6e-3)
    (folder / kind).mkdir()
    (folder / kind / "results.json").write_text(json.dumps([{"rows": [row], "provenance": dict(
        git_commit=commit, date=date, gpus=["NVIDIA H200"] * 2, torch="2.11.0+cu130", triton="3.6.0")}]))


def test_kept_results_say_which_predate_the_current_protocol(tmp_path):
    """Issue 42: each kept run with its commit and date, and a run older than the current protocol
    says so (by git's history, or by its date where git does not know the commit)."""
    from bench.__main__ import PROTOCOL_SINCE, kept_results

    _kept_run(tmp_path, "a_old", "f59d714", "2026-11-30T04:26:07+00:00")
    _kept_run(tmp_path, "b_new", "44f6c1f", "2026-12-01T19:08:29+00:00")
    _kept_run(tmp_path, "c_unknown_old", "0000000", "2026-11-01T00:00:00+00:00")
    text = kept_results(str(tmp_path))
    heads = [line for line in text.splitlines() if line.startswith("docs/results/")]
    assert text.startswith("The GPU results this checkout keeps (docs/results/):") and len(heads) == 3, text
    old = f". Measured before the current protocol ({PROTOCOL_SINCE[0]}, {PROTOCOL_SINCE[1][:10]}): "
    assert heads[0].startswith("docs/results/a_old: 2x NVIDIA H200, commit f59d714 of 2026-11-30, torch 2.11.0+cu130")
    assert old + "its rows, and their speedups over NCCL (x), are the kernels' at f59d714, not this" in heads[0]
    assert heads[1].startswith("docs/results/b_new: 2x NVIDIA H200, commit 44f6c1f of 2026-12-01,")
    assert old not in heads[1]
    assert old in heads[2]


def test_an_installed_copy_says_once_that_it_keeps_no_gpu_results(tmp_path):
    from bench.__main__ import CPU_NOTE, kept_results

    assert "follow" not in CPU_NOTE
    assert kept_results(str(tmp_path / "none")) == ("GPU results are not in this installation: the repository keeps "
                                                   "them in docs/results/ (one folder per machine kind).")


def test_results_name_this_codes_commit_not_the_directory_the_run_started_in(tmp_path, monkeypatch):
    """Started from another git repository (a serving project's, say), a run still records this
    code's commit, or "unknown" where this code is not a git checkout."""
    from bench.__main__ import provenance

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "another project"], check=True)
    theirs = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    ours = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() if os.path.exists(os.path.join(ROOT, ".git")) else ""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DCP_GIT_COMMIT", raising=False)
    recorded = provenance([])["git_commit"]
    assert recorded == (ours or "unknown") and recorded != theirs
