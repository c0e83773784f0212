"""Linear layers split across the ranks of tensor parallelism (Megatron-LM's scheme; sizes are this rank's).

A column-parallel layer cuts W's output rows: each rank computes a slice of y, with no communication.
A row-parallel layer cuts W's input columns: fed the column-parallel slice, each rank computes a partial sum
of the full y, and one all-reduce adds them up. A column layer followed by a row layer costs one all-reduce.
With one rank (no process group) both are plain nn.Linear.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def tp_rank_size() -> tuple[int, int]:
    """This process's rank and the number of ranks: torch.distributed's, once the engine has started them."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


class MergedColumnParallelLinear(nn.Linear):
    """Several projections of one input fused into one matmul (q/k/v, or gate/up), each cut by output rows.

    The checkpoint stores the parts separately; weight_loader copies this rank's rows of part `shard`. A part
    with fewer slices than ranks (KV heads fewer than ranks) is replicated: rank r takes slice r * n // N of n.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        super().__init__(input_size, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes
        self.tp_rank, self.tp_size = tp_rank_size()

    def weight_loader(self, param: nn.Parameter, loaded, shard: int) -> None:
        size, offset = self.output_sizes[shard], sum(self.output_sizes[:shard])
        num_slices = loaded.get_shape()[0] // size
        start = self.tp_rank * num_slices // self.tp_size * size
        param.data[offset : offset + size].copy_(loaded[start : start + size])


class RowParallelLinear(nn.Linear):
    """Cut by input columns: each rank's partial product, summed by one all-reduce; the bias is added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias=bias)
        self.tp_rank, self.tp_size = tp_rank_size()

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        if param.dim() == 2:  # the weight: this rank's columns (the bias is whole on every rank)
            size = param.shape[1]
            param.data.copy_(loaded[:, self.tp_rank * size : (self.tp_rank + 1) * size])
        else:
            param.data.copy_(loaded[:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y
