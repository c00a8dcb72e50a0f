"""Plots drawn from the benchmark data (``python -m bench.plot [results.json] [out folder]``)."""

import json
import math
import os
import sys


def plot(results_json: str = "docs/results/results.json", out_dir: str = "docs/results") -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = json.load(open(results_json))
    run = runs[-1]
    rows, prov = run["rows"], run["provenance"]
    title = f"{', '.join(prov.get('gpus') or ['CPU'])} | torch {prov['torch']} | triton {prov['triton']}"
    written = []
    for metric, ylabel, fname in (("median_us", "median time per call (us)", "latency.png"),
                                  ("speedup", "speedup over nccl (x)", "speedup.png")):
        series = {}
        for r in rows:
            if not math.isnan(r[metric]):
                series.setdefault((r["world"], r["head_dim"], r["mode"]), []).append((r["B"], r[metric]))
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for (n, d, mode), pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"N={n} D={d} {mode}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per call (B)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


if __name__ == "__main__":
    print("\n".join(plot(*sys.argv[1:])))
