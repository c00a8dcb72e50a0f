"""Local rank processes for tests and benchmarks: started once, driven by function name.

Each rank is a process (ranks on streams of one process can deadlock: docs/design.md, section 2).
Every call has a timeout; on timeout or close the processes are killed, so no test leaves one behind.
"""

import contextlib
import importlib
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

READY_TIMEOUT_S = 180.0


class RankError(RuntimeError):
    """A rank raised; carries every failing rank's exception type name and traceback."""

    def __init__(self, failures: dict):
        self.failures = failures
        super().__init__("\n".join(f"--- rank {r} ---\n{tb}" for r, (_, tb) in failures.items()))

    def types(self) -> set:
        return {name for name, _ in self.failures.values()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world: int, port: int, conn, device: str, env: dict, pg_backend: str) -> None:
    os.environ.clear()  # the parent's environment now, as a spawned process has it
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        # The ranks share the host's few cores and spin in their waits: a rank's intra-op threads
        # would only compete with its peers' kernels for them.
        torch.set_num_threads(1)
    dist.init_process_group(pg_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    conn.send(("ready", None))
    state: dict = {}
    while True:
        msg = conn.recv()
        if msg is None:
            break
        module, name, args, kwargs = msg
        try:
            fn = getattr(importlib.import_module(module), name)
            conn.send(("ok", fn(state, *args, **kwargs)))
        except BaseException as exc:  # reported to the parent, which raises
            conn.send(("err", (type(exc).__name__, traceback.format_exc())))
    for obj in state.values():
        close = getattr(obj, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                pass
    dist.destroy_process_group()


def _context(device: str):
    """CPU ranks fork from a server that has imported torch: a rank starts in about 0.03 s instead
    of the 1.7 s a fresh interpreter takes to import it (the tests start a group per size in each module).
    CUDA ranks are spawned, fresh processes as on a real server."""
    if device == "cuda":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])  # (not dcp: ranks import it after the env is set)
    return ctx


class World:
    """``n`` rank processes over one process group; ``run`` calls a function on every rank.

    ``pg_backend``: ``gloo`` (default; works for ranks sharing a GPU) or ``nccl`` (one GPU per rank).
    """

    def __init__(self, n: int, device: str = "cpu", env: Optional[dict] = None, pg_backend: str = "gloo"):
        ctx = _context(device)
        port = _free_port()
        self.n, self.device = n, device
        self.procs, self.conns = [], []
        for r in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(r, n, port, child, device, {**os.environ, **(env or {})},
                                                 pg_backend),
                            daemon=True)
            p.start()
            self.procs.append(p)
            self.conns.append(parent)
        try:
            self._collect(range(n), READY_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise

    def _collect(self, ranks, timeout: float) -> list:
        deadline = time.monotonic() + timeout
        results: dict = {}
        failures: dict = {}
        pending = set(ranks)
        while pending:
            for r in list(pending):
                if self.conns[r].poll(0.01):
                    try:
                        kind, value = self.conns[r].recv()
                    except EOFError:
                        kind, value = "err", ("EOFError", f"rank {r} exited (code {self.procs[r].exitcode})")
                    pending.discard(r)
                    (failures if kind == "err" else results)[r] = value
                elif not self.procs[r].is_alive():
                    pending.discard(r)
                    failures[r] = ("ProcessExit", f"rank {r} exited with code {self.procs[r].exitcode}")
            if pending and time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"ranks {sorted(pending)} did not answer within {timeout:.0f} s; "
                                   f"world killed (failures so far: {failures})")
        if failures:
            raise RankError(dict(sorted(failures.items())))
        return [results[r] for r in sorted(results)]

    def run(self, fn: Callable, *args: Any, timeout: float = 300.0, ranks=None, **kwargs) -> list:
        ranks = list(range(self.n)) if ranks is None else list(ranks)
        for r in ranks:
            self.conns[r].send((fn.__module__, fn.__name__, args, kwargs))
        return self._collect(ranks, timeout)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)

    def close(self, timeout: float = 60.0) -> None:
        for r, c in enumerate(self.conns):
            if self.procs[r].is_alive():
                try:
                    c.send(None)
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        self.kill()


@contextlib.contextmanager
def mps_daemon(enabled: bool):
    """Start the CUDA MPS daemon for the run (ranks on one GPU then run concurrently). Where it
    cannot start, raises (OSError, SubprocessError) and leaves the environment as it was."""
    if not enabled:
        yield
        return
    tmp = tempfile.mkdtemp(prefix="dcp-mps-")
    env = {"CUDA_MPS_PIPE_DIRECTORY": tmp, "CUDA_MPS_LOG_DIRECTORY": tmp}
    try:
        subprocess.run(["nvidia-cuda-mps-control", "-d"], check=True, env={**os.environ, **env}, timeout=30,
                       capture_output=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.environ.update(env)
    try:
        yield
    finally:
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, timeout=30)
        for k in env:
            os.environ.pop(k, None)
        shutil.rmtree(tmp, ignore_errors=True)


def mps_running(env=os.environ) -> bool:
    """Whether an MPS daemon this process's CUDA clients would connect to is running: at
    ``CUDA_MPS_PIPE_DIRECTORY``, else at the default pipe directory."""
    return os.path.exists(os.path.join(env.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps", "control"))
