"""Microbenchmarks of the DCP all-to-all against NCCL: ``dcp-a2a-bench`` or ``python -m dcp.bench``
wherever the package is installed, ``python -m bench`` from the repository root."""
