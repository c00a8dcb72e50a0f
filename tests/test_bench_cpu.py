"""The README's first command: the benchmark on the CPU tier writes its data and table."""

import json
import os
import subprocess
import sys

import torch


def _no_nan(constant):
    raise ValueError(f"not strict JSON: {constant}")


def test_bench_cpu_writes_results(tmp_path):
    """With the nccl backend asked for, it runs over gloo beside triton; every point is checked."""
    proc = subprocess.run([sys.executable, "-m", "bench", "--world-size", "2", "--batch", "1", "3",
                           "--iters", "2", "--dtype", "float16", "--op", "combine", "gather", "--backends", "triton",
                           "nccl", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    from bench.__main__ import CPU_BANNER, CPU_NOTE

    assert lines[0] == CPU_BANNER and CPU_NOTE in lines and "8/8" in proc.stdout
    start = lines.index(next(x for x in lines if x.startswith(" N backend")))
    table = lines[start:lines.index(CPU_NOTE)]
    # no bandwidth and no host time without a GPU: they would describe the interpreter
    assert table[0].split() == ["N", "backend", "op", "D|Dq", "B", "mode", "size", "med", "p10", "p90", "gloo", "x",
                                "err"]
    assert table[1].split() == ["tokens", "bytes", "us", "us", "us", "us", "ratio"]
    assert len(table) == 10 and not any(" nan" in x or " - " in x or x.endswith("-") for x in table)
    assert [x.split()[3] for x in table[2:6]] == ["64", "32", "64", "32"]  # the gather's rows name Dq
    text = (tmp_path / "results.json").read_text()
    runs = json.loads(text, parse_constant=_no_nan)  # NaN written as null
    rows = runs[-1]["rows"]
    assert [r["backend"] for r in rows] == ["triton"] * 4 + ["gloo"] * 4
    assert [r["op"] for r in rows] == ["combine", "gather"] * 4
    assert all(r["max_rel_err"] < 1.6e-2 and r["dtype"] == "float16" for r in rows)
    assert all(r["max_rel_err"] == 0 for r in rows if r["op"] == "gather")
    assert all(r["speedup"] > 0 and r["baseline_us"] > 0 for r in rows)
    assert all(r["algbw_GBps"] is None and r["host_us"] is None for r in rows)
    assert all(r["num_warps"] == 8 for r in rows if r["op"] == "combine")
    assert all(r["pdl"] is False and r["timer"] == "host" for r in rows)
    assert all(r["loop_us"] is None and r["held"] is None for r in rows)
    assert (tmp_path / "results.csv").read_text().count("\n") == 9
    prov = runs[-1]["provenance"]
    assert prov["torch"] and prov["copy_rate_Bps"] is None
    assert prov["command"] == (f"python -m bench --world-size 2 --batch 1 3 --iters 2 --dtype float16 --op combine "
                               f"gather --backends triton nccl --out {tmp_path}")
    assert all((tmp_path / name).stat().st_size > 10_000 for name in ("latency.png", "speedup.png"))
    # then the GPU results the checkout keeps, with their machine and commit
    kept = proc.stdout[proc.stdout.index(CPU_NOTE):]
    assert "docs/results/h200: NVIDIA H200, MPS, commit " in kept and " graph8 " in kept


def test_bench_with_vllms_batch_metadata(tmp_path):
    """--metadata: every combine (a layer's too) gets a decode batch's seq_lens and query_start_loc,
    checked against the reference of the LSEs they mask; the rows and the table say so."""
    from dcp.reference import decode_metadata

    for seed in range(20):  # every rank has an empty shard, whatever the seed: the check has teeth
        lens, qsl = decode_metadata(seed, 3, 8)
        assert all((s == 0).any() and (s > 0).any() for s in lens) and torch.stack(lens).amax(0).min() > 0
        # a multi-token sequence and graph padding: a token's index is not its sequence's
        assert qsl[1] == 2 and qsl[-1] == 7, qsl
        assert decode_metadata(seed, 3, 1)[0][0].item() == 0  # B = 1: rank 0's shard is empty
    proc = subprocess.run([sys.executable, "-m", "bench", "--world-size", "3", "--batch", "8", "--iters", "2",
                           "--op", "combine", "gather", "layer", "--metadata", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text(), parse_constant=_no_nan)[-1]["rows"]
    assert [(r["op"], r["metadata"]) for r in rows] == [("combine", True), ("gather", None), ("layer", True)]
    assert all(r["max_rel_err"] < 1.6e-2 for r in rows)
    header = next(x for x in proc.stdout.splitlines() if x.startswith(" N backend"))
    assert header.split()[:4] == ["N", "backend", "op", "meta"]


def test_kept_results_where_the_checkout_has_none(tmp_path):
    from bench.__main__ import kept_results

    assert kept_results(str(tmp_path / "nowhere")).startswith("GPU results are not in this installation: ")


def test_host_time_probe_times_every_step_on_every_rank():
    proc = subprocess.run([sys.executable, "-m", "bench.host_time", "--world-size", "2", "--batch", "2",
                           "--head-dim", "64", "--iters", "3"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "median us over 3 calls (the held step: 3;" in lines[0]
    assert lines[1].split() == ["step", "rank", "0", "rank", "1"]
    steps = {line[:36].strip(): line[36:].split() for line in lines[2:13]}
    from bench.host_time import HELD_STEP

    assert {HELD_STEP, "lse_reduce (out= given)", "lse_reduce (out=, metadata)", "lse_reduce (out=, metadata, a step)",
            "combine_batch (checks)", "transport.launch", "the tensors' reads alone",
            "empty step (timer only)"} <= set(steps)
    assert all(len(v) == 2 and all(float(x) > 0 for x in v) for v in steps.values()), steps
    assert "function calls" in proc.stdout  # rank 0's profile


def test_bench_rejects_sizes_below_one(capsys):
    import pytest

    from bench.__main__ import main

    for flag in ("--world-size", "--iters", "--head-dim", "--heads-per-rank"):
        with pytest.raises(SystemExit):
            main([flag, "0"])
        assert "expected a positive integer, got 0" in capsys.readouterr().err
    for size in ("-1", "x"):  # --batch 0 is a call of no work
        with pytest.raises(SystemExit):
            main(["--batch", size])
        assert f"expected a non-negative integer, got {size}" in capsys.readouterr().err


def test_bench_times_a_call_of_no_work(tmp_path):
    """--batch 0: every op runs a call that moves nothing (the protocol's fixed cost, issue 46),
    beside B = 1 in the same run; rows of no bytes, nothing to differ from the reference."""
    proc = subprocess.run([sys.executable, "-m", "bench", "--world-size", "2", "--batch", "0", "1", "40", "--iters",
                           "1", "--op", "combine", "gather", "layer", "--metadata", "--backends", "triton", "nccl",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text(), parse_constant=_no_nan)[-1]["rows"]
    ops = ("combine", "gather", "layer")
    assert [(r["backend"], r["B"], r["op"]) for r in rows] == [
        (backend, b, op) for backend in ("triton", "gloo") for b in (0, 1, 40) for op in ops]
    none, one, many = rows[:3], rows[3:6], rows[6:9]
    assert all(r["size_bytes"] == 0 and r["max_rel_err"] == 0 and r["median_us"] > 0 for r in none), none
    assert all(r["size_bytes"] > 0 for r in one + many)
    # a call of no work runs the tiling of B = 1 (here unlike B = 40's), and NCCL's path exchanges
    # nothing then: no speedup to give
    assert [r["num_warps"] for r in none] == [r["num_warps"] for r in one] != [r["num_warps"] for r in many]
    assert all(r["speedup"] is None and r["baseline_us"] is None for r in none)
    assert all(r["speedup"] > 0 for r in one + many)


def test_auto_prints_its_plan_and_its_times_at_the_runs_sizes(tmp_path):
    """--backends auto, measuring on the CPU too: the plan, then its own times at each size the run
    times (B = 0 is routed by the measured size 1), to set beside the medians."""
    proc = subprocess.run([sys.executable, "-m", "bench", "--world-size", "2", "--batch", "0", "3", "--iters", "1",
                           "--op", "combine", "--backends", "auto", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, DCP_A2A_MEASURE="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "N=2 D=64 auto plan (measured in " in out and "its times at this run's sizes" in out, out
    for kind in ("combine", "gather"):
        line = next(x for x in out.splitlines() if x.startswith(f"  {kind:7s} B = 0 (at 1): "))
        assert "; B = 3: " in line and line.count("triton") == line.count("pull") == 2 and line.count("*") == 2, line
    rows = json.loads((tmp_path / "results.json").read_text(), parse_constant=_no_nan)[-1]["rows"]
    assert [(r["backend"], r["B"]) for r in rows] == [("auto", 0), ("auto", 3)], rows


def test_csv_rows_stay_under_their_columns(tmp_path):
    """A run with new columns, appended to an older file, rewrites its header; nothing shifts."""
    import csv

    from bench.__main__ import _append_csv

    path = str(tmp_path / "results.csv")
    _append_csv(path, [{"B": 1, "median_us": 2.0}])
    _append_csv(path, [{"B": 3, "mark_us": 4.0, "median_us": 5.0}])
    _append_csv(path, [{"median_us": 6.0, "B": 7, "mark_us": 8.0}])
    with open(path, newline="") as f:
        got = [(r["B"], r["median_us"], r["mark_us"]) for r in csv.DictReader(f)]
    assert got == [("1", "2.0", ""), ("3", "5.0", "4.0"), ("7", "6.0", "8.0")]


def _bench_rows(backends=("triton", "nccl")) -> list:
    return [dict(world=n, B=b, backend=be, head_dim=64, mode="eager", heads_per_rank=2, dtype="float16", iters=5,
                 median_us=b * n * (1.0 if be == "triton" else 2.0),
                 speedup=(2.0 if be == "triton" else 1.0) if "nccl" in backends else None)
            for n in (2, 3) for b in (1, 2, 4) for be in backends]


def _drawn(monkeypatch, tmp_path, rows, gpus=()) -> dict:
    """Plot the rows as a run's; returns each figure, by file name, as it was saved."""
    from matplotlib.figure import Figure

    from bench.plot import plot

    figures, save = {}, Figure.savefig

    def keep(fig, path, **kwargs):
        figures[os.path.basename(path)] = fig
        save(fig, path, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    data = tmp_path / "results.json"
    data.write_text(json.dumps([{"rows": rows, "provenance": {"gpus": list(gpus), "torch": "t", "triton": "t"}}]))
    written = plot(str(data), str(tmp_path))
    assert sorted(os.path.basename(p) for p in written) == sorted(figures)
    return figures


def test_plots_drawn_from_the_data(monkeypatch, tmp_path):
    """Both figures from a run where both backends ran, one panel per group size, titled with what
    was timed and where; ticks as plain numbers; a line at y = 1 on the speedup plot."""
    figures = _drawn(monkeypatch, tmp_path, _bench_rows(), gpus=["NVIDIA H200"] * 2)
    assert sorted(figures) == ["latency.png", "speedup.png"]
    assert all((tmp_path / name).stat().st_size > 10_000 for name in figures)
    for name, fig in figures.items():
        fig.canvas.draw()
        title = fig._suptitle.get_text()
        for part in ("lse_reduce", "D = 64", "float16", "eager", "5 timed calls per point", "2x NVIDIA H200"):
            assert part in title, (part, title)
        axes = fig.axes
        assert [ax.get_title() for ax in axes] == ["N = 2, 4 heads (2 per rank)", "N = 3, 6 heads (2 per rank)"]
        for ax in axes:
            assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4"]
            assert ax.xaxis.get_minorticklabels() == [] and ax.yaxis.get_minorticklabels() == []
        ys = [t.get_text() for t in axes[0].get_yticklabels()]
        assert ys == (["1", "2"] if name == "speedup.png" else ["2", "5", "10", "20"]), ys
    speedup = figures["speedup.png"].axes[0]
    assert speedup.get_ylabel() == "speedup over nccl (x)"
    assert any(list(line.get_ydata()) == [1, 1] for line in speedup.get_lines())


def test_plot_ticks_and_titles_on_the_cpu_tier(monkeypatch, tmp_path):
    """Speedups below 1 read 0.5 and 1; the baseline is named gloo; the machine is the interpreter."""
    rows = [{**r, "backend": "gloo" if r["backend"] == "nccl" else r["backend"],
             "speedup": 0.7 if r["backend"] == "triton" else 1.0} for r in _bench_rows()]
    fig = _drawn(monkeypatch, tmp_path, rows)["speedup.png"]
    fig.canvas.draw()
    assert "CPU: Triton's interpreter, not a transport" in fig._suptitle.get_text()
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0.5", "1"] and ax.get_ylabel() == "speedup over gloo (x)"


def test_plot_left_from_an_earlier_run_is_removed(monkeypatch, tmp_path):
    """A run without a baseline draws no speedup plot, and an earlier run's is not left beside it."""
    (tmp_path / "speedup.png").write_bytes(b"from an earlier run")
    figures = _drawn(monkeypatch, tmp_path, _bench_rows(backends=("triton",)))
    assert sorted(figures) == ["latency.png"] and not (tmp_path / "speedup.png").exists()


def test_clock_kernel_stores_increasing_times():
    """The benchmark's mark, interpreted: each launch stores a later clock reading in the next slot
    and counts itself; launches beyond the slots are counted and write nothing."""
    import time

    import torch

    from dcp.kernels import build_kernels

    clock = build_kernels(interpret=True).clock
    stamps = torch.full((7,), -1, dtype=torch.int64)
    stamps[4] = 0  # the count after four slots; two guard words behind it
    before = time.monotonic_ns()
    for _ in range(6):
        clock[(1,)](stamps, 4)
    after = time.monotonic_ns()
    assert stamps[4] == 6 and (stamps[5:] == -1).all()
    taken = stamps[:4]
    assert (taken.diff() > 0).all() and before <= taken[0] and taken[-1] <= after


def _known_trace_records() -> list:
    """Two ranks, four calls (the last two 500 ns late), two programs (a third slot unused)."""
    import numpy as np

    per_rank = []
    for r in range(2):
        recs = np.zeros((4, 3, 5), dtype=np.int64)
        for c in range(4):
            # A stamp of 0 marks a program that did not run; rank 1 starts 10 ns after rank 0.
            t0 = 10 ** 6 + 1000 * c + (500 if c >= 2 else 0)
            start, pushed = t0 + 10 * r, t0 + 10 * r + 100 + 20 * r  # rank 1 pushes last, at +130
            arrived, combined = t0 + 160, t0 + 210
            recs[c, 0] = (c + 1, start, pushed, arrived, combined)
            recs[c, 1] = (c + 1, start + 5, pushed - 7, arrived - 3, combined - 1)  # never the first or last
        per_rank.append(recs)
    return per_rank


def test_trace_phases_of_known_records():
    """``bench.trace.phases`` on records whose phases are known, as two graphs of two calls: the
    first call of each graph is left out."""
    from bench.trace import phases

    split = phases(_known_trace_records(), calls=2)
    want = dict(period=1000, gap=795, push=110, peer_wait=15, flag=30, wait=45, combine=50, spread=10,
                first_call_gap=1295, programs=2, timer_step=1)
    assert split == want


def test_trace_phases_of_graphs_of_one_call():
    """In graphs of one call every call is the first of its graph: all of them count."""
    from bench.trace import phases

    split = phases(_known_trace_records(), calls=1)
    want = dict(period=1000, gap=800, push=110, peer_wait=15, flag=30, wait=45, combine=50, spread=10,
                first_call_gap=800, programs=2, timer_step=1)
    assert split == want


def test_held_steps_queue_in_chunks_where_a_launch_blocked(monkeypatch):
    """A queue that takes 7 steps: the whole loop blocks at its 8th launch, so the steps go in
    chunks of 3, each behind its own share of the hold and timed between its own marks."""
    import time

    from bench import ranks

    queued, holds = [], []

    class FakeMarks:
        def restart(self):
            self.n = 0
            queued.clear()  # a new hold: an empty queue

        def mark(self):
            self.n += 1

        def intervals(self, count):
            assert self.n == count
            return [float(len(holds))] * (count - 1)

    def step():
        queued.append(1)
        if len(queued) > 7:
            time.sleep(2 * ranks.BLOCKED_US / 1e6)  # a full queue: the launch waits

    def fake_held_run(state, hold_us, enqueue, tries=3):
        holds.append(hold_us)
        blocked = enqueue()
        return blocked is None, 0, blocked

    monkeypatch.setattr(ranks, "held_run", fake_held_run)
    timed = ranks.held_steps({}, FakeMarks(), step, 40, 400.0, mark_each=True)
    assert timed.held and timed.chunk == 3 and len(timed.step_us) == 40 and len(timed.host_us) == 40
    assert holds[0] == 400.0 and abs(sum(holds[1:]) - 400.0) < 1e-9 and len(holds) == 1 + 14
    assert max(timed.host_us) < ranks.BLOCKED_US

    def dry_held_run(state, hold_us, enqueue, tries=3):  # a slow host: the queue ran dry, nothing blocked
        enqueue()
        return False, tries - 1, None

    monkeypatch.setattr(ranks, "held_run", dry_held_run)
    slow = ranks.held_steps({}, FakeMarks(), lambda: None, 40, 400.0)
    assert not slow.held and slow.chunk == 40 and slow.step_us == [] and len(slow.host_us) == 40


def test_held_column_says_how_the_steps_were_held():
    from bench.__main__ import COLUMNS, _held_cell

    row = dict(held=True, steps_per_hold=3, iters=40)
    assert _held_cell(row) == "yes/3" and _held_cell({**row, "steps_per_hold": 40}) == "yes"
    assert _held_cell({**row, "held": False}) == "NO/3"
    assert {head: cell for head, *_, cell in COLUMNS}["held"] is _held_cell


def test_table_leaves_out_the_columns_no_row_fills():
    """CPU-tier rows: no device timers, floor or held, so no such columns; a value some rows lack
    (the baseline where it did not run) reads -; a units line under the header."""
    from bench.__main__ import COLUMNS, format_table

    nan = float("nan")
    row = {key: 1.0 for _, _, _, key, _ in COLUMNS}
    row.update(world=2, backend="triton", op="combine", head_dim=64, B=1, mode="eager", size_bytes=528,
               steps_per_hold=5, iters=5, metadata=None, timesliced=None,
               mark_us=nan, loop_us=nan, floor_us=nan, floor_frac=nan, host_loop_us=nan, held=None)
    rows = [row, {**row, "backend": "gloo"}, {**row, "world": 3, "baseline_us": nan, "speedup": nan}]
    head, units, *lines = format_table(rows).splitlines()
    assert head.split() == ["N", "backend", "op", "D|Dq", "B", "mode", "size", "med", "p10", "p90", "algbw", "busbw",
                            "host", "gloo", "x", "err"]
    assert units.split() == ["tokens", "bytes", "us", "us", "us", "GB/s", "GB/s", "us", "us", "ratio"]
    assert len(lines) == 3 and "nan" not in "".join(lines)
    assert lines[2].split()[-3:-1] == ["-", "-"] and lines[1].split()[-3:] == ["1.0", "1.00", "1.0e+00"]


def test_held_run_stops_retrying_only_where_launches_block_twice(monkeypatch):
    """A dry queue is retried with 4x longer holds; launches that blocked once (a host stall) are
    retried too; blocked twice in a row (a full queue) ends the retries."""
    import torch

    from bench import ranks

    def run(outcomes):  # per attempt: (queue ran dry, first blocked launch or None)
        holds, dry = [], iter([d for d, _ in outcomes])
        blocked = iter([b for _, b in outcomes])

        class Event:
            def record(self):
                pass

            def query(self):
                return next(dry)

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
        monkeypatch.setattr(ranks, "_hold", lambda state, us: holds.append(us))
        monkeypatch.setattr(ranks, "gather", lambda value: [value])
        return ranks.held_run({}, 10.0, lambda: next(blocked)), holds

    assert run([(False, None)]) == ((True, 0, None), [10.0])
    assert run([(True, 5), (False, None)]) == ((True, 1, None), [10.0, 40.0])
    assert run([(True, 5), (True, 7)]) == ((False, 1, 7), [10.0, 40.0])
    assert run([(True, None), (True, 4), (True, None)]) == ((False, 2, None), [10.0, 40.0, 160.0])
