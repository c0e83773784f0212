"""Batched LoRA for the rows of one step (the "punica" idea, in PyTorch): every linear layer an
adapter may target holds max_loras stacked A and B slots; a step's rows each use one slot or none,
and two matmuls per layer serve them all, whatever mix of adapters they use. No Python loop over
requests. On CUDA a Triton kernel multiplies each row by its own slot's weights alone
(triton_lora.py).

Every rank holds the same slots (tensor parallelism): rank 0's LoRAManager decides what each slot
holds and which slot each row uses, and the LoRAExecutor runs that on every rank's LoRASlots
(lora/engine.py)."""
import importlib.util
import itertools

import torch
from torch import nn

from nanoserve.engine.cuda_graph import CUDAGraphs
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.layers.linear import RowParallelLinear, linear
from nanoserve.lora.adapter import TARGETS


class LoRARows:
    """The step's rows, in static device buffers that every LoRALinear (and its Triton kernels)
    reads: set() copies a step into them and makes no new tensor, so a CUDA graph captured once
    replays whatever a step copied in.

    slots [max_rows]: each row's slot, -1 for the base model and past the step's rows (a graph's
    padding);
    slot_scaling [max_loras]: each slot's adapter's scaling, written when a slot loads. The PyTorch
    path reads weights [max_rows, max_loras] (a row's scaling in its slot's column); the grouped
    kernel reads order, starts and counts (the rows sorted by slot, each slot's first place among
    them and its count); the decode kernel reads slots alone."""

    def __init__(self, max_rows: int, max_loras: int, device: torch.device, dtype: torch.dtype):
        self.slots = torch.full((max_rows,), -1, dtype=torch.int64, device=device)
        self.slot_scaling = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.weights = torch.zeros(max_rows, max_loras, dtype=dtype, device=device)
        self.order = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.starts = torch.zeros(max_loras, dtype=torch.int64, device=device)
        self.counts = torch.zeros(max_loras, dtype=torch.int64, device=device)
        self.slot_ids = torch.arange(max_loras, device=device)
        self.num_rows = 0  # rows set by the last step: those past the next step's are reset to -1
        self.weight_rows = 0  # rows of weights the PyTorch path last wrote (past them: zeros)
        # whether the layers add LoRA at all (False: a step of base rows runs the base model)
        self.active = False
        # "torch", or the Triton kernel's: "grouped", or "decode" (one row a sequence)
        self.path = "torch"

    def set(self, row_slots: torch.Tensor | None, path: str) -> None:
        """The next forward's rows: each one's slot (-1: the base model), a host tensor; None: no
        row uses an adapter. Copies and device ops only: nothing waits for the device
        (tests/test_lora_triton.py counts)."""
        n = 0 if row_slots is None else row_slots.shape[0]
        if n > self.slots.shape[0]:
            raise ValueError(f"a step of {n} rows exceeds LoRA's {self.slots.shape[0]} "
                             "(max_num_batched_tokens)")
        if n:
            if self.slots.is_cuda:  # pinned: the copy is queued on the stream, and the host goes on
                row_slots = row_slots.pin_memory()
            self.slots[:n].copy_(row_slots, non_blocking=True)
        end = max(n, self.num_rows)
        self.slots[n:end].fill_(-1)
        self.num_rows, self.active, self.path = n, n > 0, path
        if path == "torch":
            end = max(n, self.weight_rows)
            torch.mul(self.slots[:end, None] == self.slot_ids, self.slot_scaling,
                      out=self.weights[:end])
            self.weight_rows = n
        elif n:
            # the kernel's: grouped for any step, also a decode (a graph of more than DECODE_ROWS
            # rows)
            slots = self.slots[:n]
            self.order[:n] = torch.argsort(slots, stable=True)  # base rows (-1) first
            torch.sum(slots == self.slot_ids[:, None], 1, out=self.counts)
            torch.sub(torch.cumsum(self.counts, 0), self.counts, out=self.starts)
            self.starts += (slots < 0).sum()
        else:  # no adapter row: every group empty (a graph captured grouped replays this step too)
            self.counts.zero_()


class LoRALinear(nn.Module):
    """A linear layer of the base model (fused ones too: qkv_proj's parts are q, k, v) plus its LoRA
    slots. A [in, slots * parts * r] shrinks every row to every slot's rank-r space, all parts at
    once; the row's weights keep its own slot, scaled; B [slots * r, out] (a slot's r rows, its
    parts' columns side by side) expands each part into its columns of the output (rows of other
    slots add zeros).

    A is stored as extra rows under the base weight (stacked_weight: [out + slots * parts * r, in],
    the base layer's weight a view of its first rows): on CUDA one matmul reads x once for the base
    output and every slot's h, and the Triton kernel's expand is LoRA's only launch
    (triton_lora.py). Its price: every slot's A is read and multiplied, max_loras * parts *
    max_rank more columns. (A weight reordered for oneDNN, on CPU, keeps A apart: only the PyTorch
    path runs there.)

    With tensor parallelism the slots are cut as the base weight is (vLLM's and punica's split): a
    column-parallel layer (qkv_proj, gate_up_proj) holds A whole and its rank's rows of each B; a
    row-parallel one (o_proj, down_proj) holds its rank's columns of A and B whole, and adds its
    partial product to the base model's before the all-reduce, which sums both."""

    def __init__(self, base: nn.Linear, max_loras: int, max_rank: int, rows: LoRARows):
        super().__init__()
        self.base, self.rows = base, rows
        self.row_parallel = isinstance(base, RowParallelLinear)
        self.output_sizes = getattr(base, "output_sizes", [base.out_features])
        self.max_loras, self.max_rank = max_loras, max_rank
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        num_parts, offsets = len(self.output_sizes), [0, *itertools.accumulate(self.output_sizes)]
        a_rows = torch.zeros(max_loras * num_parts * max_rank, base.in_features, **like)
        self.stacked_weight = self.stacked_bias = None
        if not base.weight.is_mkldnn:
            self.stacked_weight = torch.cat([base.weight.detach(), a_rows])
            a_rows = self.stacked_weight[offsets[-1]:]
            base.weight = nn.Parameter(self.stacked_weight[: offsets[-1]], requires_grad=False)
            if base.bias is not None:  # (A's columns of the output get none)
                zeros = a_rows.new_zeros(a_rows.shape[0])
                self.stacked_bias = torch.cat([base.bias.detach(), zeros])
                base.bias = nn.Parameter(self.stacked_bias[: offsets[-1]], requires_grad=False)
        self.lora_a = a_rows.T
        self.lora_b = torch.zeros(max_loras * max_rank, offsets[-1], **like)
        self.part_offsets = offsets  # each part's first output column, and the end
        self.part_cols = torch.tensor(offsets, dtype=torch.int32, device=like["device"])  # (kernel)

    def set_slot(self, slot: int, part: int, a: torch.Tensor | None,
                 b: torch.Tensor | None) -> None:
        """Put an adapter's A [r, in] and B [out, r] for one part, whole as PEFT saved them, into a
        slot: this rank keeps its share (None: the adapter does not target the part)."""
        r, start, end = self.max_rank, self.part_offsets[part], self.part_offsets[part + 1]
        # [in, r]
        slot_a = self.lora_a.view(self.base.in_features, self.max_loras, -1, r)[:, slot, part]
        slot_b = self.lora_b[slot * r : (slot + 1) * r, start:end]  # [r, out]
        slot_a.zero_()
        slot_b.zero_()
        if a is None:
            return
        if self.row_parallel:
            a = a[:, self.base.rank_columns()]
        else:  # a MergedColumnParallelLinear
            b = b[self.base.rank_rows(part, b.shape[0])]
        slot_a[:, : a.shape[0]] = a.T.to(slot_a.device)
        slot_b[: b.shape[1]] = b.T.to(slot_b.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.rows
        if not rows.active:  # no adapter in this step: the base model, nothing more
            return self.base(x)
        if rows.path != "torch":  # CUDA's: base output and every slot's h in one matmul, then the
            from nanoserve.lora.triton_lora import add_lora  # expand (each row's own slot) in place

            bias = None if self.row_parallel and self.base.tp_rank else self.stacked_bias
            y = add_lora(linear(x, self.stacked_weight, bias), self, rows)  # a view: rows strided
            if self.row_parallel and self.base.tp_size > 1:
                y = y.contiguous()  # (an all-reduce takes contiguous tensors)
        else:
            y = self.base.partial(x) if self.row_parallel else self.base(x)
            t, r = x.shape[0], self.max_rank
            # The scaling multiplies a row's r values here, not its outputs after B (PEFT's order):
            # fewer products.
            h = (x @ self.lora_a).view(t, self.max_loras, -1, r)
            h.mul_(rows.weights[:t, :, None, None])
            for p, (start, end) in enumerate(itertools.pairwise(self.part_offsets)):
                # each part's B expands into its columns
                y[:, start:end].addmm_(h[:, :, p].reshape(t, -1), self.lora_b[:, start:end])
        return self.base.all_reduce(y) if self.row_parallel else y


class LoRASlots:
    """One rank's LoRA: a LoRALinear in place of each linear layer a target lives in, sharing the
    step's rows.
    max_rows: the most rows a forward has (max_num_batched_tokens, and a CUDA graph's largest
    batch)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype, max_rows: int):
        self.max_loras, self.device, self.dtype = max_loras, device, dtype
        # the Triton path
        self.grouped = device.type == "cuda" and importlib.util.find_spec("triton") is not None
        self.rows = LoRARows(max_rows, max_loras, device, dtype)
        # (layer, target) -> its LoRALinear, and the target's part of it (q_proj is part 0 of
        # qkv_proj)
        self.layers: dict[tuple[int, str], tuple[LoRALinear, int]] = {}
        fused = {target: model.packed_modules_mapping.get(target, (target, 0))
                 for target in TARGETS}
        for i, decoder_layer in enumerate(model.model.layers):
            if not hasattr(decoder_layer, "mlp"):
                # another pipeline stage's layer (a placeholder): its slots are there
                continue
            for block in (decoder_layer.self_attn, decoder_layer.mlp):
                for name, base in list(block.named_children()):
                    targets = [t for t, (module, _) in fused.items() if module == name]
                    if targets:
                        wrapped = LoRALinear(base, max_loras, max_rank, self.rows)
                        setattr(block, name, wrapped)
                        self.layers.update({(i, t): (wrapped, fused[t][1]) for t in targets})

    def load(self, slot: int, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
             scaling: float) -> None:
        """Put an adapter (LoRAAdapter.weights: (layer, target) -> A, B; its scaling) into a slot;
        what it does not target, zeros."""
        for (layer, target), (module, part) in self.layers.items():
            module.set_slot(slot, part, *weights.get((layer, target), (None, None)))
        self.rows.slot_scaling[slot] = scaling

    def set_rows(self, row_slots: torch.Tensor | None, decode: bool = False) -> None:
        """The next forward's rows: each one's slot (-1: the base model), None if no row uses an
        adapter; decode: one row per sequence (the Triton path's per-row kernel instead of rows
        grouped by slot)."""
        self.rows.set(row_slots, "torch" if not self.grouped else "decode" if decode else "grouped")

    @torch.inference_mode()
    def capture_graphs(self, runner: ModelRunner) -> None:
        """Capture the runner's CUDA graphs again, now with LoRA's decode kernels in every one,
        reading the row buffers: a replay runs whatever adapters the step copied in (rows of none:
        every program returns at once)."""
        runner.cuda_graphs = None  # (its memory back first)
        self.rows.set(None, "decode" if self.grouped else "torch")
        self.rows.active = True
        try:
            runner.cuda_graphs = CUDAGraphs(runner.model, runner.config, runner.scratch_slot)
        finally:
            self.rows.active = False


def add_lora_slots(runner: ModelRunner, max_loras: int, max_rank: int) -> LoRASlots:
    """A rank's LoRASlots in its runner's model (LoRAModelRunner, on every rank); its CUDA
    graphs, captured before the layers were wrapped, are captured again."""
    config = runner.config
    slots = LoRASlots(runner.model, max_loras, max_rank, runner.device, config.torch_dtype,
                      max(config.max_num_batched_tokens, config.max_num_seqs))
    if runner.cuda_graphs is not None:
        slots.capture_graphs(runner)
    return slots
