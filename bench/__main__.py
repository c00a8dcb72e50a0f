"""``python -m bench``: the DCP all-to-all timed against the reference, with provenance.

Spawns its own rank processes: one per GPU with several GPUs, N processes on one GPU with one, and
the CPU tier (Triton's interpreter) with none. Columns follow nccl-tests' all-to-all conventions:
size is the bytes one rank sends (the packed [N, B, H/N, D+2] buffer), algbw = size / time and
busbw = algbw * (N - 1) / N.

Times are device times per call (from one mark between steps to the next: a kernel storing the GPU
clock, the first node of each graph in graph modes; or ``--timer events``), the slowest rank's
median, with the calls queued back to back behind a sleeping kernel (``bench.ranks``): ``held``
says the queue lasted the whole loop (``yes/k``: launches blocked on a full queue, so the steps went
in chunks of k, each behind its own sleep). A step's time includes one mark; ``mark`` is a mark's own
time when launched alone (marks with nothing between them); ``timer`` says which. ``loop`` is
nccl-tests' time: the mean per call of a second loop with events only at its two ends. ``host`` is
the host time per call (the slowest rank's median over the timed steps, timed apart from their
marks); ``hloop`` the same from the second loop (its host time over its calls: nothing queued
between calls). In eager mode a program that launches slower than its device time runs at the
host's pace.
"""

import argparse
import contextlib
import csv
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile

import torch

from dcp.protocol import ChannelLayout
from dcp.spawn import World
from . import ranks


def _sh(cmd: str) -> str:
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:
        return ""


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def provenance(argv: list) -> dict:
    import triton

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench"] + argv),
        "host": platform.node(),
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        # the device machine's copy may carry a stale .git: a commit passed in wins
        "git_commit": os.environ.get("DCP_GIT_COMMIT") or _sh("git rev-parse --short HEAD") or "unknown",
        "env": {k: v for k, v in os.environ.items() if k.startswith(("DCP_", "CUDA_MPS"))},
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["driver"] = _sh("nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1")
        info["topology"] = _sh("nvidia-smi topo -m")
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        info["gpus"] = []
    return info


@contextlib.contextmanager
def mps_daemon(enabled: bool):
    """Start the CUDA MPS daemon for the run (ranks on one GPU then run concurrently)."""
    if not enabled:
        yield
        return
    tmp = tempfile.mkdtemp(prefix="dcp-mps-")
    env = {"CUDA_MPS_PIPE_DIRECTORY": tmp, "CUDA_MPS_LOG_DIRECTORY": tmp}
    os.environ.update(env)
    subprocess.run(["nvidia-cuda-mps-control", "-d"], check=True)
    try:
        yield
    finally:
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, timeout=30)
        for k in env:
            os.environ.pop(k, None)
        shutil.rmtree(tmp, ignore_errors=True)


def copy_rate() -> float:
    """Device-to-device copy rate, bytes read plus written per second."""
    if not torch.cuda.is_available():
        return float("nan")
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        y.copy_(x)
    b.record()
    torch.cuda.synchronize()
    rate = 2 * x.numel() * 10 / (a.elapsed_time(b) * 1e-3)
    del x, y
    torch.cuda.empty_cache()
    return rate


def floor_bytes(n: int, B: int, hn: int, d: int, shared_device: bool) -> int:
    """Bytes one rank must move (read input, write packed rows, read them back, write output);
    all ranks together where they share one device's memory."""
    H, row = hn * n, ChannelLayout(n, hn, d, B).row_elems
    per_rank = B * H * (2 * d + 4) + 2 * B * H * row * 2 + B * hn * d * 2
    return per_rank * (n if shared_device else 1)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=_positive, nargs="+",
                   default=[torch.cuda.device_count()] if cuda and torch.cuda.device_count() > 1 else [3, 6])
    p.add_argument("--batch", type=_positive, nargs="+",
                   default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512] if cuda else [1, 4, 16])
    p.add_argument("--heads-per-rank", type=_positive, default=16 if cuda else 2)
    p.add_argument("--head-dim", type=_positive, nargs="+", default=[512, 128] if cuda else [64])
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16", help="partial outputs' dtype")
    p.add_argument("--backends", nargs="+", default=["triton", "nccl"], choices=["triton", "nccl"])
    p.add_argument("--modes", nargs="+", default=["eager", "graph", "graph8"] if cuda else ["eager"])
    p.add_argument("--iters", type=_positive, default=200 if cuda else 5)
    p.add_argument("--num-warps", type=int, default=None, help="fixed warps per program (default: by call size)")
    p.add_argument("--pdl", choices=["auto", "on", "off"], default="auto",
                   help="programmatic dependent launch of the triton kernel (auto: where the GPU has it)")
    p.add_argument("--timer", choices=["clock", "events"], default="clock",
                   help="mark between timed steps: a kernel storing the GPU clock (in graph modes, the graph's "
                        "first node), or a CUDA event")
    p.add_argument("--mps", action="store_true", help="start the CUDA MPS daemon for the run")
    p.add_argument("--out", default="results", help="folder for results.csv and results.json")
    args = p.parse_args(argv)

    gpus = torch.cuda.device_count() if cuda else 0
    rate = copy_rate() if cuda else float("nan")
    info = provenance(argv)
    info["copy_rate_Bps"] = rate
    rows, skipped_nccl = [], False
    device = "cuda" if cuda else "cpu"
    seed = int.from_bytes(os.urandom(4), "little")
    mps_on = cuda and (args.mps or bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")))
    shares_gpu = lambda n: cuda and gpus < n  # ranks share a GPU; NCCL refuses two ranks on one GPU
    total = sum(len([b for b in args.backends if b == "triton" or not shares_gpu(n)]) for n in args.world_size) \
        * len(args.head_dim) * len(args.batch) * len(args.modes)
    with mps_daemon(args.mps and cuda):
        for n in args.world_size:
            shared = shares_gpu(n)
            w = World(n, device, pg_backend="gloo" if shared or not cuda else "nccl")
            try:
                for backend in args.backends:
                    if backend == "nccl" and shared:
                        skipped_nccl = True
                        continue
                    for d in args.head_dim:
                        tilings = w.run(ranks.setup, args.heads_per_rank, d, max(args.batch), device, backend,
                                        args.num_warps, {"auto": None, "on": True, "off": False}[args.pdl],
                                        args.timer, args.dtype)[0]
                        for B in args.batch:
                            for mode in args.modes:
                                res = w.run(ranks.run_point, B, mode, args.iters, seed + B, timeout=120)
                                rows.append(_row(res, n, gpus, mps_on, d, args.heads_per_rank, B, mode,
                                                 backend, rate, shared, cuda, *tilings[B - 1], args.dtype,
                                                 args.iters))
                                done = len(rows) * 30 // total
                                print(f"\r[{'#' * done}{'.' * (30 - done)}] {len(rows)}/{total} N={n} {backend} "
                                      f"D={d} B={B} {mode}: {rows[-1]['median_us']:.1f} us   ", end="", flush=True)
            finally:
                w.close()
    _fill_speedups(rows)
    print()
    if skipped_nccl:
        print("NCCL: not run where ranks share a GPU (it refuses two ranks on one GPU); its columns are NaN.")
    os.makedirs(args.out, exist_ok=True)
    _append_csv(os.path.join(args.out, "results.csv"),
                [{**r, "date": info["date"], "git_commit": info["git_commit"]} for r in rows])
    path = os.path.join(args.out, "results.json")
    runs = json.load(open(path)) if os.path.exists(path) else []
    runs.append({"provenance": info, "rows": rows})
    json.dump(runs, open(path, "w"), indent=1)
    try:
        from .plot import plot

        print("plots:", ", ".join(plot(path, args.out)))
    except ImportError:
        print("plots: not drawn (matplotlib missing: pip install -e '.[bench]')")
    print(format_table(rows))


def _append_csv(path: str, rows: list) -> None:
    """Append rows; where the file's header lacks some of their columns, rewrite it with every
    column, so that older rows stay aligned under their names."""
    old, fields, rewrite = [], list(rows[0]), True
    if os.path.exists(path) and os.path.getsize(path):
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            head = list(reader.fieldnames or [])
            rewrite = not set(fields) <= set(head)
            old = list(reader) if rewrite else []
            fields = head + [k for k in fields if k not in head]
    with open(path, "w" if rewrite else "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        if rewrite:
            writer.writeheader()
        writer.writerows(old + rows)


def _row(res, n, gpus, mps_on, d, hn, B, mode, backend, rate, shared, cuda, num_warps, pdl, dtype, iters) -> dict:
    worst = max(res, key=lambda r: r["median_us"])  # the slowest rank's median
    size = n * B * hn * (d + 2) * 2
    floor_us = floor_bytes(n, B, hn, d, shared) / rate * 1e6 if cuda else float("nan")
    return dict(world=n, ranks_per_gpu=-(-n // max(gpus, 1)) if cuda else 0, mps=mps_on, head_dim=d,
                heads_per_rank=hn, B=B, mode=mode, backend=backend, dtype=dtype, num_warps=num_warps, pdl=pdl,
                timer=res[0]["timer"], mark_us=max(r["mark_us"] for r in res), size_bytes=size,
                **{k: worst[k] for k in ("median_us", "p10_us", "p90_us")},
                loop_us=max(r["loop_us"] for r in res), held=all(r["held"] for r in res) if cuda else None,
                iters=iters, steps_per_hold=min(r["steps_per_hold"] for r in res),
                algbw_GBps=size / worst["median_us"] / 1e3,
                busbw_GBps=size / worst["median_us"] / 1e3 * (n - 1) / n,
                floor_us=floor_us, floor_frac=floor_us / worst["median_us"],
                host_us=max(r["host_us"] for r in res), host_loop_us=max(r["host_loop_us"] for r in res),
                max_rel_err=max(r["max_rel_err"] for r in res),
                nccl_us=float("nan"), speedup=float("nan"))


def _fill_speedups(rows: list) -> None:
    """nccl_us and speedup (nccl time / this time) on the rows of every point where NCCL ran."""
    nccl = {(r["world"], r["head_dim"], r["B"], r["mode"]): r["median_us"] for r in rows if r["backend"] == "nccl"}
    for r in rows:
        t = nccl.get((r["world"], r["head_dim"], r["B"], r["mode"]))
        if t is not None:
            r["nccl_us"], r["speedup"] = t, t / r["median_us"]


def _held_cell(r: dict) -> str:
    """yes / NO; "/k" where the steps were queued k at a time, each chunk behind its own hold."""
    if r["held"] is None:
        return "-"
    return ("yes" if r["held"] else "NO") + (f"/{r['steps_per_hold']}" if r["steps_per_hold"] < r["iters"] else "")


# The table's columns: header, width, and how a row's value is written.
_f1 = lambda key: lambda r: f"{r[key]:.1f}"
_f2 = lambda key: lambda r: f"{r[key]:.2f}"
COLUMNS = [
    ("N", 2, lambda r: r["world"]), ("backend", 7, lambda r: r["backend"]), ("D", 4, lambda r: r["head_dim"]),
    ("B", 4, lambda r: r["B"]), ("mode", 6, lambda r: r["mode"]), ("size(B)", 9, lambda r: r["size_bytes"]),
    ("med(us)", 8, _f1("median_us")), ("p10", 7, _f1("p10_us")), ("p90", 7, _f1("p90_us")),
    ("mark", 5, _f1("mark_us")), ("loop", 7, _f1("loop_us")), ("algbw", 7, _f2("algbw_GBps")),
    ("busbw", 7, _f2("busbw_GBps")), ("floor", 7, _f1("floor_us")),
    ("%floor", 6, lambda r: f"{100 * r['floor_frac']:.0f}%"), ("host", 6, _f1("host_us")),
    ("hloop", 6, _f1("host_loop_us")), ("nccl", 6, _f1("nccl_us")), ("x", 5, _f2("speedup")),
    ("held", 6, _held_cell),
]


def format_table(rows: list) -> str:
    lines = [" ".join(f"{head:>{width}}" for head, width, _ in COLUMNS)]
    lines += [" ".join(f"{str(cell(r)):>{width}}" for _, width, cell in COLUMNS) for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
