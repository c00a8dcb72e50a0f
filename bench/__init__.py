"""Microbenchmarks of the DCP all-to-all against NCCL (``python -m bench``)."""
