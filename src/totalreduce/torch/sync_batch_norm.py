"""``SyncBatchNorm``: batch normalization over every rank's batch, on CPU (or any device
the collectives stage), as ``horovod.torch.SyncBatchNorm`` and ``torch.nn.SyncBatchNorm``.

In training, each layer's forward makes one allreduce (Sum) of ``[sum x, sum x^2, count]``
per channel, so ranks with different batch sizes (an empty one included) weigh by their
rows, and normalizes with the global mean and biased variance.  Running statistics take
the unbiased global variance, as torch's BatchNorm does.  Backward makes one allreduce of
``[sum dy, sum dy * xhat]``, which makes the input gradient that of BatchNorm over the
concatenated global batch, for the loss that is the sum of every rank's loss.  The weight
and bias gradients are this rank's share of that (as torch.nn.SyncBatchNorm returns them):
the DistributedOptimizer's average over ranks then gives the gradient of the mean loss,
as for every other parameter.

The statistics are accumulated in float64 and the variance taken as E[x^2] - E[x]^2
there: one fused allreduce needs sums that add across ranks, and float64 keeps that form
from cancelling badly for float32 activations.

In eval mode (with running statistics) it is ``F.batch_norm`` with no communication.
Every rank must run each layer's training forward and backward in the same order (the
ops are named after the layer, and matched by how often each rank called them).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

import totalreduce as _tr

from .collectives import Sum, allreduce

_instances = itertools.count()


class SyncBatchNorm(_BatchNorm):
    """Batch normalization whose training statistics cover every rank's batch.

    Takes ``torch.nn.SyncBatchNorm``'s arguments; ``process_group`` must be None (every
    rank).  Input is ``(N, C, ...)`` with any number of trailing dimensions.

    Raises:
        NotImplementedError: a ``process_group`` other than None.
        ValueError: input with fewer than 2 dimensions or not ``num_features`` channels;
            a training batch of one value per channel over all ranks.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: Any = None, device: Any = None, dtype: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        if process_group is not None:
            raise NotImplementedError("SyncBatchNorm: process_group must be None; the "
                                      "statistics are always synchronized over all ranks")
        self.process_group = None
        # The ops' name: layers are built in the same order on every rank.
        self._op_name = f"SyncBatchNorm{next(_instances)}"

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected at least 2-D input (N, C, ...), got "
                             f"{input.dim()}-D")
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm: expected {self.num_features} channels "
                             f"(dimension 1), got input of shape {tuple(input.shape)}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average, as in torch
                factor = 1.0 / float(self.num_batches_tracked)
        batch_stats = self.training or (self.running_mean is None
                                        and self.running_var is None)
        if not (batch_stats and self.training) or _tr.size() == 1:
            # As torch.nn.SyncBatchNorm: outside training (or alone) nothing is synced.
            return F.batch_norm(
                input,
                self.running_mean if not self.training or self.track_running_stats else None,
                self.running_var if not self.training or self.track_running_stats else None,
                self.weight, self.bias, batch_stats, factor, self.eps)
        return _SyncBatchNormFn.apply(input, self.weight, self.bias, self.running_mean,
                                      self.running_var, self.eps, factor, self._op_name)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module,
                               process_group: Any = None) -> torch.nn.Module:
        """``module`` with every BatchNorm layer replaced by a SyncBatchNorm that holds
        its parameters and running statistics (as torch's classmethod of that name)."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, process_group)
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return out


def _channels_view(t: torch.Tensor, dims: int) -> torch.Tensor:
    """A per-channel vector shaped to broadcast over ``(N, C, ...)`` of ``dims`` dims."""
    return t.view(1, -1, *([1] * (dims - 2)))


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, eps: float, factor: float,
                name: str) -> torch.Tensor:
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        xd = x.detach().double()
        local = torch.cat([xd.sum(dims), (xd * xd).sum(dims),
                           torch.tensor([x.numel() // max(channels, 1)],
                                        dtype=torch.float64)])
        total = allreduce(local, op=Sum, name=f"{name}.forward")
        count = float(total[-1])
        if count <= 1:
            raise ValueError(f"rank {_tr.rank()}: SyncBatchNorm '{name}': expected more "
                             f"than 1 value per channel over all ranks when training, got "
                             f"{count:g}")
        mean = total[:channels] / count
        var = (total[channels:2 * channels] / count - mean * mean).clamp_(min=0.0)
        invstd = (var + eps).rsqrt()
        xhat = (xd - _channels_view(mean, x.dim())) * _channels_view(invstd, x.dim())
        y = xhat
        if weight is not None:
            y = y * _channels_view(weight.detach().double(), x.dim())
        if bias is not None:
            y = y + _channels_view(bias.detach().double(), x.dim())
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
                unbiased = var * (count / (count - 1))
                running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype),
                                                  alpha=factor)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.count = count
        ctx.name = name
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        xhat, invstd, weight = ctx.saved_tensors
        channels, nd = xhat.shape[1], xhat.dim()
        dims = [0, *range(2, nd)]
        gd = grad.double()
        sum_g = gd.sum(dims)
        sum_gx = (gd * xhat).sum(dims)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # Every rank needs the input's gradient (the layers below it have parameters)
            # or none does: the same model on every rank makes this the same decision.
            total = allreduce(torch.cat([sum_g, sum_gx]), op=Sum, name=f"{ctx.name}.backward")
            mean_g = _channels_view(total[:channels] / ctx.count, nd)
            mean_gx = _channels_view(total[channels:] / ctx.count, nd)
            scale = invstd if weight is None else invstd * weight.detach().double()
            grad_x = (_channels_view(scale, nd) * (gd - mean_g - xhat * mean_gx)) \
                .to(grad.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = sum_gx.to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = sum_g.to(grad.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None
