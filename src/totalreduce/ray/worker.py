"""The actor behind each rank: it takes the rank's environment from the executor and
runs the user's functions."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

from ..runtime import abandon


class Worker:
    """One rank of a :class:`~totalreduce.ray.RayExecutor`; ``execute(fn)`` hands it to
    ``fn``."""

    def __init__(self) -> None:
        self.env: dict[str, str] = {}

    def where(self) -> tuple[str, str]:
        """The Ray node this actor runs on (its id, for grouping ranks by node) and the
        host's name (for error messages)."""
        import ray

        return ray.get_runtime_context().get_node_id(), socket.gethostname()

    def set_env(self, env: Mapping[str, str]) -> None:
        # Read by totalreduce.init() inside the user's function; the actor's process is
        # its own, so nothing else sees them.
        self.env.update(env)
        os.environ.update(env)

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            # The actor outlives the error, so its links would stay open and the other
            # ranks would wait on it: fail the world now, as an uncaught error would.
            abandon(exc)
            if isinstance(exc, SystemExit):
                # Ray would end the actor and report only that it "died unexpectedly":
                # bring the exit code back as the function's error instead.
                raise RuntimeError(f"the function raised SystemExit: {exc.code}") from None
            raise

    def execute(self, fn: Callable[[Worker], Any]) -> Any:
        return fn(self)
