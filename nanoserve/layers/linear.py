"""Linear layers split across the ranks of tensor parallelism (Megatron-LM's scheme; sizes are this rank's).

A column-parallel layer cuts W's output rows: each rank computes a slice of y, with no communication.
A row-parallel layer cuts W's input columns: fed the column-parallel slice, each rank computes a partial sum
of the full y, and one all-reduce adds them up. A column layer followed by a row layer costs one all-reduce.
With one rank (no process group) both are plain nn.Linear.

On CPU the weights are reordered once for oneDNN after loading (reorder_weights_for_cpu); `linear` runs either kind.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b, for a plain W or one reordered by reorder_for_cpu."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def reorder_for_cpu(weight: torch.Tensor) -> torch.Tensor:
    """W reordered once into oneDNN's blocked layout, as vLLM's CPU backend and torch.compile's weight freezing
    do. A plain float32 matmul goes to MKL, which packs W into its own panels on every call; the reordered W is
    read as it lies by oneDNN's AVX-512 kernels: 1.5-3x faster multiplies on the CPU of docs/benchmarks.md.
    Only on x86 (measured there), in float32 and bfloat16 (oneDNN's float16 needs AVX512-FP16); else the plain W."""
    x86 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    if not (x86 and torch.backends.mkldnn.is_available()) or weight.dtype not in (torch.float32, torch.bfloat16):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def reorder_weights_for_cpu(model: nn.Module) -> None:
    """Every matmul weight of the model, reordered; the LM head gets a copy of its own, so that a tied
    embedding keeps the plain rows it looks up."""
    for module in [*(m for m in model.modules() if isinstance(m, nn.Linear)), model.lm_head]:
        module.weight = nn.Parameter(reorder_for_cpu(module.weight), requires_grad=False)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


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
        y = linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y
