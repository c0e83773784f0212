"""LoRA's Triton kernel (nanoserve/lora/triton_lora.py) equals LoRALinear's PyTorch path on every kind of layer
an adapter targets (qkv_proj's three parts, o_proj, gate_up_proj, down_proj): slots of different ranks, one of
them not targeting every part, rows of three adapters and of the base model shuffled together. On CPU through
Triton's interpreter (conftest.py sets TRITON_INTERPRET=1), natively where CUDA is available."""
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import CONFIGS
from nanoserve.lora.adapter import target_shapes
from nanoserve.lora.layers import LoRALinear, LoRASlots
from nanoserve.models.qwen3 import Qwen3ForCausalLM

pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RANKS, SCALING = (8, 4, 2), [2.0, 0.5, 1.5]  # each slot's adapter
# float32: the same products summed in another order; bfloat16 (on a GPU only, as tests/test_triton_elementwise.py
# says why): also rounded once where PyTorch rounds twice.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32] + [torch.bfloat16] * torch.cuda.is_available()


# Each row's slot (-1: the base model): fewer rows than a kernel's tile, and a prefill's shuffle in which slot 0's
# 18 rows fill more than one tile.
ROW_SLOTS = {"decode": torch.tensor([2, -1, 0]),
             "prefill": torch.tensor([0] * 18 + [-1] * 5 + [1] * 7 + [2] * 10)[
                 torch.randperm(40, generator=torch.Generator().manual_seed(0))]}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROW_SLOTS)
def test_triton_kernel_equals_the_pytorch_path(dtype, rows, monkeypatch):
    """Both of the kernel's ways, rows grouped by slot and a program per row (decode), on either set of rows,
    each reading h from the base layer's matmul with A stacked under its weight."""
    import nanoserve.lora.triton_lora as triton_lora

    monkeypatch.setattr(triton_lora, "DECODE_ROWS", 64)  # a program per row for the 40 rows too
    gen = torch.Generator().manual_seed(0)
    config = CONFIGS["qwen3"]()
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(DEVICE):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    slots = LoRASlots(model, len(RANKS), max(RANKS), DEVICE, dtype, max_rows=64)
    shapes = target_shapes(config)
    for slot, r in enumerate(RANKS):  # slot 1's adapter leaves v_proj and down_proj alone
        slots.load(slot, {(layer, target): (torch.randn(r, shapes[target][0], generator=gen) / shapes[target][0]**0.5,
                                            torch.randn(shapes[target][1], r, generator=gen) / r**0.5)
                          for layer, target in slots.layers if slot != 1 or target not in ("v_proj", "down_proj")},
                   SCALING[slot])
    row_slots = ROW_SLOTS[rows]
    base_rows = (row_slots < 0).to(DEVICE)
    for module in dict.fromkeys(module for (layer, _), (module, _) in slots.layers.items() if layer == 0):
        x = torch.randn(len(row_slots), module.base.in_features, generator=gen).to(DEVICE, dtype)
        outputs = []
        for grouped, decode in ((False, False), (True, False), (True, True)):
            slots.grouped = grouped
            slots.set_rows(row_slots, decode)
            outputs.append(module(x))
        expected, *kernels = outputs
        base = module.base(x)
        assert module.base.weight.data_ptr() == module.stacked_weight.data_ptr()  # A's rows: under the weight
        assert not torch.allclose(expected[~base_rows], base[~base_rows])  # the adapters change their rows
        for got in kernels:
            torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
            assert torch.equal(got[base_rows], base[base_rows])  # and the kernel leaves the base rows be


# ---- under CUDA graphs: launches per layer, no wait for the device, static buffers --------------------------------
# Ops that read a device value on the host (a sync on CUDA): item/bool/int, data-dependent shapes, Python data
# made into a tensor (torch.tensor(list, device=...)).
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_consecutive", "unique_dim",
            "repeat_interleave", "lift_fresh"}


class Counter(TorchDispatchMode):
    """Counts the ops that launch work (views and allocations launch none) and those that wait for the device,
    outside the Triton kernels, whose own launches count once each (under the interpreter they run torch ops)."""

    def __init__(self):
        super().__init__()
        self.launches, self.syncs, self.in_kernel = 0, [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.in_kernel:
            name = func.overloadpacket.__name__
            self.syncs += [name] * (name in SYNC_OPS)
            self.launches += not (func.is_view or name.startswith("empty"))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counted(monkeypatch):
    """A Counter in which each launch of triton_lora's kernel counts as one, and tolist/numpy count as syncs."""
    import nanoserve.lora.triton_lora as triton_lora

    counter, kernel = Counter(), triton_lora.lora_kernel

    class CountedKernel:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                counter.launches += 1
                counter.in_kernel = True
                try:
                    kernel[grid](*args, **kwargs)
                finally:
                    counter.in_kernel = False
            return run

    monkeypatch.setattr(triton_lora, "lora_kernel", CountedKernel())
    for method in ("tolist", "numpy"):
        real = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method, lambda self, *a, _real=real, _name=method, **k: (
            counter.syncs.append(_name), _real(self, *a, **k))[1])
    return counter


def loaded_slots(max_rows: int = 64) -> tuple[LoRASlots, list[LoRALinear]]:
    """The tiny model with the three adapters in slots; the LoRALinears of its first decoder layer."""
    gen = torch.Generator().manual_seed(0)
    config = CONFIGS["qwen3"]()
    with torch.device(DEVICE):
        model = Qwen3ForCausalLM(config)
    slots = LoRASlots(model, len(RANKS), max(RANKS), DEVICE, torch.float32, max_rows)
    shapes = target_shapes(config)
    for slot, r in enumerate(RANKS):
        slots.load(slot, {(layer, target): (torch.randn(r, shapes[target][0], generator=gen),
                                            torch.randn(shapes[target][1], r, generator=gen))
                          for layer, target in slots.layers}, SCALING[slot])
    slots.grouped = True  # (what LoRASlots picks on CUDA)
    return slots, list(dict.fromkeys(m for (layer, _), (m, _) in slots.layers.items() if layer == 0))


@pytest.mark.parametrize("decode", [False, True], ids=["grouped", "decode"])
def test_4_lora_launches_per_decoder_layer_and_no_wait_for_the_device(counted, decode):
    """A decoder layer's four LoRA layers (qkv_proj, o_proj, gate_up_proj, down_proj) add one expand each to their
    base layers' launches: 4. The shrink is the base matmul's, A stacked under its weight (a shrink and an expand
    per layer were 8, a launch per part 14). Setting the step's rows and running them reads nothing back from the
    device: no sync, so a step can be queued while the last one runs."""
    slots, layers = loaded_slots()
    row_slots = ROW_SLOTS["decode" if decode else "prefill"]
    xs = [torch.randn(len(row_slots), m.base.in_features).to(DEVICE) for m in layers]
    slots.set_rows(None)
    with counted:
        for m, x in zip(layers, xs):
            m(x)
    base_launches = counted.launches
    with counted:
        slots.set_rows(row_slots, decode)
        counted.launches = 0  # (the step's rows are set once, not per layer)
        for m, x in zip(layers, xs):
            m(x)
    assert counted.launches - base_launches == 4
    assert counted.syncs == []


def test_the_step_rows_live_in_static_buffers_a_cuda_graph_replays():
    """set_rows copies into the same tensors every step (a captured graph reads them), and a graph's padding rows,
    past the step's, stay base-model rows, also after a larger step: the graph's batch is the step's padded up."""
    slots, layers = loaded_slots(max_rows=16)
    buffers = {name: getattr(slots.rows, name).data_ptr() for name in ("slots", "slot_scaling", "weights", "order",
                                                                          "starts", "counts")}
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, layers[0].base.in_features, generator=gen).to(DEVICE)
    for grouped, decode in ((False, False), (True, False), (True, True)):
        slots.grouped = False
        slots.set_rows(torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]))  # a larger step first, on the PyTorch path
        slots.grouped = True
        slots.set_rows(torch.tensor([1, 1, 1]))  # a kernel's step between
        slots.grouped = grouped
        slots.set_rows(torch.tensor([2, -1, 0]), decode)  # then 3 rows in a graph of 8
        assert slots.rows.slots.tolist() == [2, -1, 0] + [-1] * 13
        y = layers[0](x)
        torch.testing.assert_close(y[:3], layers[0](x[:3]))  # the step's rows, as without padding
        assert torch.equal(y[3:], layers[0].base(x)[3:])  # the padding: the base model
    slots.grouped = True
    slots.set_rows(torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]))  # adapter rows, grouped
    slots.set_rows(None)  # then a step of base rows, which a graph captured with LoRA on replays:
    slots.rows.active = True  # its kernels run (as captured), with no row to change
    assert torch.equal(layers[0](x), layers[0].base(x))
    with pytest.raises(ValueError, match="a step of 17 rows exceeds LoRA's 16"):
        slots.set_rows(torch.zeros(17, dtype=torch.int64))
    assert buffers == {name: getattr(slots.rows, name).data_ptr() for name in buffers}


def test_cuda_graphs_are_captured_again_with_the_lora_kernels(monkeypatch):
    """add_lora_slots on a runner with CUDA graphs captures them again with the layers wrapped, LoRA on and the
    decode kernel in every graph, the row buffers all base rows; after that a base step runs the base model."""
    import nanoserve.lora.layers as layers_module

    seen = []

    class Graphs:  # CUDAGraphs' stand-in: a CPU has none to capture
        def __init__(self, model, config, scratch_slot):
            qkv = model.model.layers[0].self_attn.qkv_proj  # a forward as captured: the kernel, on base rows alone
            rows = qkv.rows
            x = torch.randn(4, qkv.base.in_features, device=DEVICE)
            seen.append((rows.active, rows.path, rows.slots.max().item(), scratch_slot,
                         torch.equal(qkv(x), qkv.base(x))))

    monkeypatch.setattr(layers_module, "CUDAGraphs", Graphs)
    config = CONFIGS["qwen3"]()
    with torch.device(DEVICE):  # the Triton kernel runs natively where CUDA is, else interpreted
        models = Qwen3ForCausalLM(config), Qwen3ForCausalLM(config)
    runner = SimpleNamespace(model=models[0], device=DEVICE, scratch_slot=7,
                             config=SimpleNamespace(torch_dtype=torch.float32, max_num_batched_tokens=32,
                                                    max_num_seqs=8),
                             cuda_graphs=None)
    layers_module.add_lora_slots(runner, 2, 4)
    assert seen == [] and runner.cuda_graphs is None  # eager: nothing to capture
    runner.model, runner.cuda_graphs = models[1], "the base model's graphs"

    class TritonSlots(LoRASlots):  # the Triton path, as on CUDA
        def __init__(self, *args):
            super().__init__(*args)
            self.grouped = True

    monkeypatch.setattr(layers_module, "LoRASlots", TritonSlots)
    slots = layers_module.add_lora_slots(runner, 2, 4)
    assert seen == [(True, "decode", -1, 7, True)] and isinstance(runner.cuda_graphs, Graphs)
    assert not slots.rows.active
