"""oneDNN's weight reorder on CPU, decided and done once after loading (layers/linear.py's `linear`
runs either the reordered or the plain weights each step)."""
import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def reorders_for_onednn(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` on weights reordered for oneDNN (else on plain weights),
    decided from the ISA PyTorch dispatches to, torch.backends.cpu.get_cpu_capability(), so that
    ATEN_CPU_CAPABILITY=avx2 (set before Python starts) sends an AVX-512 machine down an AVX2
    laptop's path:
    - AVX512 (PyTorch's name for AVX-512 F, BW, VL and DQ): float32 and bfloat16;
    - AVX2: float32 only. oneDNN's bfloat16 reorder needs AVX-512 BW/VL/DQ (or AVX-NE-CONVERT, which
      the capability does not tell), so bfloat16 multiplies plain weights there: correct, about 3x
      slower than float32;
    - anything else (no AVX2, ARM) and float16 (oneDNN's needs AVX512-FP16): plain weights.
    oneDNN's own bfloat16 check comes last, so that its ISA limit (ONEDNN_MAX_CPU_ISA) can only
    lower this."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512") or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return capability == "AVX512" and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def reorder_for_cpu(weight: torch.Tensor) -> torch.Tensor:
    """W reordered once into oneDNN's blocked layout, as vLLM's CPU backend and torch.compile's
    weight freezing do, where reorders_for_onednn says the CPU can; else the plain W. A plain
    float32 matmul goes to MKL, which packs W into its own panels on every call; the reordered W is
    read as it lies by oneDNN's kernels: 1.5-3x faster multiplies on the CPU of docs/benchmarks.md
    (1.4-1.8x with AVX2 alone)."""
    if not reorders_for_onednn(weight.dtype):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def reorder_weights_for_cpu(model: nn.Module) -> None:
    """Every matmul weight of the model, reordered; the LM head gets a copy of its own, so that a
    tied embedding keeps the plain rows it looks up."""
    dtype = next(model.parameters()).dtype
    if dtype == torch.bfloat16 and not reorders_for_onednn(dtype):
        logger.warning("bfloat16 on this CPU (PyTorch's capability: %s) multiplies plain weights, "
                       "about 3x slower than float32: dtype='float32' is faster here",
                       torch.backends.cpu.get_cpu_capability())
    # (only the last pipeline stage has it)
    heads = [model.lm_head] if hasattr(model.lm_head, "weight") else []
    for module in [*(m for m in model.modules() if isinstance(m, nn.Linear)), *heads]:
        module.weight = nn.Parameter(reorder_for_cpu(module.weight), requires_grad=False)
