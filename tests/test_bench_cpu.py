"""The README's first command: the benchmark on the CPU tier writes its data and table."""

import json
import subprocess
import sys


def test_bench_cpu_writes_results(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench", "--world-size", "2", "--batch", "1", "3",
                           "--iters", "2", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "N backend" in proc.stdout
    runs = json.loads((tmp_path / "results.json").read_text())
    rows = runs[-1]["rows"]
    assert {r["backend"] for r in rows} == {"triton", "nccl"} and len(rows) == 4
    assert all(r["max_rel_err"] < 1.6e-2 for r in rows)
    assert all(r["backend"] == "nccl" or r["speedup"] > 0 for r in rows)
    assert (tmp_path / "results.csv").read_text().count("\n") == 5
    assert runs[-1]["provenance"]["torch"]
