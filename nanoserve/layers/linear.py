import torch
from torch import nn


class MergedLinear(nn.Linear):
    """Several projections of one input fused into one matmul (q/k/v, or gate/up).

    Checkpoints store the parts separately; load_shard copies part i into its rows.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        super().__init__(input_size, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        offset = sum(self.output_sizes[:shard])
        param.data[offset : offset + self.output_sizes[shard]].copy_(loaded)
