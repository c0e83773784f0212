"""LoRA's Triton kernel (nanoserve/lora/triton_lora.py) equals LoRALinear's PyTorch path on every kind of layer
an adapter targets (qkv_proj's three parts, o_proj, gate_up_proj, down_proj): slots of different ranks, one of
them not targeting every part, rows of three adapters and of the base model shuffled together. On CPU through
Triton's interpreter (conftest.py sets TRITON_INTERPRET=1), natively where CUDA is available."""
import pytest
import torch

from conftest import CONFIGS
from nanoserve.lora.adapter import target_shapes
from nanoserve.lora.layers import LoRASlots
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
def test_triton_kernel_equals_the_pytorch_path(dtype, rows):
    """Both of the kernel's ways, rows grouped by slot and a program per row (decode), on either set of rows."""
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
        assert not torch.allclose(expected[~base_rows], base[~base_rows])  # the adapters change their rows
        for got in kernels:
            torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
            assert torch.equal(got[base_rows], base[base_rows])  # and the kernel leaves the base rows be
