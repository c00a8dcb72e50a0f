"""Scratch, for item 37's grid probe only: with DCP_SCRATCH_PROGRAMS=k every DcpAllToAll built in
this process gets a default grid of at most k programs (put this folder first on PYTHONPATH)."""
import os

if os.environ.get("DCP_SCRATCH_PROGRAMS"):
    import dcp.comm

    dcp.comm.DcpAllToAll._default_programs = lambda self, k=int(os.environ["DCP_SCRATCH_PROGRAMS"]): k
