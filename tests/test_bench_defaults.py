"""The benchmark's defaults answer a GPU user's question (issue 45): which group sizes, which rows,
whether MPS starts, what the summary says, and the floor. The device count is stubbed: CI has no
GPU."""

import csv
import glob
import os
import subprocess
import sys

import pytest

from bench.__main__ import (POINT_S, SETUP_S, default_worlds, defaults, format_table, mps_choice, op_bytes, parser, plan,
                            served_name, sliced_note, summary, _row)
from dcp.spawn import mps_daemon, mps_running

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("gpus,worlds,shared", [
    (0, [3, 6], []),  # the CPU tier (nothing shares a GPU)
    (1, [3, 6], [3, 6]),
    (2, [2, 3, 6], [3, 6]),
    (4, [3, 4], []),
    (5, [3, 5], []),
    (8, [3, 6, 8], []),
    (16, [3, 6, 8], []),
])
def test_default_group_sizes_are_dcp3_and_dcp6_wherever_the_gpus_allow(gpus, worlds, shared):
    assert default_worlds(gpus) == worlds
    d = defaults(gpus > 0, gpus, full=False)
    runs, _, no_baseline = plan(d["world_size"], d["backends"], gpus > 0, gpus)
    assert [n for n, is_shared, *_ in runs if is_shared] == shared
    for n, is_shared, pg, run in runs:
        if gpus == 0:
            assert run == ["triton"] and no_baseline[n] == "not run: not in --backends"
        elif is_shared:  # NCCL refuses two ranks on one GPU: auto alone, and the summary says why
            assert run == ["auto"] and no_baseline[n] == f"not run: {n} ranks share {gpus} GPU(s)"
        else:
            assert run == ["auto", "nccl"] and n not in no_baseline


def test_above_eight_ranks_auto_is_left_to_the_baseline_it_would_run():
    """auto serves more than 8 ranks with the nccl path: a row of it would be the baseline again,
    with a speedup of the path over itself."""
    runs, notes, _ = plan([9, 8], ["auto", "nccl"], True, 9)
    assert [run for *_, run in runs] == [["nccl"], ["auto", "nccl"]]
    assert notes == ["N=9: auto not run (above 8 ranks it serves with the nccl path, the baseline); nccl only"]


def test_rows_of_auto_on_the_nccl_path_say_so():
    """Where auto's communicator fell back to the nccl path (no peer access), its rows are that
    path's: they must not read as the fused kernel's beside the nccl baseline."""
    assert served_name("auto", "nccl", "nccl") == "auto:nccl"
    assert served_name("auto", "nccl", "auto") == served_name("auto", "gloo", "triton") == "auto"
    assert served_name("nccl", "gloo", "nccl") == "gloo" and served_name("pull", "nccl", "pull") == "pull"


@pytest.mark.parametrize("gpus,wanted,running,choice,note", [
    (0, True, False, "off", False),
    (1, True, False, "start", False),
    (1, False, False, "off", True),  # --no-mps: said before the table, rows marked
    (1, True, True, "running", False),  # a daemon already serves this process's clients
    (1, False, True, "running", False),
    (2, True, False, "start", False),
    (4, True, False, "off", False),  # every group on GPUs of its own
    (8, True, False, "off", False),
    (8, False, False, "off", False),
])
def test_mps_starts_by_default_where_ranks_share_a_gpu(tmp_path, gpus, wanted, running, choice, note):
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    if running:
        (tmp_path / "control").write_text("")  # the daemon's control pipe
    runs, _, _ = plan(default_worlds(gpus), defaults(gpus > 0, gpus, False)["backends"], gpus > 0, gpus)
    got, line = mps_choice(runs, gpus > 0, wanted, env)
    assert got == choice and bool(line) == note
    if note:
        assert line == sliced_note([3, 6], "--no-mps") and "N=3, 6 share a GPU without MPS" in line
    assert mps_running(env) == running


def test_mps_that_cannot_start_leaves_the_environment_as_it_was(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-cuda-mps-control
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    with pytest.raises(OSError):
        with mps_daemon(True):
            pass
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ


def test_gpu_defaults_and_the_full_sweep():
    p = parser(True, 1)
    a = p.parse_args([])
    assert (a.world_size, a.batch, a.head_dim, a.heads_per_rank, a.query_dim, a.modes, a.backends, a.metadata,
            a.mps, a.op) == ([3, 6], [1, 8, 64, 512], [512], 16, 576, ["graph8"], ["auto", "nccl"], True, True,
                             ["combine", "gather", "layer"])
    assert p.parse_args(["--no-metadata", "--no-mps"]).metadata is False
    full = parser(True, 8, full=True).parse_args(["--full"])
    assert (full.world_size, full.batch, full.head_dim, full.modes, full.backends, full.metadata) == (
        [3, 6, 8], [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], [512, 128], ["eager", "graph", "graph8"],
        ["triton", "nccl"], False)
    cpu = parser(False, 0).parse_args([])  # the CPU demo, --full or not
    assert (cpu.world_size, cpu.batch, cpu.modes, cpu.backends, cpu.metadata) == (
        [3, 6], [1, 4, 16], ["eager"], ["triton"], False)
    assert parser(False, 0, full=True).parse_args(["--full"]).batch == [1, 4, 16]
    # the default run's own estimate on one GPU is within the 90 s: 2 setups of auto, 24 points
    runs, _, _ = plan(a.world_size, a.backends, True, 1)
    points = sum(len(run) for *_, run in runs) * len(a.batch) * len(a.op)
    assert points == 24 and sum(len(run) for *_, run in runs) * SETUP_S + points * POINT_S <= 90


def _fake_row(n, B, op, backend, us, shared=False, mps=True, pulled=False, gpus=None):
    res = [dict(median_us=us, p10_us=us, p90_us=us, timer="clock", mark_us=1.0, loop_us=us, held=True,
                steps_per_hold=100, host_us=5.0, host_loop_us=5.0, max_rel_err=1e-3)]
    gpus = gpus or (1 if shared else 8)
    return _row(res, n, gpus, mps, 512, 16, B, "graph8", backend, 4.24e12, shared, True, 16, False,
                "bfloat16", 100, op, 576, "bfloat16", op != "gather", pulled)


def test_the_floor_counts_the_ranks_of_the_busiest_gpu():
    """Six ranks on two GPUs put three on each: the floor is three ranks' bytes, not six (as on one
    GPU) or one (as on six)."""
    one = _fake_row(6, 64, "combine", "push", 50.0, gpus=6)["floor_us"]
    assert _fake_row(6, 64, "combine", "push", 50.0, shared=True, gpus=2)["floor_us"] == pytest.approx(3 * one)
    assert _fake_row(6, 64, "combine", "push", 50.0, shared=True, gpus=1)["floor_us"] == pytest.approx(6 * one)
    assert _fake_row(6, 64, "combine", "push", 50.0, shared=True, gpus=4)["ranks_per_gpu"] == 2


def test_time_sliced_rows_are_labelled_and_compared_with_nothing():
    sliced = _fake_row(3, 8, "combine", "auto", 4200.0, shared=True, mps=False)
    served = _fake_row(3, 8, "combine", "auto", 5.0, shared=True, mps=True)
    assert sliced["timesliced"] and sliced["floor_frac"] != sliced["floor_frac"]  # NaN: no floor
    assert served["timesliced"] is None and served["floor_frac"] > 0
    table = format_table([sliced, served]).splitlines()
    assert table[0].split()[:2] == ["N", "sliced"]
    assert table[2].split()[1] == "yes" and table[3].split()[1] == "-"
    text = summary([sliced], {3: "not run: 3 ranks share 1 GPU(s)"})
    assert text.splitlines()[-1].split()[-1] == "sliced"


def test_the_summary_is_one_short_table_per_group_size():
    from bench.__main__ import _fill_speedups

    rows = [_fake_row(n, B, op, backend, us) for n in (3, 6) for B in (1, 512) for op in ("combine", "gather")
            for backend, us in (("auto", 10.0 * B ** 0.5), ("nccl", 40.0 * B ** 0.5))]
    _fill_speedups(rows)
    text = summary(rows, {}).splitlines()
    heads = [i for i, line in enumerate(text) if line.startswith("N=")]
    assert [text[i] for i in heads] == ["N=3, graph8, D = 512, Dq = 576, the combines with vLLM's batch metadata:",
                                       "N=6, graph8, D = 512, Dq = 576, the combines with vLLM's batch metadata:"]
    body = text[heads[0] + 1:heads[1]]
    assert body[0].split() == ["op", "B", "backend", "us", "nccl", "us", "x", "%floor"]
    assert [line.split()[:4] for line in body[1:]] == [["combine", "1", "auto", "10.0"], ["gather", "1", "auto", "10.0"],
                                                       ["combine", "512", "auto", "226.3"],
                                                       ["gather", "512", "auto", "226.3"]]
    for line in body[1:]:  # nccl's time, x = 4, and the floor's share
        us, base, x, frac = map(float, line.split()[3:7])
        assert abs(base - 4 * us) < 0.3 and x == 4.0 and 0 <= frac < 100


def test_the_floor_counts_the_bytes_as_the_kernel_moves_them():
    """A pulled gather writes its rows once, not once per peer: its floor is lower. In the kept
    results (the CSVs of docs/results/h200 and h100) every pushed and pulled gather's floor is its own bytes at
    one copy rate per run, and no pushed gather beats its floor. (A pulled gather's staged rows are read
    by every peer; with the ranks on one GPU the later reads can hit its L2, and one H100 run beat the
    floor by 3%: docs/design.md, section 6.)"""
    pushed = op_bytes("gather", 3, 512, 16, 512, 576, 2, 3)[1]
    pulled = op_bytes("gather", 3, 512, 16, 512, 576, 2, 3, gather_pulled=True)[1]
    rows, out = 512 * 16 * 576 * 2, 3 * 512 * 16 * 576 * 2
    assert (pushed, pulled) == (3 * (rows + 3 * out), 3 * (2 * rows + 2 * out))
    checked = 0
    paths = [glob.glob(os.path.join(ROOT, "docs", "results", kind, "**", "*.csv"), recursive=True)
             for kind in ("h200", "h100")]
    for path in sorted(sum(paths, [])):
        with open(path) as f:
            kept = [r for r in csv.DictReader(f) if r.get("op") == "gather" and r.get("mode") == "graph8"
                    and r.get("backend") in ("push", "pull") and r.get("floor_us") not in (None, "", "nan")]
        rates = []
        for r in kept:
            floor = op_bytes("gather", int(r["world"]), int(r["B"]), int(r["heads_per_rank"]), int(r["head_dim"]),
                             int(r["query_dim"]), 2, int(r["ranks_per_gpu"]), gather_pulled=r["backend"] == "pull")[1]
            rates.append(floor / float(r["floor_us"]))
            assert r["backend"] == "pull" or float(r["floor_us"]) <= float(r["median_us"]), (path, r)
            checked += r["backend"] == "pull"
        assert not rates or max(rates) / min(rates) < 1 + 1e-9, (path, rates)
    assert checked >= 8


def test_without_a_terminal_progress_is_a_line_per_point(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench", "--world-size", "2", "--batch", "1", "2", "--iters", "1",
                           "--op", "combine", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "\r" not in proc.stdout
    lines = proc.stdout.splitlines()
    assert [line.split(" N=")[0] for line in lines if line[:1].isdigit() and "/2 " in line] == ["1/2", "2/2"]
    assert lines[-1] == (f"Written: {tmp_path}/results.csv and {tmp_path}/results.json (rows appended), plot "
                         f"{tmp_path}/latency.png")
