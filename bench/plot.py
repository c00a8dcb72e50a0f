"""Plots drawn from the benchmark data (``python -m bench.plot [results.json] [out folder]``)."""

import json
import math
import os
import sys


def plot(results_json: str = "results/results.json", out_dir: str = "results") -> list:
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
            if not math.isnan(r[metric]) and not (metric == "speedup" and r["backend"] == "nccl"):
                key = (r["world"], r["head_dim"], r["mode"], r["backend"])
                series.setdefault(key, []).append((r["B"], r[metric]))
        if not series:
            continue
        worlds = sorted({key[0] for key in series})
        fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 4.5), squeeze=False)
        styles = {}  # a colour per (mode, backend), the same in every panel; dashed: the smaller head dims
        for (n, d, mode, backend), pts in sorted(series.items()):
            pts.sort()
            color = styles.setdefault((mode, backend), f"C{len(styles)}")
            ax = axes[0][worlds.index(n)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color,
                    linestyle="-" if d == max(k[1] for k in series) else "--", label=f"D={d} {mode} {backend}")
        for n, ax in zip(worlds, axes[0]):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens per call (B)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"N={n} | {title}", fontsize=8)
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
