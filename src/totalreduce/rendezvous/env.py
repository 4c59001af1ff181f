"""Read rank, world size and rendezvous address from whichever launcher started us.

Checked in this order, first match wins:

=============  =====================================================================
launcher       variables read
=============  =====================================================================
Ray            TOTALREDUCE_RAY_RANK, TOTALREDUCE_RAY_SIZE, TOTALREDUCE_RAY_LOCAL_RANK,
               TOTALREDUCE_RAY_LOCAL_SIZE, TOTALREDUCE_RENDEZVOUS, TOTALREDUCE_SECRET
               (set by ``totalreduce.ray.RayExecutor`` in each actor)
totalrun       TOTALREDUCE_RANK, TOTALREDUCE_SIZE, TOTALREDUCE_LOCAL_RANK,
               TOTALREDUCE_LOCAL_SIZE, TOTALREDUCE_RENDEZVOUS, TOTALREDUCE_SECRET
torchrun       RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
Open MPI       OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
MPICH/Hydra    PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
SLURM (srun)   SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
=============  =====================================================================

Under an external launcher the rendezvous store is served by rank 0 at
``TOTALREDUCE_RENDEZVOUS`` (host:port) if set, else at MASTER_ADDR:(MASTER_PORT + 1) — one
above torchrun's own store, which already owns MASTER_PORT.  The job secret must then be
given as ``TOTALREDUCE_SECRET`` on every rank.  Under Ray the executor serves the store
from the driver, as totalrun does, and Ray is checked first: a Ray cluster started inside
a SLURM or MPI allocation hands that launcher's variables on to every actor.  With no
launcher at all the process is a world of one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import secrets
from collections.abc import Mapping

SECRET_HELP = (
    "set TOTALREDUCE_SECRET to the same random string on every rank, for example\n"
    "    export TOTALREDUCE_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')\n"
    "before starting the job (totalrun does this for you)"
)


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    launcher: str
    rank: int
    size: int
    local_rank: int | None
    local_size: int | None
    rendezvous: str | None   # host:port of the key-value store
    serve_rendezvous: bool   # True when this process (rank 0) must host the store
    secret: bytes
    job_id: str


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


_EXTERNAL = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
)


def mpi_launched(environ: Mapping[str, str] | None = None) -> bool:
    """Whether an MPI launcher (Open MPI, MPICH/Hydra, PMIx) started this process."""
    env = os.environ if environ is None else environ
    return any(v in env for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def detect_launch(environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """Work out rank, size and rendezvous from the environment.

    Raises:
        ValueError: a variable is malformed, the rendezvous address or the secret is
            missing under an external launcher (the message says how to set it).
    """
    env = os.environ if environ is None else environ
    rank = _int(env, "TOTALREDUCE_RAY_RANK")
    if rank is not None:
        size = _int(env, "TOTALREDUCE_RAY_SIZE")
        if size is None or not env.get("TOTALREDUCE_RENDEZVOUS"):
            raise ValueError("TOTALREDUCE_RAY_RANK is set but TOTALREDUCE_RAY_SIZE or "
                             "TOTALREDUCE_RENDEZVOUS is not; start workers with "
                             "totalreduce.ray.RayExecutor")
        return _finish(env, "ray", rank, size, _int(env, "TOTALREDUCE_RAY_LOCAL_RANK"),
                       _int(env, "TOTALREDUCE_RAY_LOCAL_SIZE"),
                       env["TOTALREDUCE_RENDEZVOUS"], serve=False)
    if _int(env, "TOTALREDUCE_RANK") is not None:
        rank = _int(env, "TOTALREDUCE_RANK")
        size = _int(env, "TOTALREDUCE_SIZE")
        if size is None or env.get("TOTALREDUCE_RENDEZVOUS") is None:
            raise ValueError("TOTALREDUCE_RANK is set but TOTALREDUCE_SIZE or "
                             "TOTALREDUCE_RENDEZVOUS is not; start workers with totalrun")
        assert rank is not None
        return _finish(env, "totalrun", rank, size, _int(env, "TOTALREDUCE_LOCAL_RANK"),
                       _int(env, "TOTALREDUCE_LOCAL_SIZE"), env["TOTALREDUCE_RENDEZVOUS"],
                       serve=False)
    for launcher, rvar, svar, lrvar, lsvar in _EXTERNAL:
        rank = _int(env, rvar)
        size = _int(env, svar)
        if rank is None or size is None:
            continue
        local_rank = _int(env, lrvar)
        local_size = _int(env, lsvar) if lsvar else None
        address = env.get("TOTALREDUCE_RENDEZVOUS")
        if not address and env.get("MASTER_ADDR") and _int(env, "MASTER_PORT") is not None:
            address = f"{env['MASTER_ADDR']}:{int(env['MASTER_PORT']) + 1}"
        if size > 1 and not address:
            raise ValueError(
                f"started by {launcher} as rank {rank} of {size}, but no rendezvous address: "
                "set TOTALREDUCE_RENDEZVOUS=host:port (rank 0's host and a free port), or "
                "MASTER_ADDR and MASTER_PORT, on every rank")
        return _finish(env, launcher, rank, size, local_rank, local_size, address,
                       serve=rank == 0)
    return LaunchInfo("none", 0, 1, 0, 1, None, False, secrets.token_bytes(32), "single")


def _finish(env: Mapping[str, str], launcher: str, rank: int, size: int,
            local_rank: int | None, local_size: int | None, address: str | None,
            serve: bool) -> LaunchInfo:
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"{launcher}: rank {rank} is not within world size {size}")
    raw = env.get("TOTALREDUCE_SECRET")
    if size > 1 and not raw:
        raise ValueError(f"started by {launcher} as rank {rank} of {size} without a job "
                         f"secret: {SECRET_HELP}")
    secret = (raw or secrets.token_hex(32)).encode()
    job_id = env.get("TOTALREDUCE_JOB_ID") or hashlib.sha256(b"job:" + secret).hexdigest()[:16]
    return LaunchInfo(launcher, rank, size, local_rank, local_size, address, serve, secret,
                      job_id)
