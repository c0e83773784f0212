"""Pipeline parallelism: the decoder layers cut into P contiguous stages, one per group of ranks.

Stage i builds and loads only its layers [start, end); the first stage also holds the token
embedding, the last the final norm and the LM head, and every other part is a `Missing` placeholder
without weights (so the loader skips the checkpoint's tensors for it). A forward on stage i > 0
starts from the hidden state and residual that stage i - 1 sends (point-to-point, rank to the rank
with the same tensor-parallel rank), and a stage short of the last sends its own on. The last
stage's logits go to rank 0, which samples (`receive_logits`).
"""
import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from nanoserve.layers.attention import AttentionMetadata
from nanoserve.models.qwen3 import Qwen3ForCausalLM, Variant
from nanoserve.utils.distributed import pp_rank_size, tp_rank_size


class Missing(nn.Module):
    """Another stage's part of the model: no weights here, never called."""


def stage_layers(num_layers: int, stage: int, num_stages: int) -> tuple[int, int]:
    """Stage `stage`'s layers, [start, end): an equal share each; when they do not divide, later
    stages take one more (the first stage also embeds, the last computes the logits: the extra
    layers land in between)."""
    return stage * num_layers // num_stages, (stage + 1) * num_layers // num_stages


@dataclass(frozen=True)
class Stage:
    index: int  # this rank's stage
    size: int  # the number of stages
    start: int  # this stage's layers: [start, end)
    end: int
    hidden_size: int  # the activations that pass between stages: [num_tokens, hidden_size] of dtype
    dtype: torch.dtype

    @classmethod
    def of(cls, num_layers: int, hidden_size: int) -> "Stage":
        """This rank's stage of a model being built (in its dtype: the default dtype then)."""
        index, size = pp_rank_size()
        return cls(index, size, *stage_layers(num_layers, index, size), hidden_size,
                   torch.get_default_dtype())

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def part(self, name: str, build: Callable[[], nn.Module]) -> nn.Module:
        """The model's part `name` if this stage holds it, else a Missing placeholder (the model's
        `part` parameter): every layer keeps its slot, so checkpoint names keep their index."""
        if name.startswith("layers."):
            held = self.start <= int(name.split(".")[1]) < self.end
        else:
            held = self.is_first if name == "embed_tokens" else self.is_last  # norm, lm_head
        return build() if held else Missing()

    def peer(self, stage: int) -> int:
        """The global rank of this rank's counterpart in `stage`."""
        tp_rank, tp_size = tp_rank_size()
        return stage * tp_size + tp_rank

    def receive_or_embed(self, embed_tokens: nn.Module,
                         input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The first stage embeds the tokens (no residual yet); the others receive the previous
        stage's hidden state and residual, one [num_tokens, hidden_size] tensor each."""
        if self.is_first:
            return embed_tokens(input_ids), None
        shape = (len(input_ids), self.hidden_size)
        x, residual = (torch.empty(shape, dtype=self.dtype, device=input_ids.device)
                       for _ in range(2))
        dist.recv(x, self.peer(self.index - 1))
        dist.recv(residual, self.peer(self.index - 1))
        return x, residual

    def send_or_norm(self, norm: nn.Module, x: torch.Tensor,
                     residual: torch.Tensor) -> torch.Tensor | None:
        """The last stage's final norm; the others send hidden state and residual on and return
        None."""
        if self.is_last:
            return norm(x, residual)[0]
        dist.send(x.contiguous(), self.peer(self.index + 1))
        dist.send(residual.contiguous(), self.peer(self.index + 1))
        return None

    def logits(self, lm_head: nn.Module, hidden: torch.Tensor | None,
               rows: torch.Tensor) -> torch.Tensor | None:
        """On the last stage the LM head's logits of `rows`; with several stages its tensor-parallel
        rank 0 sends them to rank 0, which samples (`receive_logits`). None on every rank that does
        not sample."""
        if not self.is_last:
            return None
        logits = lm_head(hidden[rows])
        if self.size == 1 or logits is None:
            return logits
        if len(logits):  # (a step of prompt chunks only samples nothing)
            dist.send(logits, 0)
        return None


def receive_logits(num_rows: int, vocab_size: int, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """Rank 0: the step's logits, from the last stage's first rank (the other end of
    Stage.logits)."""
    logits = torch.empty(num_rows, vocab_size, dtype=dtype, device=device)
    if num_rows:
        dist.recv(logits, dist.get_world_size() - tp_rank_size()[1])
    return logits


class PipelineStageModel(Qwen3ForCausalLM):
    """One stage's part of the model (built through the core model's `part` parameter): its forward
    starts from what the previous stage sends, and sends on what the next needs; the last stage's
    logits go to rank 0."""

    def __init__(self, config: PretrainedConfig, variant: Variant):
        stage = Stage.of(config.num_hidden_layers, config.hidden_size)
        if stage.size > 1:
            # a tied head is a copy of the embedding on the last stage (utils/loader.py)
            config = copy.copy(config)
            config.tie_word_embeddings = False
        super().__init__(config, variant, part=stage.part)
        self.stage = stage

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        model, stage = self.model, self.stage
        # from the previous stage, if any
        x, residual = stage.receive_or_embed(model.embed_tokens, input_ids)
        for layer in model.layers[stage.start : stage.end]:
            x, residual = layer(positions, x, residual, meta)
        return stage.send_or_norm(model.norm, x, residual)  # None on a stage short of the last

    def compute_logits(self, hidden: torch.Tensor | None,
                       rows: torch.Tensor) -> torch.Tensor | None:
        return self.stage.logits(self.lm_head, hidden, rows)
