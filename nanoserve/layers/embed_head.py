"""The token embedding and the LM head, both split across ranks by vocabulary (rank r owns a block of rows)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanoserve.layers.linear import linear
from nanoserve.utils.distributed import tp_group, tp_rank_size


class VocabParallelEmbedding(nn.Embedding):
    """Each rank looks up the ids it owns (zeros for the others'); an all-reduce sums them into the embeddings.

    A vocabulary that does not split evenly (32,001 tokens on 2 ranks) is padded, as vLLM does: every rank
    gets ceil(V / N) rows, and the last rank's rows past V are zeros that no token id reaches."""

    def __init__(self, vocab_size: int, hidden_size: int):
        self.tp_rank, self.tp_size = tp_rank_size()
        super().__init__(-(-vocab_size // self.tp_size), hidden_size)
        self.vocab_size, self.vocab_start = vocab_size, self.tp_rank * self.num_embeddings
        self.num_real_rows = max(0, min(self.num_embeddings, vocab_size - self.vocab_start))  # the rest: padding

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        param.data[self.num_real_rows :].zero_()
        if self.num_real_rows:
            param.data[: self.num_real_rows].copy_(loaded[self.vocab_start : self.vocab_start + self.num_real_rows])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(input_ids)
        ids = input_ids - self.vocab_start
        owned = (ids >= 0) & (ids < self.num_embeddings)
        x = F.embedding(ids * owned, self.weight) * owned.unsqueeze(1)
        dist.all_reduce(x, group=tp_group())
        return x


class ParallelLMHead(VocabParallelEmbedding):
    """logits = h E^T: each rank computes its own tokens' logits; rank 0, which samples, gathers them all (the
    others get None) and drops the padding's columns, so no padding id is sampled or scored. Split like the
    embedding, so tied weights stay one tensor (on CPU the head gets a copy reordered for oneDNN: onednn.py)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = linear(hidden_states, self.weight)
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, parts, group=tp_group(), group_dst=0)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size] if parts else None
