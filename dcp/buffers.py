"""Buffer providers: one symmetric region per rank and channel, reachable by every peer.

A provider allocates this rank's region, exchanges whatever names it over the group, and maps
every peer's region into this process. All of it happens once, in the constructor; the call path
only uses the addresses. Any failure on any rank fails the setup on every rank, with nothing left
allocated.
"""

import ctypes
import mmap
import os
import secrets
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from dcp import cudart
from dcp.config import shm_tag
from dcp.rendezvous import agree, all_gather, barrier


@dataclass
class SymmetricRegion:
    """This rank's region and every rank's region as addresses valid in this process."""

    peers: list[int]
    rank: int
    nbytes: int
    _release: list[Callable[[], None]] = field(default_factory=list)

    @property
    def local(self) -> int:
        return self.peers[self.rank]

    def close(self) -> None:
        while self._release:
            self._release.pop()()


def _attempt(step: Callable[[], None]) -> Optional[str]:
    """Run one setup step; its failure is reported to every rank rather than raised here."""
    try:
        step()
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _release(releases: list[Callable[[], None]]) -> None:
    while releases:
        try:
            releases.pop()()
        except Exception:
            pass


def _unlink(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _agree_or_unwind(group: dist.ProcessGroup, error: Optional[str], what: str,
                     releases: list[Callable[[], None]]) -> None:
    try:
        agree(group, error, what)
    except BaseException:
        _release(releases)
        raise


SHM_PREFIX = "/dev/shm/dcp-a2a-"


def shm_token() -> str:
    """A fresh name token for one setup's segments: ``TAG-`` then 24 random hex digits, where
    ``DCP_A2A_SHM_TAG`` names a TAG (its letters, digits and ``_``, at most 32), so that a process
    tree (a test session) can tell the segments it made from those of others on the machine."""
    tag = shm_tag()
    return (f"{tag}-" if tag else "") + secrets.token_hex(12)


class HostShmProvider:
    """POSIX shared memory, one segment per rank: CPU tensors under Triton's interpreter.

    Segments are created with mode 0600 under names agreed before any exists (``shm_token()`` of
    rank 0's, then the rank), and unlinked as soon as every peer has mapped them. Every rank
    unlinks every segment, after the last step or on any failure, a peer's death included, so none
    outlives the ranks that are still alive.
    """

    name = "host-shm"

    def open(self, group: dist.ProcessGroup, nbytes: int) -> SymmetricRegion:
        rank = dist.get_rank(group)
        token = all_gather(group, shm_token(), "host shared memory setup")[0]
        paths = [f"{SHM_PREFIX}{token}-{r}" for r in range(dist.get_world_size(group))]
        releases: list[Callable[[], None]] = []
        peers: list[int] = []
        try:
            error = _attempt(lambda: peers.append(self._map(paths[rank], nbytes, releases, create=True)))
            agree(group, error, "host shared memory setup")
            error = _attempt(lambda: peers.extend(
                self._map(p, nbytes, releases, create=False) for r, p in enumerate(paths) if r != rank))
            barrier(group, "host shared memory setup")  # every rank has mapped every segment, or given up
        except BaseException:
            _unlink(paths)
            _release(releases)
            raise
        _unlink(paths)
        _agree_or_unwind(group, error, "host shared memory setup", releases)
        own = peers.pop(0)
        peers.insert(rank, own)
        return SymmetricRegion(peers=peers, rank=rank, nbytes=nbytes, _release=releases)

    @staticmethod
    def _map(path: str, nbytes: int, releases: list, create: bool) -> int:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        view = (ctypes.c_char * nbytes).from_buffer(mm)
        addr = ctypes.addressof(view)

        def release() -> None:
            nonlocal view
            del view
            mm.close()

        releases.append(release)
        return addr


class CudaIpcProvider:
    """One dedicated device allocation per rank, shared by CUDA IPC handles.

    Works over NVLink, over PCIe P2P, and between processes that share one GPU.
    """

    name = "cuda-ipc"

    def __init__(self, device: torch.device):
        self.device = device

    def open(self, group: dist.ProcessGroup, nbytes: int) -> SymmetricRegion:
        rank = dist.get_rank(group)
        releases: list[Callable[[], None]] = []
        peers: list[Optional[int]] = []
        with torch.cuda.device(self.device):

            def allocate() -> None:
                ptr = cudart.malloc(nbytes)
                releases.append(lambda: cudart.free(ptr))
                peers.append(ptr)

            error = _attempt(allocate)
            try:
                handles = all_gather(group, None if error else cudart.ipc_handle(peers[0]), "CUDA IPC setup")
            except BaseException:  # a peer left: free what this rank allocated
                _release(releases)
                raise

            def map_peers() -> None:
                for r, h in enumerate(handles):
                    if r != rank:
                        p = cudart.ipc_open(h)
                        releases.append(lambda p=p: cudart.ipc_close(p))
                        peers.append(p)

            if all(handles):
                error = _attempt(map_peers)
            _agree_or_unwind(group, error, "CUDA IPC setup", releases)
        own = peers.pop(0)
        peers.insert(rank, own)
        return SymmetricRegion(peers=peers, rank=rank, nbytes=nbytes, _release=releases)


def provider_for(device: torch.device):
    return CudaIpcProvider(device) if device.type == "cuda" else HostShmProvider()
