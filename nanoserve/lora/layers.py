"""Batched LoRA for the rows of one step (the "punica" idea, in PyTorch): every linear layer an adapter may
target holds max_loras stacked A and B slots; a step's rows each use one slot or none, and two matmuls per
layer serve them all, whatever mix of adapters they use. No Python loop over requests."""
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LoRARows:
    """The step's rows, set before each forward (LoRAManager.before_forward), read by every LoRALinear.
    mask [T, max_loras]: 1.0 where row t uses slot s; scaling [T, 1]: its adapter's (0 for base rows).
    mask None: no row uses an adapter, and the layers run the base model alone."""

    mask: torch.Tensor | None = None
    scaling: torch.Tensor | None = None


class LoRALinear(nn.Module):
    """A linear layer of the base model (fused ones too: qkv_proj's parts are q, k, v) plus its LoRA slots.
    A [in, parts * slots * r] shrinks every row to every slot's rank-r space in one matmul; the mask keeps each
    row's own slot; each part's B [slots * r, out] expands it (rows of other slots add zeros)."""

    def __init__(self, base: nn.Linear, output_sizes: list[int], max_loras: int, max_rank: int, rows: LoRARows):
        super().__init__()
        self.base, self.output_sizes, self.rows = base, output_sizes, rows
        self.max_loras, self.max_rank = max_loras, max_rank
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.lora_a = torch.zeros(base.in_features, len(output_sizes) * max_loras * max_rank, **like)
        self.lora_b = [torch.zeros(max_loras * max_rank, size, **like) for size in output_sizes]

    def set_slot(self, slot: int, part: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put an adapter's A [r, in] and B [out, r] for one part into a slot (None: it does not target it)."""
        slot_a = self.lora_a.view(self.base.in_features, len(self.output_sizes), self.max_loras, self.max_rank)
        slot_a[:, part, slot].zero_()
        slot_b = self.lora_b[part].view(self.max_loras, self.max_rank, -1)[slot]
        slot_b.zero_()
        if a is not None:
            slot_a[:, part, slot, : a.shape[0]] = a.T
            slot_b[: b.shape[1]] = b.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        mask = self.rows.mask
        if mask is None:  # no adapter in this step: the base model, nothing more
            return y
        t, num_parts = x.shape[0], len(self.output_sizes)
        h = (x @ self.lora_a).view(t, num_parts, self.max_loras, self.max_rank) * mask[:, None, :, None]
        delta = torch.cat([h[:, p].reshape(t, -1) @ self.lora_b[p] for p in range(num_parts)], dim=1)
        return y + delta * self.rows.scaling  # PEFT's order: base + B(A(x)) * scaling
