"""What a rank keeps in memory so that a replacement can catch up without anyone
recomputing: its last checkpoint, the result of every collective since, and the results
of the *prelude*: the collectives a program makes before it loads its checkpoint (set-up
such as broadcasting the initial model), which a replacement makes again before it
reaches ``load_checkpoint()``.  Prelude results are kept for the job's life; their ops
carry version -1.

The results are bounded by ``TOTALREDUCE_RECOVERY_LOG_BYTES``.  Past the bound the log
stops taking results and says so once: a failure after that point cannot be recovered
from this rank's memory (checkpoint more often, or raise the bound), and recovery then
fails with that reason rather than replaying from a partial log.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .plan import OpId

PRELUDE = -1  # the version of collectives made before the program loads its checkpoint

logger = logging.getLogger(__name__)


class ResultLog:
    def __init__(self, cap_bytes: int) -> None:
        self._cap = cap_bytes
        self._results: dict[OpId, tuple[str, list[np.ndarray]]] = {}
        self.bytes = 0
        self.overflowed = False  # some result since the last checkpoint was not kept
        self.version = 0
        self.state: dict[str, Any] | None = None  # the checkpoint of ``version``
        self.last_checkpoint: OpId | None = None  # the op that made it

    def __contains__(self, op: OpId) -> bool:
        return op in self._results or op == self.last_checkpoint

    def __len__(self) -> int:
        return len(self._results)

    def add(self, op: OpId, kind: str, arrays: list[np.ndarray]) -> None:
        """Keep copies of ``arrays``, the result of ``op`` (a ``kind`` collective)."""
        if op in self._results:
            return
        size = sum(a.nbytes for a in arrays)
        if self.overflowed and op[0] != PRELUDE:
            return
        if self.bytes + size > self._cap:
            if not self.overflowed:
                logger.warning(
                    "the results of the collectives since checkpoint %d pass "
                    "TOTALREDUCE_RECOVERY_LOG_BYTES=%d: a failure before the next "
                    "checkpoint cannot be recovered (checkpoint more often, or raise it)",
                    self.version, self._cap)
            self.overflowed = True
            return
        self._results[op] = (kind, [np.array(a, copy=True) for a in arrays])
        self.bytes += size

    def lose(self) -> None:
        """Results since the checkpoint can no longer be told apart (a name's call count
        was forgotten): keep none of them until the next checkpoint."""
        self.overflowed = True
        self._drop_since_checkpoint()

    def get(self, op: OpId) -> tuple[str, list[np.ndarray]]:
        return self._results[op]

    def commit(self, op: OpId, state: dict[str, Any] | None) -> None:
        """A checkpoint (made by ``op``) is taken: results before it are not needed, but
        for the prelude's."""
        self.version += 1
        self.state = state
        self.last_checkpoint = op
        self._drop_since_checkpoint()
        self.overflowed = False

    def _drop_since_checkpoint(self) -> None:
        self._results = {k: v for k, v in self._results.items() if k[0] == PRELUDE}
        self.bytes = sum(a.nbytes for _kind, arrays in self._results.values() for a in arrays)
