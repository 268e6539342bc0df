"""One worker process per GPU for the multi-GPU benchmarks: the launcher side and the flags the
workers get. Import it before torch: it keeps NVLink multicast off in every worker."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

# NVLink multicast stays off on shared multi-GPU hosts (it can take the host's GPUs down); the
# workers inherit these.
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags only the launcher sets: the worker's rank, the rendezvous port, rank 0's rows file."""
    parser.add_argument("--worker-rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rows-out", default="", help=argparse.SUPPRESS)


def run_workers(script: str, world: int) -> list:
    """Run ``world`` copies of ``script`` with this process's arguments plus ``--world``, a
    rendezvous ``--port``, ``--rows-out`` and ``--worker-rank r``; returns what rank 0 wrote
    there (JSON). If one worker fails the others are killed (they would wait for it forever)
    and this process exits with their codes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rows_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"{Path(script).stem}-{os.getpid()}.json"
    command = [sys.executable, script, *sys.argv[1:], "--world", str(world), "--port", str(port),
               "--rows-out", str(rows_path)]
    procs = [subprocess.Popen(command + ["--worker-rank", str(r)]) for r in range(world)]
    while any(p.poll() is None for p in procs):
        if any(p.poll() for p in procs):
            for p in procs:
                p.kill()
        time.sleep(0.2)
    codes = [p.returncode for p in procs]
    if any(codes):
        sys.exit(f"a worker failed: exit codes {codes}")
    rows = json.loads(rows_path.read_text())
    rows_path.unlink()
    return rows
