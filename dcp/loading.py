"""Construction's last step, and what a call needs before capture: compiling and loading the kernel
variants a communicator's calls can use, in every transport it keeps, so that capture never does."""

from typing import Optional

import torch
import torch.distributed as dist

from dcp.checks import LSE_DTYPES
from dcp.config import Config
from dcp.constants import KIND_COMBINE, KIND_GATHER
from dcp.errors import DcpError
from dcp.launch import gather_operands, launch_operands
from dcp.rendezvous import agree


class KernelLoader:
    """The variants loaded so far (``ready``: their keys) in ``transports`` (kept by reference: the
    communicator's transports in use)."""

    def __init__(self, config: Config, transports: dict):
        self.config, self.transports = config, transports
        self.scratch = torch.empty(1, dtype=torch.float32, device=config.device)  # a gather's unused LSE
        self.ready: set = set()

    def _examples(self) -> list:
        """(kind, launch tensors, operands) of every well-aligned variant: calls of one token, for
        each accepted LSE dtype, and the gather's as 16-bit words."""
        c, dev = self.config, self.config.device
        po = torch.empty((1, c.num_heads, c.head_dim), dtype=c.dtype, device=dev)
        y = torch.empty((1, c.heads_per_rank, c.head_dim), dtype=c.dtype, device=dev)
        q16 = torch.empty((1, c.heads_per_rank, c.query_words), dtype=torch.int16, device=dev)
        y16 = torch.empty((1, c.num_heads, c.query_words), dtype=torch.int16, device=dev)
        jobs = []
        for t in LSE_DTYPES:
            lse = torch.empty((1, c.num_heads), dtype=t, device=dev)
            jobs.append((KIND_COMBINE, (po, lse, y), launch_operands(po, lse, y, None)))
        return jobs + [(KIND_GATHER, (q16, self.scratch, y16), gather_operands(q16, self.scratch, y16))]

    def compile_shared(self, group: dist.ProcessGroup) -> None:
        """Collective: compile the constructor's variants once per host, not once per rank.

        Triton keeps what it compiles in an on-disk cache that the ranks of a host share: each rank
        first compiles and loads its share of the (variant, tiling) pairs, and once all ranks
        have, ``warmup()`` finds the others' in the cache. A rank that fails makes every rank raise.
        """
        jobs = [(t, kind, tensors, operands, w) for t in self.transports.values()
                for kind, tensors, operands in self._examples() for k, w in t.tilings if k == kind]
        error = None
        try:
            if self.config.device.type == "cuda":
                torch.cuda.current_stream(self.config.device).synchronize()  # as in load
            for t, kind, tensors, operands, w in jobs[self.config.rank::self.config.world]:
                t.load(kind, operands, *tensors, warps=(w,))
        except Exception as exc:  # reported to every rank by agree()
            error = f"{type(exc).__name__}: {exc}"
        agree(group, error, "compiling the kernels")

    def warmup(self, partial_out: Optional[torch.Tensor], partial_lse: Optional[torch.Tensor],
               out: Optional[torch.Tensor], q_local: Optional[torch.Tensor], q_out: Optional[torch.Tensor]) -> None:
        """``DcpAllToAll.warmup``: the well-aligned variants, or those of example tensors."""
        c = self.config
        if c.device.type == "cpu":
            return  # interpreted: nothing to compile
        if partial_out is not None:
            y = out if out is not None else torch.empty((1, c.heads_per_rank, c.head_dim), dtype=c.dtype,
                                                        device=c.device)
            lse = partial_lse if partial_lse is not None else self.scratch
            self.load(KIND_COMBINE, (partial_out, lse, y), launch_operands(partial_out, lse, y, None))
        if q_local is not None:
            y = q_out if q_out is not None else torch.empty((1, c.num_heads, c.query_dim), dtype=c.query_dtype,
                                                          device=c.device)
            q16, y16 = q_local.view(torch.int16), y.view(torch.int16)
            self.load(KIND_GATHER, (q16, self.scratch, y16), gather_operands(q16, self.scratch, y16))
        if partial_out is None and q_local is None:
            for kind, tensors, operands in self._examples():
                self.load(kind, tensors, operands)

    def load(self, kind: int, tensors: tuple, operands: tuple) -> None:
        """Load one variant in every transport kept, unless it is ready; refused in capture."""
        if operands[0] in self.ready:
            return
        if self.config.device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                what = "partial_out, partial_lse, out" if kind == KIND_COMBINE else "q_local=..., q_out=..."
                raise DcpError(
                    f"the kernel variant for this call ({operands[0][0]}, aligned layout {operands[0][1]}) is not "
                    f"loaded, and the stream is capturing a CUDA graph: call comm.warmup({what}) with tensors of "
                    "this layout before capture")
            stream = torch.cuda.current_stream(self.config.device)
            stream.synchronize()  # loading a module next to a spinning kernel can block
            for transport in self.transports.values():
                transport.load(kind, operands, *tensors)
            stream.synchronize()
        self.ready.add(operands[0])
