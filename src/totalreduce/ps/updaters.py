"""What a server does with a pushed gradient: an updater, chosen by name (``"sgd"``,
``"adam"``, or one added with :func:`register_updater`) or given as an object.

With a delay bound (``max_delay`` > 0 or None) a server applies each push on arrival, one
at a time; with ``max_delay=0`` it sums an iteration's pushes and applies them once,
when every worker has finished the iteration.  The built-in updaters divide what they are
given by the number of workers: one push is one worker's share of an iteration, and at
``max_delay=0`` an iteration is one step (momentum and Adam included) on the average
gradient, as synchronous data-parallel training takes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np


class Updater(Protocol):
    def __call__(self, name: str, weights: np.ndarray, grad: np.ndarray,
                 state: dict[str, Any]) -> None:
        """Update ``weights`` (a server's share of key ``name``) in place from ``grad``
        (the same share of one push); ``state`` is this share's own, kept between calls."""


class SGD:
    def __init__(self, lr: float, num_workers: int = 1, momentum: float = 0.0) -> None:
        if not lr > 0 or not 0 <= momentum < 1:
            raise ValueError(f"SGD needs lr > 0 and 0 <= momentum < 1, got lr={lr}, "
                             f"momentum={momentum}")
        self.lr, self.momentum, self.scale = lr, momentum, 1.0 / num_workers

    def __call__(self, name: str, weights: np.ndarray, grad: np.ndarray,
                 state: dict[str, Any]) -> None:
        if self.momentum:
            velocity = state.setdefault("velocity", np.zeros_like(weights))
            velocity *= self.momentum
            velocity += grad
            grad = velocity
        weights -= (self.lr * self.scale) * grad


class Adam:
    def __init__(self, lr: float = 1e-3, num_workers: int = 1, betas: tuple[float, float]
                 = (0.9, 0.999), eps: float = 1e-8) -> None:
        if not lr > 0:
            raise ValueError(f"Adam needs lr > 0, got {lr}")
        self.lr, self.betas, self.eps, self.scale = lr, betas, eps, 1.0 / num_workers

    def __call__(self, name: str, weights: np.ndarray, grad: np.ndarray,
                 state: dict[str, Any]) -> None:
        b1, b2 = self.betas
        grad = grad * self.scale
        m = state.setdefault("m", np.zeros_like(weights))
        v = state.setdefault("v", np.zeros_like(weights))
        state["t"] = t = state.get("t", 0) + 1
        m *= b1
        m += (1 - b1) * grad
        v *= b2
        v += (1 - b2) * grad * grad
        step = self.lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        weights -= step * m / (np.sqrt(v) + self.eps)


_REGISTRY: dict[str, Callable[..., Updater]] = {"sgd": SGD, "adam": Adam}


def register_updater(name: str, factory: Callable[..., Updater]) -> None:
    """Make ``ps.start(updater=name, **options)`` build the updater as
    ``factory(num_workers=W, **options)``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"an updater's name must be a non-empty string, got {name!r}")
    _REGISTRY[name] = factory


def make_updater(updater: str | Updater, num_workers: int, options: dict[str, Any]
                 ) -> Updater:
    if isinstance(updater, str):
        factory = _REGISTRY.get(updater)
        if factory is None:
            raise ValueError(f"ps.start: no updater named {updater!r} (registered: "
                             f"{', '.join(sorted(_REGISTRY))}; ps.register_updater adds one)")
        return factory(num_workers=num_workers, **options)
    if options:
        raise TypeError(f"ps.start: options {sorted(options)} are for a named updater; "
                        "this one was given as an object")
    if not callable(updater):
        raise TypeError(f"ps.start: updater must be a name or a callable, got {updater!r}")
    return updater
