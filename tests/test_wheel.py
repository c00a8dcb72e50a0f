"""The built wheel installs cleanly beside Hugging Face's ``kernels`` (issue 28) and runs from there alone.

vLLM environments may hold HF's ``kernels``; pip does not check file conflicts, so a wheel with a
top-level ``kernels`` (or ``bench``) would overwrite it. The wheel is built from a copy of the
checkout and installed into a fresh virtual environment beside HF's package; every check runs that
environment's python from a temporary folder, so neither the checkout nor its editable install
(CI installs one) can answer for the wheel.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import NamedTuple, Optional

import pytest

import dcp

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = "dcp-a2a-bench"

# Two ranks of the installed package, each reporting the dcp it imported and its error against the
# float64 reference. Spawned ranks re-import this file, hence the __main__ guard.
TWO_RANKS = '''
import json

import torch
import torch.distributed as dist

import dcp
from dcp import DcpAllToAll
from dcp.reference import chunk_reference, make_inputs, max_rel_error
from dcp.spawn import World


def lse_call(state):
    comm = DcpAllToAll(dist.group.WORLD, max_tokens=4, num_heads=4, head_dim=16)
    try:
        rank, B = comm.rank, 3
        outs, lses = make_inputs(1234, 2, B, 4, 16, torch.bfloat16)
        y = comm.lse_reduce(outs[rank], lses[rank])
        ref, _ = chunk_reference(outs, lses, rank, comm.heads_per_rank)
        return dcp.__file__, tuple(y.shape), max_rel_error(y, ref)
    finally:
        comm.close()


if __name__ == "__main__":
    world = World(2)
    try:
        print(json.dumps(world.run(lse_call, timeout=240)))
    finally:
        world.close()
'''

HF_KERNELS = "import json, kernels; print(json.dumps([kernels.__file__, hasattr(kernels, 'get_kernel')]))"

DCP = '''
import importlib.metadata
import json

import dcp
import dcp.bench
import dcp.kernels

print(json.dumps(dict(dcp=dcp.__file__, kernels=dcp.kernels.__file__, bench=dcp.bench.__file__,
                      version=dcp.__version__, dist_version=importlib.metadata.version("dcp-a2a"))))
'''


def _run(cmd: list, cwd: Path, timeout: float, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _source_copy(folder: str, names: list) -> list:
    """What the build copy leaves out: VCS, build outputs and caches, results and docs, the README's venv."""
    top = {".git", "build", "docs", "results", ".whl", ".venv"} if Path(folder) == ROOT else set()
    return [n for n in names if n in top or n in {"__pycache__", ".pytest_cache"} or n.endswith(".egg-info")]


class Installed(NamedTuple):
    wheel: Path
    python: Path  # the venv's
    purelib: Path  # the venv's site-packages
    scripts: Path  # the venv's bin
    env: dict  # os.environ without PYTHONPATH and the like
    cwd: Path  # an empty folder to run in


@pytest.fixture(scope="module")
def installed():
    """The wheel built and installed into a fresh venv after HF's kernels; removed afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix="dcp-wheel-"))
    try:
        # A copy: setuptools builds in the source tree, and a stale build/lib would leak into the wheel.
        src = tmp / "src"
        shutil.copytree(ROOT, src, ignore=_source_copy)
        _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
              "-w", tmp / "dist", src], tmp, 300)
        (wheel,) = (tmp / "dist").glob("*.whl")

        venv = tmp / "venv"
        _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp, 120)
        python = venv / "bin" / "python"
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        paths = json.loads(_run([python, "-c", "import json, sysconfig; print(json.dumps(sysconfig.get_paths()))"],
                                tmp, 60, env).stdout)
        purelib, scripts = Path(paths["purelib"]), Path(paths["scripts"])
        # This interpreter's site folders (torch, triton, pip) as plain paths after the venv's own:
        # their .pth files, the editable install's among them, are not run there.
        outer = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
        (purelib / "outer-site.pth").write_text("\n".join(outer) + "\n")

        # HF's package first, as in a vLLM environment, then the wheel. pip also sees the editable
        # install's metadata in the outer folders: --force-reinstall (it leaves that one in place).
        _run([python, "-m", "pip", "install", "-q", "kernels"], tmp, 600, env)
        _run([python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", wheel], tmp, 300, env)
        cwd = tmp / "run"
        cwd.mkdir()
        yield Installed(wheel, python, purelib, scripts, env, cwd)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_wheel_holds_only_dcp(installed):
    wheel = installed.wheel
    names = zipfile.ZipFile(wheel).namelist()
    version = wheel.name.split("-")[1]
    info = f"dcp_a2a-{version}.dist-info"
    assert {n.split("/")[0] for n in names} == {"dcp", info}, sorted(names)
    assert version == dcp.__version__
    assert {"dcp/py.typed", "dcp/kernels/lse_alltoall.py", "dcp/bench/__main__.py",
            f"{info}/licenses/LICENSE"} <= set(names), sorted(names)
    entry_points = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    assert f"{SCRIPT} = dcp.bench.__main__:main" in entry_points
    assert "[vllm.general_plugins]\ndcp_a2a = dcp.vllm_plugin:register" in entry_points, entry_points


def test_vllm_plugin_entry_point_loads_from_the_wheel(installed):
    """What vLLM's plugin loader does in every process: find the group's entry points and load
    them; the hook then does nothing without DCP_A2A_VLLM=1 (and no vLLM is installed here)."""
    code = ("import importlib.metadata as md, json; eps = md.entry_points(group='vllm.general_plugins'); "
            "fn = [e for e in eps if e.name == 'dcp_a2a'][0].load(); fn(); "
            "print(json.dumps([fn.__module__, fn.__name__]))")
    env = {k: v for k, v in installed.env.items() if k != "DCP_A2A_VLLM"}
    assert json.loads(_run([installed.python, "-c", code], installed.cwd, 120, env).stdout) == \
        ["dcp.vllm_plugin", "register"]


def test_hf_kernels_stays_hf_kernels(installed):
    path, has_get_kernel = json.loads(_run([installed.python, "-c", HF_KERNELS], installed.cwd, 120,
                                           installed.env).stdout)
    assert has_get_kernel, f"HF's kernels overwritten: {path}"


def test_dcp_imports_from_the_wheel(installed):
    seen = json.loads(_run([installed.python, "-c", DCP], installed.cwd, 120, installed.env).stdout)
    pkg = installed.purelib / "dcp"
    assert [Path(seen[k]) for k in ("dcp", "kernels", "bench")] == \
        [pkg / "__init__.py", pkg / "kernels" / "__init__.py", pkg / "bench" / "__init__.py"], seen
    assert seen["version"] == seen["dist_version"] == dcp.__version__


def test_two_rank_call_through_installed_package(installed):
    (installed.cwd / "two_ranks.py").write_text(TWO_RANKS)
    proc = _run([installed.python, "two_ranks.py"], installed.cwd, 420, installed.env)
    ranks = json.loads(proc.stdout.splitlines()[-1])
    assert len(ranks) == 2
    for path, shape, err in ranks:
        assert Path(path) == installed.purelib / "dcp" / "__init__.py"
        assert shape == [3, 2, 16] and err <= 1.6e-2  # bfloat16's tolerance (tests/rank_cases.py)


def test_console_script_help(installed):
    proc = _run([installed.scripts / SCRIPT, "--help"], installed.cwd, 120, installed.env)
    assert proc.stdout.startswith(f"usage: {SCRIPT} [-h]") and "--world-size" in proc.stdout


def test_python_m_dcp_bench_runs_from_the_wheel_and_says_so(installed):
    """The README's installed name: ``python -m dcp.bench`` (``python -m bench`` is the source tree's)."""
    proc = _run([installed.python, "-m", "dcp.bench", "--help"], installed.cwd, 120, installed.env)
    assert proc.stdout.startswith("usage: python -m dcp.bench [-h]"), proc.stdout[:200]
    kept = _run([installed.python, "-c", "from dcp.bench.__main__ import kept_results; print(kept_results())"],
                installed.cwd, 120, installed.env).stdout
    assert kept.startswith("GPU results are not in this installation") and kept.count("\n") == 1, kept
