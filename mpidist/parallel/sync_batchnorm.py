"""Batch normalization over the global batch: statistics from every rank's samples, as
torch.nn.SyncBatchNorm (DDP) and hvd.SyncBatchNorm (Horovod) compute them.

Forward, in training: each rank takes the per-channel count, mean and biased variance of its
own samples; one allgather hands every rank all of them, and each rank combines them in float64
in rank order (the parallel form of the variance: sum of n_r * (var_r + (mean_r - mean)^2)), so
every rank normalizes with the same bits, and updates its running statistics with the global
mean and unbiased variance exactly as BatchNorm does on one process. Ranks may hold different
numbers of samples, none included.

Backward: the input's gradient needs the global per-channel sums of dy and dy * x_hat (one
all-reduce of both). The weight and bias gradients are this rank's own sums, as in PyTorch: the
data-parallel wrapper averages them over ranks with the other gradients.

In eval mode, or on one rank, it is torch's BatchNorm with no communication.
"""
from __future__ import annotations

import torch

from ..comm import init
from ..errors import MismatchError


def _statistics_dtype(x: torch.Tensor) -> torch.dtype:
    """Half-precision inputs are normalized in float32, as torch's CPU BatchNorm does."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _per_channel(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Shape a (C,) tensor to broadcast over x's channel dimension (dimension 1)."""
    return t.reshape([1, -1] + [1] * (x.dim() - 2))


class _SyncBatchNormFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, comm):
        channels = x.shape[1]
        reduce_dims = [0] + list(range(2, x.dim()))
        count = x.numel() // channels if channels else 0
        compute = _statistics_dtype(x)
        xc = x.to(compute)
        local = torch.zeros(1, 1 + 2 * channels, dtype=torch.float64)
        local[0, 0] = count
        if count:
            local[0, 1:1 + channels] = xc.mean(reduce_dims).double().cpu()
            local[0, 1 + channels:] = xc.var(reduce_dims, unbiased=False).double().cpu()
        try:
            gathered = comm.allgather(local)  # (ranks, 1 + 2C), in rank order
        except MismatchError as error:
            raise MismatchError(
                f"SyncBatchNorm({channels}): the ranks normalize different numbers of channels (each sends "
                f"1 + 2 x channels statistics; {error})") from None
        counts = gathered[:, :1]
        total = float(counts.sum())
        if total <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training over all ranks, got "
                             f"{int(total)} (input size {list(x.shape)} on this rank)")
        means, variances = gathered[:, 1:1 + channels], gathered[:, 1 + channels:]
        mean = (counts * means).sum(0) / total
        variance = (counts * (variances + (means - mean) ** 2)).sum(0) / total
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean), alpha=momentum)
                unbiased = variance * (total / (total - 1))
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var), alpha=momentum)
        mean = mean.to(device=x.device, dtype=compute)
        invstd = torch.rsqrt(variance + eps).to(device=x.device, dtype=compute)
        x_hat = (xc - _per_channel(mean, x)) * _per_channel(invstd, x)
        y = x_hat
        if weight is not None:
            y = y * _per_channel(weight.to(compute), x) + _per_channel(bias.to(compute), x)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total = total
        ctx.comm = comm
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        channels = x.shape[1]
        reduce_dims = [0] + list(range(2, x.dim()))
        compute = _statistics_dtype(x)
        dyc = dy.to(compute)
        x_hat = (x.to(compute) - _per_channel(mean, x)) * _per_channel(invstd, x)
        sum_dy = dyc.sum(reduce_dims)
        sum_dy_x_hat = (dyc * x_hat).sum(reduce_dims)
        grad_x = grad_weight = grad_bias = None
        if weight is not None:
            grad_weight = sum_dy_x_hat.to(weight.dtype) if ctx.needs_input_grad[1] else None
            grad_bias = sum_dy.to(weight.dtype) if ctx.needs_input_grad[2] else None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_x_hat]).double().cpu()
            ctx.comm.allreduce(sums, op="sum")
            sums = (sums / ctx.total).to(device=x.device, dtype=compute)
            mean_dy, mean_dy_x_hat = sums[:channels], sums[channels:]
            scale = invstd if weight is None else invstd * weight.to(compute)
            grad_x = _per_channel(scale, x) * (dyc - _per_channel(mean_dy, x) - x_hat * _per_channel(mean_dy_x_hat, x))
            grad_x = grad_x.to(x.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """BatchNorm whose training statistics cover every rank's samples (torch.nn.SyncBatchNorm's
    arguments, plus `comm`: the communicator, the world by default). Any input of at least two
    dimensions, channels in dimension 1 (as BatchNorm1d/2d/3d). Every rank must run each forward
    and backward pass in training mode, as with torch's."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 comm=None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.comm = comm

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) got an input with {input.shape[1]} channels "
                             f"(input size {list(input.shape)}; channels are dimension 1)")

    def forward(self, input):
        self._check_input_dim(input)
        comm = self.comm if self.comm is not None else init()
        if not self.training or comm.size == 1:
            return super().forward(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average, as BatchNorm
                momentum = 1.0 / float(self.num_batches_tracked)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, self.running_mean, self.running_var,
                                            self.eps, momentum, comm)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, comm=None) -> torch.nn.Module:
        """Replace every BatchNorm*d in `module` by a SyncBatchNorm with the same parameters and
        running statistics (torch.nn.SyncBatchNorm.convert_sync_batchnorm). Returns the module,
        or its replacement when `module` itself is a BatchNorm."""
        converted = module
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(module, cls):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, comm=comm)
            if module.affine:
                converted.weight = module.weight
                converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, comm))
        return converted
