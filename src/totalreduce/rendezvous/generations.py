"""The launcher's restart generation, as its store publishes it.

With ``totalrun --max-restarts``, the launcher counts the workers it has restarted and
publishes the count (``KVServer.set_generation``).  Every rank meets its peers under the
newest generation: after a failure, the survivors wait for the count to pass the one they
met under, and the replacement starts under it.  A rank dying while the others meet
moves the count on again, and so moves them all to the next meeting.
"""

from __future__ import annotations

import time

from .env import LaunchInfo
from .kvstore import KVClient

_POLL = 0.05


class Generations:
    def __init__(self, launch: LaunchInfo, timeout: float) -> None:
        if launch.rendezvous is None:
            raise ValueError("restarts need the launcher's rendezvous store (totalrun)")
        self._key = f"{launch.job_id}/generation"
        self._kv = KVClient(launch.rendezvous, launch.secret, launch.job_id, timeout)

    def current(self) -> int:
        """The newest generation (0 before any restart)."""
        try:
            return int(self._kv.get(self._key, 0.0))
        except TimeoutError:
            return 0

    def after(self, generation: int, deadline: float) -> int:
        """Wait until the generation passes ``generation`` and return the new one.

        Raises:
            TimeoutError: it did not move before ``deadline`` (``time.monotonic()``).
        """
        while True:
            now = self.current()
            if now > generation:
                return now
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no worker was restarted after generation {generation}")
            time.sleep(_POLL)

    def close(self) -> None:
        self._kv.close()
