"""Parameter averaging (local SGD): ranks step on their own gradients and average their
models every few steps, trading communication for divergence within the period.

In the style of torch's ``PeriodicModelAverager`` and ``PostLocalSGDOptimizer``: the
averager counts optimizer steps and, once ``warmup_steps`` have passed, averages the
parameters every ``period`` steps; the optimizer wrapper allreduces the gradients during
the warm-up (plain synchronous SGD, as torch's post-local-SGD hook does) and afterwards
steps locally and lets the averager average.  With plain SGD and period 1, averaging the
parameters after each step gives the weights that averaging the gradients would.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch

import totalreduce as _tr
from totalreduce import ProcessSet, global_process_set

from .collectives import grouped_allreduce_

_instances = itertools.count()


def _parameters(params: torch.nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(params, torch.nn.Module):
        return list(params.parameters())
    out = list(params)
    if not all(isinstance(p, torch.Tensor) for p in out):
        raise TypeError("PeriodicAverager: expected a module or an iterable of tensors")
    return out


class PeriodicAverager:
    """Average ``params`` (a module's parameters, or tensors) across the ranks of
    ``process_set`` every ``period`` steps, once ``warmup_steps`` steps have passed.

    Call :meth:`average_parameters` once after each optimizer step (the
    :class:`PostLocalSGDOptimizer` does).  Every rank must create its averagers in the
    same order: their ops are matched by name.
    """

    def __init__(self, params: torch.nn.Module | Iterable[torch.Tensor], period: int,
                 warmup_steps: int = 0,
                 process_set: ProcessSet = global_process_set) -> None:
        if not isinstance(period, int) or isinstance(period, bool) or period < 1:
            raise ValueError(f"PeriodicAverager: period must be an int >= 1, got {period!r}")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError("PeriodicAverager: warmup_steps must be an int >= 0, got "
                             f"{warmup_steps!r}")
        self.params = _parameters(params)
        self.period = period
        self.warmup_steps = warmup_steps
        self.process_set = process_set
        self.step = 0
        self._name = f"PeriodicAverager{next(_instances)}"

    def warming_up(self) -> bool:
        """Whether the next step is still in the warm-up (nothing averaged)."""
        return self.step < self.warmup_steps

    def average_parameters(self) -> bool:
        """Count one step; average the parameters if this step is due.  True if it was."""
        due = not self.warming_up() and (self.step - self.warmup_steps) % self.period == 0
        self.step += 1
        if due and self.params:
            with torch.no_grad():
                grouped_allreduce_([p.data for p in self.params], op=_tr.Average,
                                   name=self._name, process_set=self.process_set)
        return due

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


class PostLocalSGDOptimizer(torch.optim.Optimizer):
    """Synchronous SGD during the averager's warm-up (gradients averaged before each
    step), then local steps with the parameters averaged every ``averager.period``
    steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, averager: PeriodicAverager) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("PostLocalSGDOptimizer wraps a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if not isinstance(averager, PeriodicAverager):
            raise TypeError("PostLocalSGDOptimizer needs a PeriodicAverager, got "
                            f"{type(averager).__name__}")
        self._optimizer = optimizer
        self.averager = averager
        super().__init__(optimizer.param_groups, optimizer.defaults)
        # The wrapped optimizer's groups and state: LR schedulers and loaded state must
        # reach the optimizer that steps.
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._grad_name = f"{averager._name}.grads"

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        averager = self.averager
        if averager.warming_up() and averager.params:
            # Every rank must send the same tensors: a parameter without a gradient here
            # (unused in this step) sends zeros.
            grads = []
            for p in averager.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            grouped_allreduce_(grads, op=_tr.Average, name=self._grad_name,
                               process_set=averager.process_set)
        result = self._optimizer.step(closure)
        averager.average_parameters()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return dict(self._optimizer.state_dict(), averager=self.averager.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        averager = state_dict.pop("averager", None)
        if averager is not None:
            self.averager.load_state_dict(averager)
        self._optimizer.load_state_dict(state_dict)
        self.state = self._optimizer.state
        self.param_groups = self._optimizer.param_groups

    def __repr__(self) -> str:
        return f"PostLocalSGDOptimizer({self._optimizer!r}, period={self.averager.period})"

    def __getattr__(self, name: str) -> Any:
        if name == "_optimizer":
            raise AttributeError(name)
        return getattr(self._optimizer, name)
