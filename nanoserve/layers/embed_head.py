"""The token embedding and the LM head, both split across ranks by vocabulary (rank r owns rows r*V/N...)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanoserve.layers.linear import linear, tp_rank_size


class VocabParallelEmbedding(nn.Embedding):
    """Each rank looks up the ids it owns (zeros for the others'); an all-reduce sums them into the embeddings."""

    def __init__(self, vocab_size: int, hidden_size: int):
        self.tp_rank, self.tp_size = tp_rank_size()
        super().__init__(vocab_size // self.tp_size, hidden_size)
        self.vocab_start = self.tp_rank * self.num_embeddings

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        param.data.copy_(loaded[self.vocab_start : self.vocab_start + self.num_embeddings])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(input_ids)
        ids = input_ids - self.vocab_start
        owned = (ids >= 0) & (ids < self.num_embeddings)
        x = F.embedding(ids * owned, self.weight) * owned.unsqueeze(1)
        dist.all_reduce(x)
        return x


class ParallelLMHead(VocabParallelEmbedding):
    """logits = h E^T: each rank computes its own tokens' logits; rank 0, which samples, gathers them all
    (the other ranks get None). Split like the embedding, so tied weights stay one tensor (on CPU the head
    then gets a copy reordered for oneDNN: layers/linear.py)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = linear(hidden_states, self.weight)
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts else None
