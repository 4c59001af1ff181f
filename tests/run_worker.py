"""Entry point of one test rank: ``run_worker.py module:function json-arg``."""

import faulthandler
import importlib
import json
import os
import sys


class _Tagged:
    """Prefixes each whole line with ``[rank] `` (mpiexec's own -prepend-rank splits lines
    that arrive in pieces, so the harness could not tell whose they are)."""

    def __init__(self, stream, tag: str) -> None:
        self._stream = stream
        self._tag = tag
        self._partial = ""

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            self._stream.write(f"{self._tag}{line}\n")
        self._stream.flush()
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


_mpi_rank = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or \
    os.environ.get("SLURM_PROCID")
if os.environ.get("WORKER_TAG_LINES") and _mpi_rank is not None:
    sys.stdout = _Tagged(sys.stdout, f"[{_mpi_rank}] ")
    sys.stderr = _Tagged(sys.stderr, f"[{_mpi_rank}] ")

faulthandler.enable()
faulthandler.dump_traceback_later(float(os.environ.get("WORKER_STACK_DUMP_AFTER", "55")),
                                  exit=False)
module, _, func = sys.argv[1].partition(":")
arg = json.loads(sys.argv[2])
getattr(importlib.import_module(module), func)(arg)
faulthandler.cancel_dump_traceback_later()
