"""Batched LoRA for the rows of one step (the "punica" idea, in PyTorch): every linear layer an adapter may
target holds max_loras stacked A and B slots; a step's rows each use one slot or none, and two matmuls per
layer serve them all, whatever mix of adapters they use. No Python loop over requests. On CUDA a Triton kernel
multiplies each row by its own slot's weights alone (triton_lora.py).

Every rank holds the same slots (tensor parallelism): rank 0's LoRAManager decides what each slot holds and which
slot each row uses, and runs that on every rank's LoRASlots (add_lora_slots, lora_slots_call)."""
import importlib.util
from dataclasses import dataclass

import torch
from torch import nn

from nanoserve.engine.model_runner import ModelRunner
from nanoserve.layers.linear import RowParallelLinear
from nanoserve.lora.adapter import TARGETS


@dataclass
class LoRARows:
    """The step's rows, set before each forward (LoRASlots.set_rows), read by every LoRALinear.
    scaling [T, 1]: each row's adapter's (0 for base rows); None: no row uses an adapter, and the layers run the
    base model alone. weights [T, max_loras]: row t's scaling in the column of its slot, 0 elsewhere (the PyTorch
    path); groups: the rows grouped by slot instead, on CUDA (triton_lora.py)."""

    scaling: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class LoRALinear(nn.Module):
    """A linear layer of the base model (fused ones too: qkv_proj's parts are q, k, v) plus its LoRA slots.
    A [in, parts * slots * r] shrinks every row to every slot's rank-r space in one matmul; the row's weights keep
    its own slot, scaled; each part's B [slots * r, out] expands it (rows of other slots add zeros).

    With tensor parallelism the slots are cut as the base weight is (vLLM's and punica's split): a column-parallel
    layer (qkv_proj, gate_up_proj) holds A whole and its rank's rows of each B; a row-parallel one (o_proj,
    down_proj) holds its rank's columns of A and B whole, and adds its partial product to the base model's before
    the all-reduce, which sums both."""

    def __init__(self, base: nn.Linear, max_loras: int, max_rank: int, rows: LoRARows):
        super().__init__()
        self.base, self.rows = base, rows
        self.row_parallel = isinstance(base, RowParallelLinear)
        self.output_sizes = getattr(base, "output_sizes", [base.out_features])
        self.max_loras, self.max_rank = max_loras, max_rank
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.lora_a = torch.zeros(base.in_features, len(self.output_sizes) * max_loras * max_rank, **like)
        self.lora_b = [torch.zeros(max_loras * max_rank, size, **like) for size in self.output_sizes]

    def set_slot(self, slot: int, part: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put an adapter's A [r, in] and B [out, r] for one part, whole as PEFT saved them, into a slot: this
        rank keeps its share (None: the adapter does not target the part)."""
        slot_a = self.lora_a.view(self.base.in_features, len(self.output_sizes), self.max_loras, self.max_rank)
        slot_a[:, part, slot].zero_()
        slot_b = self.lora_b[part].view(self.max_loras, self.max_rank, -1)[slot]
        slot_b.zero_()
        if a is None:
            return
        if self.row_parallel:
            a = a[:, self.base.rank_columns()]
        else:  # a MergedColumnParallelLinear
            b = b[self.base.rank_rows(part, b.shape[0])]
        slot_a[:, part, slot, : a.shape[0]] = a.T.to(slot_a.device)
        slot_b[: b.shape[1]] = b.T.to(slot_b.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.rows
        if rows.scaling is None:  # no adapter in this step: the base model, nothing more
            return self.base(x)
        y = self.base.partial(x) if self.row_parallel else self.base(x)
        if rows.groups is not None:  # on CUDA: each row times its own slot's weights alone (triton_lora.py)
            from nanoserve.lora.triton_lora import add_lora

            add_lora(x.contiguous(), y, self.lora_a, self.lora_b, rows.groups, rows.scaling, self.max_loras,
                     self.max_rank)
        else:
            t, num_parts = x.shape[0], len(self.output_sizes)
            # The scaling multiplies a row's r values here, not its outputs after B (PEFT's order): fewer products.
            h = (x @ self.lora_a).view(t, num_parts, self.max_loras, self.max_rank).mul_(rows.weights[:, None, :, None])
            start = 0
            for p, size in enumerate(self.output_sizes):  # each part's B expands straight into its columns of y
                y[:, start : start + size].addmm_(h[:, p].reshape(t, -1), self.lora_b[p])
                start += size
        return self.base.all_reduce(y) if self.row_parallel else y


class LoRASlots:
    """One rank's LoRA: a LoRALinear in place of each linear layer a target lives in, sharing the step's rows."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype):
        self.max_loras, self.device, self.dtype = max_loras, device, dtype
        self.grouped = device.type == "cuda" and importlib.util.find_spec("triton") is not None  # the Triton path
        self.rows = LoRARows()
        # (layer, target) -> its LoRALinear, and the target's part of it (q_proj is part 0 of qkv_proj)
        self.layers: dict[tuple[int, str], tuple[LoRALinear, int]] = {}
        fused = {target: model.packed_modules_mapping.get(target, (target, 0)) for target in TARGETS}
        for i, decoder_layer in enumerate(model.model.layers):
            if not hasattr(decoder_layer, "mlp"):  # another pipeline stage's layer (a placeholder): its slots are there
                continue
            for block in (decoder_layer.self_attn, decoder_layer.mlp):
                for name, base in list(block.named_children()):
                    targets = [t for t, (module, _) in fused.items() if module == name]
                    if targets:
                        wrapped = LoRALinear(base, max_loras, max_rank, self.rows)
                        setattr(block, name, wrapped)
                        self.layers.update({(i, t): (wrapped, fused[t][1]) for t in targets})

    def load(self, slot: int, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter (LoRAAdapter.weights: (layer, target) -> A, B) into a slot; what it does not target,
        zeros."""
        for (layer, target), (module, part) in self.layers.items():
            module.set_slot(slot, part, *weights.get((layer, target), (None, None)))

    def set_rows(self, row_slots: torch.Tensor | None, slot_scaling: list[float]) -> None:
        """The next forward's rows: each one's slot (-1: the base model), and each slot's scaling. None: no row
        uses an adapter."""
        if row_slots is None:
            self.rows.scaling = self.rows.weights = self.rows.groups = None
            return
        row_slots = row_slots.to(self.device)
        scaling = torch.tensor(slot_scaling + [0.0], device=self.device)  # [-1]: the base rows' 0
        self.rows.scaling = scaling[row_slots, None].to(self.dtype)
        if self.grouped:
            from nanoserve.lora.triton_lora import group_rows  # triton: imported only on CUDA

            self.rows.weights, self.rows.groups = None, group_rows(row_slots, self.max_loras)
        else:
            one_hot = torch.nn.functional.one_hot(row_slots + 1, self.max_loras + 1)[:, 1:]
            self.rows.weights, self.rows.groups = one_hot.to(self.dtype) * self.rows.scaling, None


def add_lora_slots(runner: ModelRunner, max_loras: int, max_rank: int) -> None:
    """Run on every rank (ModelRunner.apply): wrap its model's layers; their LoRASlots hang on the model."""
    runner.model.lora_slots = LoRASlots(runner.model, max_loras, max_rank, runner.device, runner.config.torch_dtype)


def lora_slots_call(runner: ModelRunner, method: str, *args) -> None:
    """Run on every rank (ModelRunner.apply): its LoRASlots' method(*args), as rank 0's LoRAManager decided."""
    getattr(runner.model.lora_slots, method)(*args)
