"""Linear layers split across the ranks of tensor parallelism (Megatron-LM's scheme; sizes are this rank's).

A column-parallel layer cuts W's output rows: each rank computes a slice of y, with no communication.
A row-parallel layer cuts W's input columns: fed the column-parallel slice, each rank computes a partial sum
of the full y, and one all-reduce adds them up. A column layer followed by a row layer costs one all-reduce.
With one rank (no process group) both are plain nn.Linear.

On CPU the weights are reordered once for oneDNN after loading where the CPU supports it (reorders_for_onednn,
reorder_weights_for_cpu); `linear` runs either kind.
"""
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanoserve.utils.distributed import tp_group, tp_rank_size

logger = logging.getLogger(__name__)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b, for a plain W or one reordered by reorder_for_cpu."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def reorders_for_onednn(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` on weights reordered for oneDNN (else on plain weights), decided from
    the ISA PyTorch dispatches to, torch.backends.cpu.get_cpu_capability(), so that ATEN_CPU_CAPABILITY=avx2 (set
    before Python starts) sends an AVX-512 machine down an AVX2 laptop's path:
    - AVX512 (PyTorch's name for AVX-512 F, BW, VL and DQ): float32 and bfloat16;
    - AVX2: float32 only. oneDNN's bfloat16 reorder needs AVX-512 BW/VL/DQ (or AVX-NE-CONVERT, which the
      capability does not tell), so bfloat16 multiplies plain weights there: correct, about 3x slower than float32;
    - anything else (no AVX2, ARM) and float16 (oneDNN's needs AVX512-FP16): plain weights.
    oneDNN's own bfloat16 check comes last, so that its ISA limit (ONEDNN_MAX_CPU_ISA) can only lower this."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512") or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return capability == "AVX512" and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def reorder_for_cpu(weight: torch.Tensor) -> torch.Tensor:
    """W reordered once into oneDNN's blocked layout, as vLLM's CPU backend and torch.compile's weight freezing
    do, where reorders_for_onednn says the CPU can; else the plain W. A plain float32 matmul goes to MKL, which
    packs W into its own panels on every call; the reordered W is read as it lies by oneDNN's kernels: 1.5-3x
    faster multiplies on the CPU of docs/benchmarks.md (1.4-1.8x with AVX2 alone)."""
    if not reorders_for_onednn(weight.dtype):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def reorder_weights_for_cpu(model: nn.Module) -> None:
    """Every matmul weight of the model, reordered; the LM head gets a copy of its own, so that a tied
    embedding keeps the plain rows it looks up."""
    dtype = next(model.parameters()).dtype
    if dtype == torch.bfloat16 and not reorders_for_onednn(dtype):
        logger.warning("bfloat16 on this CPU (PyTorch's capability: %s) multiplies plain weights, about 3x "
                       "slower than float32: dtype='float32' is faster here", torch.backends.cpu.get_cpu_capability())
    heads = [model.lm_head] if hasattr(model.lm_head, "weight") else []  # (only the last pipeline stage has it)
    for module in [*(m for m in model.modules() if isinstance(m, nn.Linear)), *heads]:
        module.weight = nn.Parameter(reorder_for_cpu(module.weight), requires_grad=False)


class MergedColumnParallelLinear(nn.Linear):
    """Several projections of one input fused into one matmul (q/k/v, or gate/up), each cut by output rows.

    The checkpoint stores the parts separately; weight_loader copies this rank's rows of part `shard`. A part
    with fewer slices than ranks (KV heads fewer than ranks) is replicated: rank r takes slice r * n // N of n.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        super().__init__(input_size, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes
        self.tp_rank, self.tp_size = tp_rank_size()

    def rank_rows(self, shard: int, num_rows: int) -> slice:
        """This rank's rows of part `shard`, whose full weight (every rank's) has num_rows."""
        size = self.output_sizes[shard]
        start = self.tp_rank * (num_rows // size) // self.tp_size * size
        return slice(start, start + size)

    def weight_loader(self, param: nn.Parameter, loaded, shard: int) -> None:
        size, offset = self.output_sizes[shard], sum(self.output_sizes[:shard])
        param.data[offset : offset + size].copy_(loaded[self.rank_rows(shard, loaded.get_shape()[0])])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """Cut by input columns: each rank's partial product, summed by one all-reduce; the bias is added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias=bias)
        self.tp_rank, self.tp_size = tp_rank_size()

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        if param.dim() == 2:  # the weight: this rank's columns (the bias is whole on every rank)
            param.data.copy_(loaded[:, self.rank_columns()])
        else:
            param.data.copy_(loaded[:])

    def rank_columns(self) -> slice:
        """This rank's columns of the full weight."""
        return slice(self.tp_rank * self.in_features, (self.tp_rank + 1) * self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product of y (the bias is added on rank 0 alone)."""
        return linear(x, self.weight, self.bias if self.tp_rank == 0 else None)

    def all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The ranks' partial products, summed in place (a LoRA layer adds its own to its rank's first)."""
        if self.tp_size > 1:
            dist.all_reduce(y, group=tp_group())
        return y
