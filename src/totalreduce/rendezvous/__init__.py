"""Who is who: rank and size from the launcher's environment, and an authenticated
key-value store through which ranks swap their addresses."""

from .env import LaunchInfo, detect_launch, mpi_launched
from .kvstore import KVClient, KVServer

__all__ = ["KVClient", "KVServer", "LaunchInfo", "detect_launch", "mpi_launched"]
