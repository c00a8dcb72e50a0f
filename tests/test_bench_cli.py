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
