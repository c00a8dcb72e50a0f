"""The DCP collectives (lse_reduce, all_gather_heads, and both as a layer) timed against the reference.

Run as ``dcp-a2a-bench`` or ``python -m dcp.bench`` wherever the package is installed, or as
``python -m bench`` from the repository root.

Spawns its own rank processes: one per GPU with several GPUs, N processes on one GPU with one, and
the CPU tier (Triton's interpreter) with none. On the CPU tier the times measure the interpreter, not
a transport, and the nccl backend runs over a gloo process group (its rows are named ``gloo``); the
table leaves out the columns only a GPU fills. Groups of more than ``MAX_PEERS`` (8) ranks run the
nccl backend only. ``x`` is the speedup over the nccl backend (or gloo) at the same point. Columns
follow nccl-tests' conventions: size is, for the combine (an all-to-all), the bytes one rank sends
(the packed [N, B, H/N, D+2] buffer); for the gather (an all-gather), the bytes of its [B, H, Dq]
result; for a layer, both; algbw = size / time and busbw = algbw * (N - 1) / N.

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
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from typing import Optional

import torch

from dcp.checks import DTYPE_NAMES, OUT_DTYPE_NAMES, dtype_name
from dcp.protocol import ChannelLayout
from dcp.constants import MAX_PEERS
from dcp.spawn import RankError, World, mps_daemon, mps_running
from . import ranks
from .plot import BASELINES, missing


def _sh(cmd: str) -> str:
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:
        return ""


def _at_least(low: int, what: str):
    """An argparse type: an integer of at least ``low``, else the error names ``what`` it expected."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value
    return parse


_positive = _at_least(1, "a positive integer")
_tokens = _at_least(0, "a non-negative integer")


def _group_size(text: str) -> int:
    value = _positive(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"a DCP group needs at least 2 ranks, got {text}")
    return value


def command_name() -> str:
    """How this run was started, for its usage line, messages and provenance: ``python -m dcp.bench``
    (the installed package), ``python -m bench`` (in the source tree) or the console script's name
    (``dcp-a2a-bench``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name in ("bench.__main__", "dcp.bench.__main__"):
        return "python -m " + spec.name[:-len(".__main__")]
    name = os.path.basename(sys.argv[0])
    return "python -m bench" if name == "__main__.py" else name


def source_commit() -> str:
    """This code's commit where it runs from its own git checkout (the source tree, an editable
    install), else "": never that of the directory the run was started in."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    top = _sh(f"git -C {shlex.quote(root)} rev-parse --show-toplevel")
    if not top or os.path.realpath(top) != os.path.realpath(root):
        return ""
    return _sh(f"git -C {shlex.quote(root)} rev-parse --short HEAD")


def provenance(argv: list) -> dict:
    import triton

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([command_name()] + [shlex.quote(a) for a in argv]),
        "host": platform.node(),
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        # the device machine's copy may carry a stale .git: a commit passed in wins
        "git_commit": os.environ.get("DCP_GIT_COMMIT") or source_commit() or "unknown",
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


def floor_bytes(n: int, B: int, hn: int, d: int, per_device: int, size: int = 2) -> int:
    """Bytes one rank's combine moves (read its input, write the packed rows of the other ranks'
    head chunks and the LSEs of its own, read them back, write its output; pushed or pulled alike)
    for values of ``size`` bytes, times ``per_device``: the ranks that share the busiest device's
    memory. Its own chunk's values are read once, from the input, by the combine."""
    H, row = hn * n, ChannelLayout(n, hn, d, B, value_words=size // 2).row_elems
    packed = B * (H - hn) * row * 2 + B * hn * 4
    per_rank = B * H * (size * d + 4) + 2 * packed + B * hn * d * size
    return per_rank * per_device


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line: the usage of every option, printed first by default, would bury it."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _Help(argparse.RawDescriptionHelpFormatter):
    """Each option's default after its help, written as it would be typed (``3 6``, not ``[3, 6]``):
    the defaults depend on the machine, so they cannot be written into the help text."""

    def _get_help_string(self, action):
        default = action.default
        if default is None or default is argparse.SUPPRESS:
            return action.help
        if isinstance(default, bool):
            default = "on" if default else "off"
        elif isinstance(default, list):
            default = " ".join(map(str, default))
        return f"{action.help} (default: {str(default).replace('%', '%%')})"


MODES = ["eager", "graph", "graph8"]
FUSED = ["triton", "push", "pull"]  # the fused kernel's transports, as --backends names them


COLUMN_HELP = """columns (a column no row fills is left out; - : no value for that row):
  N          ranks in the group
  sliced     yes: ranks shared a GPU without MPS (--no-mps, or MPS could not start), time-sliced: the
             time is the GPU switching between processes, not the transport's; no floor, no baseline
  backend    triton or push, pull, auto (DcpAllToAll's backend=; auto:nccl where auto fell back to
             the nccl path), nccl (the reference path; gloo where the group runs gloo)
  op         combine (lse_reduce), gather (all_gather_heads), layer (a gather then a combine)
  meta       yes: the row's combines got vLLM's batch metadata (--metadata; a gather takes none)
  D|Dq       the combine's head dim D, the gather's query dim Dq (a layer: D|Dq)
  B          tokens per call
  mode       eager, graph (a CUDA graph of one call), graph8 (a graph of 8 calls)
  size       bytes, as nccl-tests counts them: what one rank sends (combine), the gathered result
             (gather), both (layer)
  med p10 p90  device time per call, the slowest rank's median and percentiles (on the CPU: the
             interpreter's wall time per call, not a transport's)
  mark       one timer mark's own time (each step includes one)
  loop       nccl-tests' time: a second loop's mean, events only at its ends
  algbw      size / med; busbw: algbw * (N - 1) / N (GPUs only)
  floor      the bytes the kernel moves at this GPU's copy rate (below); %floor: floor / med
  host hloop host time per eager call, per timed step and over the second loop (GPUs only)
  nccl x     the reference path's med at the same point, and its time over this row's (x > 1: faster)
  held       yes: every timed call was queued behind one sleeping kernel (yes/k: k at a time)
  err        largest relative error against the float64 reference, checked before and after timing
             (bf16 tolerance 1.6e-2; 0: bit-exact, as the gather must be)"""
FLOOR_HELP = """

floor: the bytes one call moves as the kernel moves them, at the device-to-device copy rate measured
at the start of the run (1 GiB copies, bytes read plus written), times the ranks that share the
busiest GPU. A combine reads its input [B, H, D] and LSEs, writes the packed rows [B, H - H/N, D +
LSE] of the other ranks' chunks (of its own, the LSEs only), reads them back and writes its
[B, H/N, D]; a gather reads its [B, H/N, Dq] rows, writes them to N peers (pushed) or once
(pulled), reads the N sources' rows and writes [B, H, Dq]; a layer both. Not a bound: ranks that
share a GPU may read from its L2 cache what this counts as memory traffic, so a call can come in
under it (above 100%); on GPUs of their own it counts memory only, not the link between them."""


def default_worlds(gpus: int) -> list:
    """The group sizes a run measures unless told: DCP3 and DCP6 (the sizes no other fast path
    covers), on GPUs of their own wherever there are enough, and the GPU count (at most 8). With
    fewer than 3 GPUs (or none: the CPU tier), 3 and 6 with ranks sharing them."""
    if gpus < 3:
        return ([gpus] if gpus == 2 else []) + [3, 6]
    return sorted({n for n in (3, 6) if n <= gpus} | {min(gpus, MAX_PEERS)})


def defaults(cuda: bool, gpus: int, full: bool) -> dict:
    """The run a plain command makes. With a GPU: the user's question (MLA's geometry, graphs of 8,
    the combine with vLLM's batch metadata, the gather and the layer, auto beside NCCL) in about a
    minute; ``--full``, the long sweep. Without one: the CPU tier's demo, --full or not."""
    if not cuda:
        return dict(world_size=default_worlds(0), batch=[1, 4, 16], heads_per_rank=2, head_dim=[64], query_dim=32,
                    backends=["triton"], modes=["eager"], metadata=False, iters=5)
    if full:
        return dict(world_size=default_worlds(gpus), batch=[1 << i for i in range(10)], heads_per_rank=16,
                    head_dim=[512, 128], query_dim=576, backends=["triton", "nccl"], modes=MODES, metadata=False,
                    iters=200)
    return dict(world_size=default_worlds(gpus), batch=[1, 8, 64, 512], heads_per_rank=16, head_dim=[512],
                query_dim=576, backends=["auto", "nccl"], modes=["graph8"], metadata=True, iters=100)


def parser(cuda: bool, gpus: int, full: bool = False) -> argparse.ArgumentParser:
    d = defaults(cuda, gpus, full)
    p = _Parser(prog=command_name(), description=__doc__.split("\n")[0], formatter_class=_Help,
                epilog="Defaults are this machine's: with a GPU, the question a user asks (DCP3 and DCP6, beside\n"
                       "NCCL where each rank has a GPU of its own, at MLA's geometry; the run says when it expects\n"
                       "to finish), --full the long sweep. Without a GPU the kernels run under Triton's\n"
                       "interpreter: the run shows that the real kernels and protocol run and are exact, then the\n"
                       "GPU results this repository keeps.\n\n" + COLUMN_HELP + FLOOR_HELP)
    p.add_argument("--full", action="store_true",
                   help="the long sweep: every power-of-two B to 512, D 512 and 128, every mode, triton beside nccl "
                        "(without a GPU: the CPU demo)")
    p.add_argument("--world-size", type=_group_size, nargs="+", metavar="N", default=d["world_size"],
                   help=f"ranks in the group, a sweep per value; above {MAX_PEERS} only the nccl backend runs")
    p.add_argument("--batch", type=_tokens, nargs="+", metavar="B", default=d["batch"],
                   help="tokens per call, a point per value (0: a call of no work, which still publishes and "
                        "waits for the peers' flags: the protocol's fixed cost; the nccl backend exchanges nothing "
                        "then, so that point has no speedup)")
    p.add_argument("--heads-per-rank", type=_positive, default=d["heads_per_rank"], metavar="H",
                   help="attention heads per rank; the call combines N times as many")
    p.add_argument("--head-dim", type=_positive, nargs="+", default=d["head_dim"], metavar="D",
                   help="head dimension, a multiple of 8 up to 1024; a sweep per value")
    p.add_argument("--dtype", type=dtype_name, choices=OUT_DTYPE_NAMES, default="bfloat16",
                   help="partial outputs' dtype (bf16, fp16, fp32 also do)")
    p.add_argument("--op", nargs="+", choices=OPS, default=OPS, metavar="OP",
                   help="combine (lse_reduce), gather (all_gather_heads, the query all-gather) and/or layer (a "
                        "gather then a combine, as one DCP attention layer runs them)")
    p.add_argument("--query-dim", type=_positive, default=d["query_dim"], metavar="DQ",
                   help="query head dimension of the gather (vLLM's MLA: 576)")
    p.add_argument("--query-dtype", type=dtype_name, choices=list(DTYPE_NAMES), default="bfloat16",
                   help="query dtype of the gather (bf16, fp16, fp32, fp8 also do)")
    p.add_argument("--backends", nargs="+", default=d["backends"],
                   choices=[*FUSED, "auto", "nccl"], metavar="BACKEND",
                   help="triton or push (the fused kernel pushing into peers' buffers), pull (the same kernel, "
                        "each rank reading its rows from its peers' buffers), auto (the transport measured "
                        "fastest for each call size at construction; its plan is printed) and/or nccl (pack, the "
                        "process group's all-to-all, combine; named gloo where the group runs gloo)")
    p.add_argument("--modes", nargs="+", default=d["modes"], choices=MODES, metavar="MODE",
                   help="eager (plain calls), graph (a CUDA graph of one call), graph8 (a graph of 8 calls, "
                        "like layers); the graph modes need a GPU")
    p.add_argument("--metadata", action=argparse.BooleanOptionalAction, default=d["metadata"],
                   help="pass every combine vLLM's batch metadata, as its MLA layers do: a decode batch's "
                        "seq_lens (about a quarter of each rank's shards empty) and query_start_loc, a model "
                        "step per timed step (graph8: the first call searches them, the other seven read its "
                        "verdicts)")
    p.add_argument("--iters", type=_positive, default=d["iters"], help="timed calls per point")
    p.add_argument("--num-warps", type=int, choices=[1, 2, 4, 8, 16], default=None, metavar="W",
                   help="fixed warps per program, 1 2 4 8 or 16 (default: chosen by call size)")
    p.add_argument("--pdl", choices=["auto", "on", "off"], default="auto",
                   help="programmatic dependent launch of the triton kernel; auto: where the GPU has it")
    p.add_argument("--timer", choices=["clock", "events"], default="clock",
                   help="mark between timed steps on a GPU: a kernel storing the GPU clock (in graph modes, the "
                        "graph's first node), or a CUDA event")
    p.add_argument("--mps", action=argparse.BooleanOptionalAction, default=True,
                   help="where ranks share a GPU, start the CUDA MPS daemon for the run (unless one runs) so that "
                        "they run at once; --no-mps: they run time-sliced, and their rows say so")
    p.add_argument("--out", default="results", help="folder for results.csv, results.json (appended to) and the plots")
    return p


OPS = ["combine", "gather", "layer"]


def served_name(backend: str, pg: str, built: Optional[str]) -> str:
    """The name a backend's rows carry: nccl's, the group's backend (its all-to-all runs); auto's,
    auto:nccl where its communicator (``built``: its backend) fell back to the nccl path (no peer
    access, a failed buffer setup): its rows are then that path's, not the fused kernel's."""
    if backend == "nccl":
        return pg
    return "auto:nccl" if backend == "auto" and built == "nccl" else backend


def plan(worlds: list, backends: list, cuda: bool, gpus: int) -> tuple:
    """Per group size: whether its ranks share a GPU, its process group's backend and the backends
    that can run (decided before any rank is spawned); a line for each backend left out; and, per
    size, why the nccl baseline does not run there (absent where it runs)."""
    runs, notes, no_baseline = [], [], {}
    for n in worlds:
        shared = cuda and gpus < n  # ranks share a GPU; NCCL refuses two ranks on one GPU
        pg = "gloo" if shared or not cuda else "nccl"
        run = [b for b in backends if not (b in FUSED + ["auto"] and n > MAX_PEERS or b == "nccl" and shared)]
        rest = f"{' and '.join(pg if b == 'nccl' else b for b in run)} only" if run else "nothing runs"
        for b in [b for b in backends if b in FUSED and b not in run]:
            notes.append(f"N={n}: {b} not run (the triton path serves up to {MAX_PEERS} ranks); {rest}")
        if "auto" in backends and "auto" not in run:
            notes.append(f"N={n}: auto not run (above {MAX_PEERS} ranks it serves with the nccl path, the "
                         f"baseline); {rest}")
        if "nccl" in backends and "nccl" not in run:
            notes.append(f"N={n}: nccl not run ({n} ranks share {gpus} GPU(s); NCCL refuses two ranks on one GPU); "
                         f"{rest}")
            no_baseline[n] = f"not run: {n} ranks share {gpus} GPU(s)"
        elif "nccl" not in backends:
            no_baseline[n] = "not run: not in --backends"
        runs.append((n, shared, pg, run))
    return runs, notes, no_baseline


def mps_choice(runs: list, cuda: bool, wanted: bool, env=os.environ) -> tuple:
    """Whether to start the MPS daemon ("start"), one already serves ("running"), or none ("off"),
    and the line said before the table where ranks sharing a GPU will run time-sliced."""
    shared = [n for n, is_shared, *_ in runs if is_shared]
    if not cuda or not shared:
        return "off", None
    if mps_running(env):
        return "running", None
    if not wanted:
        return "off", sliced_note(shared, "--no-mps")
    return "start", None


def sliced_note(sizes: list, why: str) -> str:
    return (f"{why}: the ranks of N={', '.join(map(str, sizes))} share a GPU without MPS, so the GPU switches "
            "between their processes: those rows (sliced: yes) time that switching, not the transport, and are "
            "compared with neither NCCL nor the floor")


CPU_BANNER = ("No GPU: the real kernels and protocol run under Triton's interpreter, a process per rank, each "
              "point checked against a float64 reference (err) before it is timed.")
CPU_NOTE = ("Every point above matched the reference (err: largest relative error; the gather is a bit-exact copy). "
            "Its times are the interpreter's, not a transport's.")


# Seconds a GPU run spends per group and backend set up (spawn, compile, auto's plan, MPS) and per
# point, for the estimate printed before the run (the progress line then gives one from the run's own
# pace). Set from the default run on one H200: 88 s for 2 setups and 24 points (default_run.log).
SETUP_S, POINT_S = 24.0, 1.6


def _eta(seconds: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(time.time() + seconds))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--full", action="store_true")
    p = parser(cuda, gpus, pre.parse_known_args(argv)[0].full)
    args = p.parse_args(argv)
    if not cuda and set(args.modes) != {"eager"}:
        p.error("--modes graph and graph8 need a GPU (they capture CUDA graphs); without one only eager runs")
    error = geometry_error(args)
    if error:
        p.error(error)
    runs, notes, no_baseline = plan(args.world_size, args.backends, cuda, gpus)
    if not any(run for *_, run in runs):
        p.error("nothing to run: " + "; ".join(notes))
    if not cuda:
        print(CPU_BANNER)
    for note in notes:
        print(note)
    mps, mps_note = mps_choice(runs, cuda, args.mps)
    tty = sys.stdout.isatty()
    total = (sum(len(run) for *_, run in runs) * len(args.head_dim) * len(args.batch) * len(args.modes)
             * len(args.op))
    setups = sum(len(run) for *_, run in runs) * len(args.head_dim)
    if cuda:
        guess = setups * SETUP_S + total * POINT_S
        print(f"{total} points in {len(runs)} group size(s): about {guess:.0f} s, done near {_eta(guess)}", flush=True)

    rows = []
    device = "cuda" if cuda else "cpu"
    seed = int.from_bytes(os.urandom(4), "little")
    where = ""
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        if mps == "start":
            try:
                stack.enter_context(mps_daemon(True))
            except (OSError, subprocess.SubprocessError) as exc:
                mps = "off"
                mps_note = sliced_note([n for n, shared, *_ in runs if shared],
                                       f"MPS could not be started ({exc})")
        if mps_note:
            print(mps_note)
        mps_on = mps != "off"
        rate = copy_rate() if cuda else float("nan")
        info = provenance(argv)
        info["copy_rate_Bps"] = rate
        try:
            for n, shared, pg, run in runs:
                if not run:
                    continue
                where = f"N={n}"
                w = World(n, device, pg_backend=pg)
                try:
                    for backend in run:
                        name = served_name(backend, pg, None)
                        for d in args.head_dim:
                            where = f"N={n} {name} D={d}"
                            tilings = w.run(ranks.setup, args.heads_per_rank, d, max(1, *args.batch), device, backend,
                                            args.num_warps, {"auto": None, "on": True, "off": False}[args.pdl],
                                            args.timer, args.dtype, args.query_dim, args.query_dtype)[0]
                            name = served_name(backend, pg, tilings["backend"])
                            if name != served_name(backend, pg, None):
                                print(f"{chr(13) if tty else ''}N={n}: auto serves with the nccl path here "
                                      f"({tilings['reason']}): its rows are labelled {name}", flush=True)
                            if tilings["plan"]:
                                print(f"{chr(13) if tty else ''}N={n} D={d} {tilings['plan']}\n"
                                      f"  its times at this run's sizes (* its choice; beside the medians below):\n"
                                      f"{tilings['plan'].times_at(args.batch)}", flush=True)
                            for B in args.batch:
                                for op in args.op:
                                    for mode in args.modes:
                                        where = f"N={n} {name} D={d} B={B} {op} {mode}"
                                        res = w.run(ranks.run_point, B, mode, args.iters, seed + B, op,
                                                    args.metadata, timeout=120)
                                        rows.append(_row(res, n, gpus, mps_on, d, args.heads_per_rank, B, mode,
                                                         name, rate, shared, cuda, *tilings[op][max(B, 1) - 1],
                                                         args.dtype, args.iters, op, args.query_dim,
                                                         args.query_dtype, args.metadata,
                                                         tilings["gather_pulled"][max(B, 1) - 1]))
                                        _progress(rows, total, where, start, tty)
                finally:
                    w.close()
        except RankError as exc:
            if rows and tty:
                print()  # ends the progress line
            raise SystemExit(f"{p.prog}: error at {where}: {rank_failure(exc)}")
    _fill_speedups(rows)
    if tty:
        print()
    os.makedirs(args.out, exist_ok=True)
    csv_path, path = os.path.join(args.out, "results.csv"), os.path.join(args.out, "results.json")
    _append_csv(csv_path, [{**r, "date": info["date"], "git_commit": info["git_commit"]} for r in rows])
    runs_json = []
    if os.path.exists(path):
        with open(path) as f:
            runs_json = json.load(f)  # older files may hold bare NaN
    runs_json.append({"provenance": info, "rows": rows})
    with open(path, "w") as f:
        json.dump(strict_json(runs_json), f, indent=1, allow_nan=False)
    try:
        from .plot import plot

        drawn = plot(path, args.out)
        plots = "plot " + ", ".join(drawn) if drawn else "no plot (B = 0 alone has no place on its log axis)"
    except ImportError:
        plots = "no plot (matplotlib missing: pip install matplotlib)"
    print(format_table(rows))
    if cuda:
        print()
        print(summary(rows, no_baseline))
    else:
        print(CPU_NOTE)
        print()
        print(kept_results())
        print()
    print(f"Written: {csv_path} and {path} (rows appended), {plots}")


def _progress(rows: list, total: int, where: str, start: float, tty: bool) -> None:
    """One line per point without a terminal (a log), else one line redrawn; with the finish time
    the run's pace so far gives."""
    left = (time.monotonic() - start) / len(rows) * (total - len(rows))
    text = f"{len(rows)}/{total} {where}: {rows[-1]['median_us']:.1f} us" + (
        f", done near {_eta(left)}" if len(rows) < total else "")
    if tty:
        done = len(rows) * 30 // total
        print(f"\r[{'#' * done}{'.' * (30 - done)}] {text}   ", end="", flush=True)
    else:
        print(text, flush=True)


def summary(rows: list, no_baseline: dict) -> str:
    """One short table per group size: each of our rows (at the first head dim, in graph8 where it
    ran, else the first mode) beside the baseline, the speedup and the % of the floor."""
    if not rows:
        return ""
    mode = "graph8" if any(r["mode"] == "graph8" for r in rows) else rows[0]["mode"]
    d = rows[0]["head_dim"]
    ours = [r for r in rows if r["backend"] not in BASELINES and r["mode"] == mode and r["head_dim"] == d]
    baseline = next((r["backend"] for r in rows if r["backend"] in BASELINES), "nccl")
    out = []
    for n in dict.fromkeys(r["world"] for r in ours):
        sel = [r for r in ours if r["world"] == n]
        width = max(len(no_baseline.get(n, "")), 8)
        meta = any(r.get("metadata") for r in sel)
        lines = [f"N={n}, {mode}, D = {d}, Dq = {sel[0]['query_dim']}"
                 + (", the combines with vLLM's batch metadata" if meta else "") + ":",
                 f"  {'op':7} {'B':>4} {'backend':7} {'us':>8} {baseline + ' us':>{width}} {'x':>5} {'%floor':>6}"]
        for r in sel:
            base = (f"{r['baseline_us']:.1f}" if not missing(r["baseline_us"])
                    else no_baseline.get(n, "not run"))
            frac = "sliced" if r.get("timesliced") else "-" if missing(r["floor_frac"]) else f"{100 * r['floor_frac']:.0f}"
            x = "-" if missing(r["speedup"]) else f"{r['speedup']:.2f}"
            lines.append(f"  {r['op']:7} {r['B']:>4} {r['backend']:7} {r['median_us']:>8.1f} {base:>{width}} {x:>5} "
                         f"{frac:>6}")
        out.append("\n".join(lines))
    return "Summary (us: the slowest rank's median per call; x: the baseline's time over ours):\n" + "\n".join(out)


def geometry_error(args: argparse.Namespace):
    """The communicator's own rules, applied before any rank is spawned (None: every point fits)."""
    from dcp.checks import combine_geometry_error, query_geometry_error

    for d in args.head_dim:
        error = combine_geometry_error(2, 2 * args.heads_per_rank, d, getattr(torch, args.dtype))
        if error:
            return "--head-dim: " + error.replace("head_dim ", "", 1)
    if set(args.op) & {"gather", "layer"}:
        error = query_geometry_error(args.query_dim, getattr(torch, args.query_dtype))
        if error:
            return "--query-dim: " + error.replace("query_dim ", "", 1)
    return None


RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "results")
# The commit that brought the current protocol (the lockstep flags: docs/design.md, section 3) and
# its date (UTC): kept GPU results of an older commit are said to predate it. Move both with the protocol.
PROTOCOL_SINCE = ("af5aca4", "2026-12-01T09:03:06+00:00")


def predates_protocol(commit: str, date: str, repo: str = os.path.dirname(RESULTS)) -> bool:
    """Whether results measured at ``commit`` on ``date`` (ISO, UTC) ran an older protocol: by git's
    history where it has both commits, else by the date."""
    try:
        git = subprocess.run(["git", "-C", repo, "merge-base", "--is-ancestor", PROTOCOL_SINCE[0], commit],
                             capture_output=True, timeout=30).returncode
    except Exception:
        git = None
    return git == 1 if git in (0, 1) else date < PROTOCOL_SINCE[1]


def kept_results(folder: str = RESULTS) -> str:
    """The GPU results this checkout keeps (each folder's runs of its last commit, their graph-of-8 rows), each with
    its machine, commit, date and versions, and whether it predates the current protocol; in an
    installed copy, which has none, one line saying where they are."""
    if not os.path.isdir(folder):
        return ("GPU results are not in this installation: the repository keeps them in docs/results/ "
                "(one folder per machine kind).")
    from .plot import machine

    parts = []
    for kind in sorted(os.listdir(folder)):
        path = os.path.join(folder, kind, "results.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            kept = json.load(f)
        prov = kept[-1]["provenance"]
        keys = {key for *_, key, _ in COLUMNS}  # (rows of older runs lack some columns)
        # The last run and those of its commit before it (a sweep and its --metadata pass).
        rows = [{**dict.fromkeys(keys), "op": "combine", "query_dim": r["head_dim"], **r}
                for run in kept if run["provenance"]["git_commit"] == prov["git_commit"]
                for r in run["rows"] if r["mode"] == "graph8"]
        if not rows:
            continue
        which = "graph8 rows"
        if any(r["backend"] == "auto" for r in rows):  # what a communicator runs by default (and the baseline)
            rows = [r for r in rows if r["backend"] == "auto" or r["backend"] in BASELINES]
            which = f"auto's graph8 rows; every backend's in docs/results/{kind}/results.csv"
        commit, date = prov["git_commit"], prov["date"]
        old = predates_protocol(commit, date)
        parts.append(f"docs/results/{kind}: {machine(prov, rows)}, commit {commit} of {date[:10]}, torch "
                     f"{prov['torch']}, triton {prov['triton']} ({which})"
                     + (f". Measured before the current protocol ({PROTOCOL_SINCE[0]}, {PROTOCOL_SINCE[1][:10]}): "
                        f"its rows, and their speedups over NCCL (x), are the kernels' at {commit}, not this "
                        "checkout's" if old else "") + ":\n" + format_table(rows))
    if not parts:
        return f"GPU results: none in {folder}"
    return "The GPU results this checkout keeps (docs/results/):\n\n" + "\n\n".join(parts)


def rank_failure(exc: RankError) -> str:
    """A rank failure as one line where every failing rank raised the same error (each rank's
    traceback would bury it); else the first failing rank's traceback, then each rank's error."""
    last = {r: _error_line(tb) for r, (_, tb) in exc.failures.items()}
    if len(set(last.values())) == 1:
        return last[min(last)]
    return exc.failures[min(last)][1].rstrip() + "\n" + "; ".join(f"rank {r}: {e}" for r, e in last.items())


def _error_line(tb: str) -> str:
    """A traceback's last line, the exception's module left out (``DcpError: ...``)."""
    line = tb.strip().splitlines()[-1]
    name, sep, message = line.partition(": ")
    return (name.rsplit(".", 1)[-1] if " " not in name else name) + sep + message


def strict_json(value):
    """NaN and infinities as None (JSON's null): strict JSON parsers refuse bare NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [strict_json(v) for v in value]
    return value


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


def op_bytes(op: str, n: int, B: int, hn: int, d: int, dq: int, q_size: int, per_device: int, size: int = 2,
             gather_pulled: bool = False) -> tuple:
    """(size, floor bytes) of one call of ``op`` (partial outputs of ``size`` bytes; ``per_device``
    ranks on the busiest device). size, as nccl-tests counts: the combine's is the bytes one rank
    sends (the packed [N, B, H/N, D] values with their fp32 LSE, an all-to-all); the gather's the
    bytes of its [B, H, Dq] result (an all-gather's total); a layer's both. The floor counts the
    bytes as the kernel moves them: a pushed gather writes its rows into N peers' slots, a pulled
    one (or the layer's gather, where pulled) once into its own."""
    combine = (n * B * hn * (d * size + 4), floor_bytes(n, B, hn, d, per_device, size))
    rows, out = B * hn * dq * q_size, B * hn * n * dq * q_size
    # read this rank's rows, write them (to N slots, or once), read N sources' rows, write the result
    gather = (out, (2 * rows + 2 * out if gather_pulled else rows + 3 * out) * per_device)
    if op == "combine":
        return combine
    if op == "gather":
        return gather
    return combine[0] + gather[0], combine[1] + gather[1]


def _row(res, n, gpus, mps_on, d, hn, B, mode, backend, rate, shared, cuda, num_warps, pdl, dtype, iters,
         op="combine", query_dim=0, query_dtype="bfloat16", metadata=False, gather_pulled=False) -> dict:
    worst = max(res, key=lambda r: r["median_us"])  # the slowest rank's median
    per_gpu = -(-n // max(gpus, 1)) if cuda else 0  # (the ranks of the busiest GPU: spawn deals them round)
    size, floor = op_bytes(op, n, B, hn, d, query_dim or d, getattr(torch, query_dtype).itemsize, max(per_gpu, 1),
                           getattr(torch, dtype).itemsize, gather_pulled)
    nan = float("nan")
    sliced = cuda and shared and not mps_on  # the GPU time-slices the ranks' processes
    floor_us = floor / rate * 1e6 if cuda and not sliced and floor else nan  # (no floor for no bytes: B = 0)
    med = worst["median_us"] or nan  # (a point that launches nothing, NCCL's at B = 0, may time 0)
    return dict(world=n, ranks_per_gpu=per_gpu, mps=mps_on, timesliced=sliced or None,
                head_dim=d, op=op,
                query_dim=query_dim, query_dtype=query_dtype,
                metadata=True if metadata and op != "gather" else None,  # (a gather takes none)
                heads_per_rank=hn, B=B, mode=mode, backend=backend, dtype=dtype, num_warps=num_warps, pdl=pdl,
                timer=res[0]["timer"], mark_us=max(r["mark_us"] for r in res), size_bytes=size,
                **{k: worst[k] for k in ("median_us", "p10_us", "p90_us")},
                loop_us=max(r["loop_us"] for r in res), held=all(r["held"] for r in res) if cuda else None,
                iters=iters, steps_per_hold=min(r["steps_per_hold"] for r in res),
                # (without a GPU: no bandwidth of a transport, and the host time is the call itself)
                algbw_GBps=size / med / 1e3 if cuda else nan,
                busbw_GBps=size / med / 1e3 * (n - 1) / n if cuda else nan,
                floor_us=floor_us, floor_frac=floor_us / med,
                host_us=max(r["host_us"] for r in res) if cuda else nan,
                host_loop_us=max(r["host_loop_us"] for r in res) if cuda else nan,
                max_rel_err=max(r["max_rel_err"] for r in res),
                baseline_us=float("nan"), speedup=float("nan"))


def _fill_speedups(rows: list) -> None:
    """baseline_us and speedup (the baseline's time / this time) on the rows of every point where the
    nccl backend ran (the baseline, named by its process group's backend: nccl, or gloo). None at
    B = 0: NCCL's path then exchanges nothing, so there is no call to compare with."""
    point = lambda r: (r["world"], r["head_dim"], r["B"], r["mode"], r.get("op", "combine"))
    baseline = {point(r): r["median_us"] for r in rows if r["backend"] in BASELINES and r["B"] > 0}
    for r in rows:
        t = baseline.get(point(r))
        if t is not None:
            r["baseline_us"], r["speedup"] = t, t / r["median_us"]


def _dims(r: dict) -> str:
    """The widths a row moved: the combine's D, the gather's Dq, a layer's both."""
    op = r.get("op", "combine")
    return str(r["head_dim"]) if op == "combine" else str(r["query_dim"]) if op == "gather" else \
        f"{r['head_dim']}|{r['query_dim']}"


def _held_cell(r: dict) -> str:
    """yes / NO; "/k" where the steps were queued k at a time, each chunk behind its own hold."""
    return ("yes" if r["held"] else "NO") + (f"/{r['steps_per_hold']}" if r["steps_per_hold"] < r["iters"] else "")


def _number(key: str, spec: str, scale: float = 1) -> tuple:
    return key, lambda r: format(scale * r[key], spec)


def _field(key: str) -> tuple:
    return key, lambda r: str(r[key])


# The table's columns: header ("{baseline}": the baseline's name), unit, width, the row's field
# (which decides whether the cell has a value) and how the cell is written.
COLUMNS = [
    ("N", "", 2, *_field("world")), ("sliced", "", 6, "timesliced", lambda r: "yes"),
    ("backend", "", 7, *_field("backend")), ("op", "", 7, *_field("op")),
    ("meta", "", 4, "metadata", lambda r: "yes"),
    ("D|Dq", "", 7, "head_dim", _dims),
    ("B", "tokens", 4, *_field("B")), ("mode", "", 6, *_field("mode")), ("size", "bytes", 9, *_field("size_bytes")),
    ("med", "us", 8, *_number("median_us", ".1f")), ("p10", "us", 7, *_number("p10_us", ".1f")),
    ("p90", "us", 7, *_number("p90_us", ".1f")), ("mark", "us", 5, *_number("mark_us", ".1f")),
    ("loop", "us", 7, *_number("loop_us", ".1f")), ("algbw", "GB/s", 7, *_number("algbw_GBps", ".2f")),
    ("busbw", "GB/s", 7, *_number("busbw_GBps", ".2f")), ("floor", "us", 7, *_number("floor_us", ".1f")),
    ("%floor", "%", 6, *_number("floor_frac", ".0f", 100)), ("host", "us", 6, *_number("host_us", ".1f")),
    ("hloop", "us", 6, *_number("host_loop_us", ".1f")), ("{baseline}", "us", 6, *_number("baseline_us", ".1f")),
    ("x", "ratio", 5, *_number("speedup", ".2f")), ("held", "", 6, "held", _held_cell),
    ("err", "", 7, *_number("max_rel_err", ".1e")),
]


def format_table(rows: list) -> str:
    """Header, units, a line per row. A column that has no value in any row is left out (on the CPU
    tier: the device timers', the floor's and held); a cell without a value reads -."""
    baseline = next((r["backend"] for r in rows if r["backend"] in BASELINES), "nccl")
    columns = [(head.format(baseline=baseline), unit, width, key, cell) for head, unit, width, key, cell in COLUMNS
               if any(not missing(r[key]) for r in rows)]
    columns = [(head, unit, max(width, len(head), len(unit)), key, cell) for head, unit, width, key, cell in columns]
    lines = [" ".join(f"{head:>{width}}" for head, _, width, _, _ in columns),
             " ".join(f"{unit:>{width}}" for _, unit, width, _, _ in columns)]
    lines += [" ".join(f"{'-' if missing(r[key]) else cell(r):>{width}}" for _, _, width, key, cell in columns)
              for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
