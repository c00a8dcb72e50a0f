"""Plots drawn from the benchmark data (``python -m bench.plot [results.json] [out folder]``)."""

import json
import math
import os
import sys
from collections import Counter

OPERATIONS = {"combine": "lse_reduce (all-to-all + LSE combine)", "gather": "all_gather_heads (query all-gather)",
              "layer": "layer (a gather then a combine)"}
FIGURES = ("latency.png", "speedup.png")
# The reference rows, named by the process group's backend the nccl path ran over; every other
# row (triton or push, pull, auto) is one of ours.
BASELINES = ("nccl", "gloo")


def missing(value) -> bool:
    """A value the run has none for: null in the JSON (NaN in memory and in older files)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _listed(rows: list, key: str) -> str:
    """The run's values of a field, e.g. ``128, 512``; empty where its rows predate the field."""
    return ", ".join(map(str, sorted({r[key] for r in rows if r.get(key) is not None})))


def machine(prov: dict, rows: list) -> str:
    """The GPUs (``2x NVIDIA H200``), or the CPU tier's interpreter."""
    gpus = prov.get("gpus") or []
    if not gpus:
        return "CPU: Triton's interpreter, not a transport"
    names = ", ".join(f"{k}x {name}" if k > 1 else name for name, k in Counter(gpus).items())
    return names + (", MPS" if any(r.get("mps") for r in rows) else "")


def heading(prov: dict, rows: list) -> str:
    """The figure's title: what was timed (operation, D, dtype, modes, iterations) and where."""
    ops = [op for op in OPERATIONS if any(r.get("op", "combine") == op for r in rows)]
    dims = [f"D = {_listed(rows, 'head_dim')}"] if set(ops) - {"gather"} else []
    dims += [f"Dq = {_listed(rows, 'query_dim')}"] if set(ops) - {"combine"} else []
    parts = [*dims, _listed(rows, "dtype"), _listed(rows, "mode")]
    parts += ["with vLLM's batch metadata"] if any(r.get("metadata") for r in rows) else []
    iters = _listed(rows, "iters")
    parts += [f"{iters} timed calls per point"] if iters else []
    return "\n".join(["DcpAllToAll: " + ", ".join(OPERATIONS[op] for op in ops), " | ".join(p for p in parts if p),
                      f"{machine(prov, rows)} | torch {prov['torch']} | triton {prov['triton']}"])


def panel_title(rows: list, n: int) -> str:
    """N and the call's heads (N times the heads per rank)."""
    hn = {r["heads_per_rank"] for r in rows if r["world"] == n and r.get("heads_per_rank")}
    heads = ", ".join(f"{h * n} heads ({h} per rank)" for h in sorted(hn))
    return f"N = {n}" + (f", {heads}" if heads else "")


def log_ticks(values: list, base: int, mantissas: tuple) -> list:
    """Ticks m * base**k (m from ``mantissas``, the first 1) from 1.25 times below the values to
    1.25 times above them; where fewer than two are, the nearest at or beyond the values on each
    side: an axis narrower than a decade still gets two labelled ticks."""
    lo, hi = min(values), max(values)
    k, ticks = math.floor(math.log(lo, base)) - 1, []
    while not ticks or ticks[-1] <= hi:
        ticks += [m * base ** k for m in mantissas]
        k += 1
    near = [t for t in ticks if lo / 1.25 <= t <= hi * 1.25]
    if len(near) >= 2:
        return near
    first = max(i for i, t in enumerate(ticks) if t <= lo)
    last = next(i for i, t in enumerate(ticks) if t >= hi)
    return ticks[first:max(last, first + 1) + 1]


def plain(v: float) -> str:
    """A tick label as a plain number: 0.5, 1, 2, 20000 (not 2^0 or 8.75x10^-1)."""
    return f"{v:.0f}" if v >= 1 else f"{v:g}"


def plot(results_json: str = "results/results.json", out_dir: str = "results") -> list:
    """Draw the figures of the file's last run; a figure it does not produce (no baseline ran, or
    matplotlib is missing) is removed, so that none from an earlier run is left beside the data."""
    for fname in FIGURES:
        path = os.path.join(out_dir, fname)
        if os.path.exists(path):
            os.remove(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    runs = json.load(open(results_json))
    run = runs[-1]
    rows, prov = run["rows"], run["provenance"]
    baseline = next((r["backend"] for r in rows if r["backend"] in BASELINES), "nccl")
    written = []
    for metric, ylabel, fname in (("median_us", "median time per call (us)", FIGURES[0]),
                                  ("speedup", f"speedup over {baseline} (x)", FIGURES[1])):
        series = {}
        for r in rows:
            # (a call of no work, B = 0, has no place on the log axis: the table has it)
            if not missing(r.get(metric)) and r["B"] > 0 and (metric != "speedup" or r["backend"] not in BASELINES):
                op = r.get("op", "combine")
                key = (r["world"], r["head_dim"], r["mode"], r["backend"], op,
                       f"Dq={r.get('query_dim')}" if op == "gather" else f"D={r['head_dim']}")
                series.setdefault(key, []).append((r["B"], r[metric]))
        if not series:
            continue
        worlds = sorted({key[0] for key in series})
        fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 6.0), squeeze=False)
        styles = {}  # a colour per (op, mode, backend), the same in every panel; dashed: the smaller head dims
        for (n, d, mode, backend, op, dims), pts in sorted(series.items()):
            pts.sort()
            color = styles.setdefault((op, mode, backend), f"C{len(styles) % 10}")
            ax = axes[0][worlds.index(n)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color,
                    linestyle="-" if d == max(k[1] for k in series) else "--", label=f"{op} {dims} {mode} {backend}")
        for n, ax in zip(worlds, axes[0]):
            pts = [p for key, s in series.items() if key[0] == n for p in s]
            ys = [y for _, y in pts]
            if metric == "speedup":
                ax.axhline(1, color="black", linewidth=1, linestyle=":", label=f"as fast as {baseline}")
                ys.append(1)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            xs = sorted({b for b, _ in pts})
            ax.set_xticks(xs, [str(b) for b in xs])
            yt = log_ticks(ys, 2, (1,)) if metric == "speedup" else log_ticks(ys, 10, (1, 2, 5))
            ax.set_yticks(yt, [plain(t) for t in yt])
            ax.set_ylim(min(ys + yt) / 1.1, max(ys + yt) * 1.1)  # the line y = 1 off the frame
            for axis in (ax.xaxis, ax.yaxis):
                axis.set_minor_locator(ticker.NullLocator())
            ax.set_xlabel("tokens per call (B)")
            ax.set_ylabel(ylabel)
            ax.set_title(panel_title(rows, n), fontsize=9)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)  # (below: no point hidden)
        fig.suptitle(heading(prov, rows), fontsize=9)
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


if __name__ == "__main__":
    print("\n".join(plot(*sys.argv[1:])))
