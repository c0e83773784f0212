"""Linear layers split across the ranks of tensor parallelism (Megatron-LM's scheme; sizes are this
rank's). A column-parallel layer cuts W's output rows: each rank computes a slice of y, with no
communication. A row-parallel layer cuts W's input columns: each rank's partial sum of y, from the
column slice, and one all-reduce adds them up (a column layer then a row layer: one all-reduce).
With one rank both are plain nn.Linear. The embedding and the LM head are split by vocabulary. On
CPU the weights are reordered once for oneDNN after loading where the CPU supports it
(layers/onednn.py); `linear` runs either kind."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanoserve.utils.distributed import tp_group, tp_rank_size


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b, for a plain W or one reordered by reorder_for_cpu."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class MergedColumnParallelLinear(nn.Linear):
    """Several projections of one input fused into one matmul (q/k/v, or gate/up), each cut by
    output rows. weight_loader copies this rank's rows of the checkpoint's part `shard`. A part with
    fewer slices than ranks (fewer KV heads than ranks) is replicated: rank r takes slice r * n // N
    of n."""

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
        rows = self.rank_rows(shard, loaded.get_shape()[0])
        param.data[offset : offset + size].copy_(loaded[rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """Cut by input columns: each rank's partial product, summed by one all-reduce; the bias is
    added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias=bias)
        self.tp_rank, self.tp_size = tp_rank_size()

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        """The weight: this rank's columns; the bias: whole."""
        param.data.copy_(loaded[:, self.rank_columns()] if param.dim() == 2 else loaded[:])

    def rank_columns(self) -> slice:
        return slice(self.tp_rank * self.in_features, (self.tp_rank + 1) * self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product of y (the bias is added on rank 0 alone)."""
        return linear(x, self.weight, self.bias if self.tp_rank == 0 else None)

    def all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The ranks' partial products, summed in place (a LoRA layer adds its own to its rank's
        first)."""
        if self.tp_size > 1:
            dist.all_reduce(y, group=tp_group())
        return y


class VocabParallelEmbedding(nn.Embedding):
    """Each rank looks up the ids it owns (zeros for the others'); an all-reduce sums them into the
    embeddings. A vocabulary that does not split evenly (32,001 tokens on 2 ranks) is padded, as
    vLLM does: every rank gets ceil(V / N) rows, and the last rank's rows past V are zeros that no
    token id reaches."""

    def __init__(self, vocab_size: int, hidden_size: int):
        self.tp_rank, self.tp_size = tp_rank_size()
        super().__init__(-(-vocab_size // self.tp_size), hidden_size)
        self.vocab_size, self.vocab_start = vocab_size, self.tp_rank * self.num_embeddings
        # this rank's rows that hold real tokens; the rest: padding
        self.num_real_rows = max(0, min(self.num_embeddings, vocab_size - self.vocab_start))

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        param.data[self.num_real_rows :].zero_()
        if self.num_real_rows:
            rows = slice(self.vocab_start, self.vocab_start + self.num_real_rows)
            param.data[: self.num_real_rows].copy_(loaded[rows])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(input_ids)
        ids = input_ids - self.vocab_start
        owned = (ids >= 0) & (ids < self.num_embeddings)
        x = F.embedding(ids * owned, self.weight) * owned.unsqueeze(1)
        dist.all_reduce(x, group=tp_group())
        return x


class ParallelLMHead(VocabParallelEmbedding):
    """logits = h E^T: each rank computes its own tokens' logits; rank 0, which samples, gathers
    them all (the others get None) and drops the padding's columns, so no padding id is sampled or
    scored. Split like the embedding, so tied weights stay one tensor (on CPU the head gets a copy
    reordered for oneDNN: onednn.py)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = linear(hidden_states, self.weight)
        if self.tp_size == 1:
            return logits
        parts = ([torch.empty_like(logits) for _ in range(self.tp_size)]
                 if self.tp_rank == 0 else None)
        dist.gather(logits, parts, group=tp_group(), group_dst=0)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size] if parts else None
