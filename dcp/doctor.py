"""``python -m dcp.doctor``: what to run on a machine before switching the backend on.

It prints the versions that matter (torch, Triton, CUDA, NCCL) against those this package is tested
with, the GPUs with their compute capability and which pairs have peer access, then compiles every
kernel variant a communicator of the given geometry would load, for this machine's GPU or for the
architectures named with ``--arch``, and judges each: 16-byte vector rows, spills, registers,
shared memory. It exits 1 when a verdict is bad, 0 otherwise.

With ``--measure`` it also times the transports on this host (``_measure``): push and pull for
each GPU pair, and the plan ``backend="auto"`` would choose for every group size.
"""

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional

import torch
import triton

from dcp.checks import DTYPE_NAMES, OUT_DTYPE_NAMES, dtype_name
from dcp.compiled import ARCHES, hot_variants, judge
from dcp.constants import KIND_COMBINE
from dcp.spawn import World, mps_daemon

# The releases this package is tested with, the one place that says so in code (pyproject.toml
# declares the same ranges; the README's "Versions" the same runs): each torch + Triton pair that
# runs, and where.
TESTED_PAIRS = {
    ((2, 11), (3, 6)): "the GPU tier, on one H200 and on one H100",
    ((2, 13), (3, 6)): "CI: the CPU tier, the main suite",
    ((2, 14), (3, 8)): "CI: the CPU tier on the users' stack (SGLang 0.5.23's pins; vLLM 0.33.0's torch)",
    ((2, 13), (3, 9)): "CI: the compiled-code checks",
}
TESTED = {name: (min(pair[i] for pair in TESTED_PAIRS), max(pair[i] for pair in TESTED_PAIRS))
          for i, name in enumerate(("torch", "triton"))}
DTYPES = {name: DTYPE_NAMES[name] for name in OUT_DTYPE_NAMES}
QUERY_DTYPES = DTYPE_NAMES
COLUMNS = """columns of the compiled-code table:
  variant  transport (push, pull; nccl: the NCCL path's pack and combine kernels), collective
           (combine, gather), wN: N warps per program, pdl: launched with programmatic dependent
           launch (GPUs from sm_90)
  v4 st    16-byte vector stores to global memory in the PTX (0: rows are not stored as vectors)
  v4 ld    16-byte vector loads from global memory (0: rows are not loaded as vectors)
  2-byte   scalar 16-bit global loads and stores (more than 0: some rows move 2 bytes at a time)
  spill    bytes of registers spilled to local memory (ptxas; more than 0 is slow)
  regs     registers per thread; a program must fit on one SM
  smem     shared memory per program, bytes"""


def _release(version: str) -> tuple:
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2])


def _dotted(release: tuple) -> str:
    return ".".join(map(str, release))


def versions() -> dict:
    """Versions as this process sees them; None where there is none (a CPU build has no CUDA)."""
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # a build without NCCL
            nccl = None
    return {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda, "nccl": nccl,
            "python": sys.version.split()[0]}


def untested(found: dict) -> list:
    """Lines naming each of torch and Triton outside the tested range."""
    lines = []
    for name, (low, high) in TESTED.items():
        if not low <= _release(found[name]) <= high:
            lines.append(f"{name} {found[name]} is outside the tested range {_dotted(low)}-{_dotted(high)}")
    return lines


def tested(found: dict) -> str:
    """One line: whether this torch and Triton are releases this package is tested with."""
    pair = f"torch {found['torch']} with Triton {found['triton']}"
    span = f"torch {_dotted(TESTED['torch'][0])}-{_dotted(TESTED['torch'][1])}, " \
           f"Triton {_dotted(TESTED['triton'][0])}-{_dotted(TESTED['triton'][1])}"
    outside = untested(found)
    if outside:
        return f"not tested: {'; '.join(outside)} (tested: {span})"
    where = TESTED_PAIRS.get((_release(found["torch"]), _release(found["triton"])))
    if where:
        return f"tested: {pair} ({where}; the tested range: {span})"
    return (f"within the tested range ({span}): {pair}, a pair not run itself (those run: "
            + ", ".join(f"{_dotted(t)} with {_dotted(r)}" for t, r in TESTED_PAIRS) + ")")


def gpus() -> list:
    """Every visible GPU: name, compute capability, SMs, and the GPUs it has peer access to."""
    if not torch.cuda.is_available():
        return []
    found = []
    n = torch.cuda.device_count()
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        found.append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
                      "peers": [j for j in range(n) if j != i and torch.cuda.can_device_access_peer(i, j)]})
    return found


class _Help(argparse.RawDescriptionHelpFormatter):
    """Each option's default after its help (a default that depends on the machine is in its text)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is argparse.SUPPRESS or "default:" in (action.help or ""):
            return action.help
        default = ("on" if action.default else "off") if isinstance(action.default, bool) else action.default
        return f"{action.help} (default: {default})"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dcp.doctor", description=__doc__.split("\n\n")[0].replace("``", ""),
                                 formatter_class=_Help,
                                 epilog="Defaults: a vLLM MLA layer (16 heads per rank, D = 512 bfloat16, Dq = 576\n"
                                        "bfloat16) on a group of every GPU here (4 without GPUs). Dtypes as torch\n"
                                        "names them, as in the benchmark; bf16, fp16, fp32 and fp8 (float8_e4m3fn)\n"
                                        "are read as those.\n\n" + COLUMNS)
    ap.add_argument("--world-size", type=int, metavar="N",
                    help="ranks in the DCP group, 2-8 (default: every GPU here; 4 with fewer than 2)")
    ap.add_argument("--heads-per-rank", type=int, default=16, metavar="H",
                    help="attention heads per rank; the group's num_heads is N times as many")
    ap.add_argument("--head-dim", type=int, default=512, metavar="D", help="D of the combine's partial outputs")
    ap.add_argument("--query-dim", type=int, default=576, metavar="DQ", help="Dq of the query all-gather")
    ap.add_argument("--dtype", type=dtype_name, choices=list(DTYPES), default="bfloat16",
                    help="the combine's partial outputs")
    ap.add_argument("--query-dtype", type=dtype_name, choices=list(QUERY_DTYPES), default="bfloat16",
                    help="the queries of the all-gather")
    ap.add_argument("--max-tokens", type=int, default=512, metavar="B",
                    help="the communicator's max_tokens (tilings by size)")
    ap.add_argument("--arch", action="append", choices=sorted(ARCHES, key=ARCHES.get),
                    help="compile for this architecture instead of this machine's GPU, repeatable "
                         "(default: this machine's GPU; none without one)")
    ap.add_argument("--ptx-dir", type=Path, help="write the PTX of each variant here, one .ptx file each "
                                                 "(default: not written)")
    ap.add_argument("--json", type=Path, help="write the whole report here as JSON (default: not written)")
    ap.add_argument("--measure", action="store_true",
                    help="time push and pull for each GPU pair (a combine of B = 1 and B = max tokens), and print "
                         "the plan backend='auto' would choose for N = 2 up to every GPU (one GPU: for "
                         "--world-size ranks sharing it, under CUDA MPS)")
    ap.add_argument("--mps", action="store_true", help="start the CUDA MPS daemon for --measure")
    return ap


def _auto_plan(state, heads_per_rank: int, head_dim: int, query_dim: int, dtype: str, query_dtype: str,
               max_tokens: int) -> dict:
    """On each rank: an ``auto`` communicator, measured, and its plan (text, and every size's times)."""
    import torch.distributed as dist
    from dcp import DcpAllToAll

    os.environ["DCP_A2A_MEASURE"] = "1"
    n = dist.get_world_size()
    with DcpAllToAll(dist.group.WORLD, max_tokens=max_tokens, num_heads=heads_per_rank * n, head_dim=head_dim,
                     dtype=DTYPES[dtype], query_dim=query_dim, query_dtype=QUERY_DTYPES[query_dtype],
                     backend="auto") as comm:
        plan = comm.plan
        return {"text": str(plan) if plan else f"{comm.backend} ({comm.backend_reason})",
                "combine": plan.times(KIND_COMBINE) if plan else None}


def _measure(a: argparse.Namespace, devices: list) -> Optional[dict]:
    """``--measure``: per GPU pair (one GPU: two ranks sharing it) push and pull latency (a combine
    of B = 1) and rate (B = max_tokens, the bytes one rank sends); then ``auto``'s plan for every
    group size. Ranks sharing a GPU need CUDA MPS."""
    if not devices:
        print("not measured: no GPU here")
        return None
    one = len(devices) == 1
    if one and not (a.mps or os.environ.get("CUDA_MPS_PIPE_DIRECTORY")):
        print("not measured: ranks sharing this GPU need CUDA MPS (add --mps, or start nvidia-cuda-mps-control -d)")
        return None
    geometry = (a.heads_per_rank, a.head_dim, a.query_dim, a.dtype, a.query_dtype, a.max_tokens)
    row_bytes = a.head_dim * DTYPES[a.dtype].itemsize

    def plan_of(ranks: list) -> dict:
        env = {} if one else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ranks))}
        w = World(len(ranks), "cuda", env=env, pg_backend="gloo" if one else "nccl")
        try:
            return w.run(_auto_plan, *geometry, timeout=600)[0]  # the same plan on every rank
        finally:
            w.close()

    out = {"pairs": [], "plans": {}}
    with mps_daemon(a.mps):
        print(f"push / pull per GPU pair: a combine of B = 1 (us) and of B = {a.max_tokens} (GB/s one rank sends)")
        for i, j in [(0, 0)] if one else [(i, j) for i in range(len(devices)) for j in range(i + 1, len(devices))]:
            times = plan_of([i, j])["combine"]
            (_, _, small), (big_b, _, big) = times[0], times[-1]
            sent = big_b * 2 * a.heads_per_rank * row_bytes
            pair = {"gpus": [i, j], "latency_us": small, "GBps": {k: sent / us / 1e3 for k, us in big.items()}}
            out["pairs"].append(pair)
            print(f"  GPU {i} - GPU {j}: " + "; ".join(
                f"{'push' if k == 'triton' else k} {small[k]:.1f} us, {pair['GBps'][k]:.0f} GB/s" for k in small))
        for n in [a.world_size] if one else range(2, len(devices) + 1):
            plan = plan_of(list(range(n)))
            out["plans"][n] = plan["text"]
            print(f"N = {n}: {plan['text']}")
    return out


def _geometry_error(a: argparse.Namespace) -> Optional[str]:
    from dcp.checks import combine_geometry_error, query_geometry_error
    if not 2 <= a.world_size <= 8:
        return f"--world-size must be from 2 to 8; got {a.world_size}"
    if a.heads_per_rank < 1 or a.max_tokens < 1:
        return "--heads-per-rank and --max-tokens must be positive"
    return (combine_geometry_error(a.world_size, a.heads_per_rank * a.world_size, a.head_dim, DTYPES[a.dtype])
            or query_geometry_error(a.query_dim, QUERY_DTYPES[a.query_dtype]))


def main(argv: Optional[list] = None) -> int:
    a = parser().parse_args(argv)
    found, devices = versions(), gpus()
    if a.world_size is None:
        a.world_size = len(devices) if len(devices) >= 2 else 4
    error = _geometry_error(a)
    if error:
        print(f"dcp.doctor: {error}", file=sys.stderr)
        return 2
    report = {"versions": found, "tested": tested(found), "untested": untested(found), "gpus": devices, "geometry": {
        k: getattr(a, k) for k in ("world_size", "heads_per_rank", "head_dim", "query_dim", "dtype", "query_dtype",
                                   "max_tokens")}, "verdicts": [], "not_checked": None}
    print("versions: " + ", ".join(f"{k} {v or '-'}" for k, v in found.items()))
    print(("  warning: " if report["untested"] else "  ") + report["tested"])
    for d in devices:
        print(f"GPU {d['index']}: {d['name']}, compute capability {d['capability']}, {d['sms']} SMs, "
              f"peer access to {d['peers'] or 'none'}")
    if len(devices) > 1:
        print("peer access (row -> column):\n     " + " ".join(f"{j:>3}" for j in range(len(devices))))
        for d in devices:
            print(f"  {d['index']:>2} " + " ".join("  -" if j == d["index"] else ("  Y" if j in d["peers"] else "  N")
                                                    for j in range(len(devices))))
    if a.arch:
        caps, programs, gpu_scope = sorted({ARCHES[x] for x in a.arch}), 132, False
    elif devices:
        cc = devices[0]["capability"].split(".")
        caps = [int(cc[0]) * 10 + int(cc[1])]
        # one GPU: every rank shares it (scoped to the GPU; its SMs shared out among the ranks)
        gpu_scope = len(devices) == 1
        programs = max(1, devices[0]["sms"] // (a.world_size if gpu_scope else 1))
    else:
        report["not_checked"] = ("compiled code not checked: no GPU here; name an architecture with --arch "
                                 "(for example --arch sm_90 --arch sm_120)")
        print(report["not_checked"])
        caps = []
    if caps:
        variants = hot_variants(a.world_size, a.heads_per_rank, a.head_dim, a.query_dim, DTYPES[a.dtype],
                                QUERY_DTYPES[a.query_dtype], a.max_tokens, programs, gpu_scope, pdl=True)
        print(f"kernel variants of N = {a.world_size}, {a.heads_per_rank} heads per rank, D = {a.head_dim} {a.dtype}, "
              f"Dq = {a.query_dim} {a.query_dtype}, max_tokens {a.max_tokens} (Triton {triton.__version__}):")
        print(f"  {'arch':<7} {'variant':<27} {'v4 st':>5} {'v4 ld':>5} {'2-byte':>6} {'spill':>5} {'regs':>4} "
              f"{'smem':>6}  verdict")
        if a.ptx_dir:
            a.ptx_dir.mkdir(parents=True, exist_ok=True)
        for cap in caps:
            for v in variants:
                r = judge(v, cap)
                report["verdicts"].append(r.as_dict())
                print(f"  {r.arch:<7} {r.variant:<27} {r.vector_stores:>5} {r.vector_loads:>5} {r.scalar_16bit:>6} "
                      f"{r.spill_bytes:>5} {r.registers:>4} {r.shared_bytes:>6}  {'ok' if r.ok else 'BAD: '}"
                      f"{'; '.join(r.problems)}")
                if a.ptx_dir:
                    (a.ptx_dir / f"{r.arch}-{r.variant.replace(' ', '-')}.ptx").write_text(r.ptx)
    bad = [r for r in report["verdicts"] if not r["ok"]]
    if report["verdicts"]:
        print(COLUMNS)
        print(f"{len(report['verdicts']) - len(bad)} of {len(report['verdicts'])} variants ok"
              + ("" if not bad else ": the backend would run slower than it should here"))
    if a.measure:
        report["measure"] = _measure(a, devices)
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
