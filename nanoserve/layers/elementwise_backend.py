"""The elementwise chains between the matmuls (RMSNorm with its residual add, SwiGLU's gate, RoPE),
four ways, as Config.elementwise_backend picks (selector.py binds them). Eager PyTorch runs each
chain as 5 to 10 ops that each read and write all the activations: in decode they cost more in
dispatch than in arithmetic (docs/benchmarks.md).

- "torch": the modules' own forwards (layers/layernorm.py, activation.py, rotary_embedding.py), the
  code to read.
- "cpu": csrc/elementwise_cpu.cpp, one C++ loop per chain (as vLLM's CPU build has); the default on
  CPU in float32.
- "triton": layers/triton_elementwise.py, one kernel per chain (Qwen3's q_norm/k_norm read in
  place); CUDA's default.
- "compile": layers/torch_compile.py, torch.compile as vLLM compiles its model.
"""

import torch

from nanoserve.layers.activation import SiluAndMul
from nanoserve.layers.layernorm import RMSNorm
from nanoserve.layers.rotary_embedding import RotaryEmbedding
from nanoserve.utils.cpu_kernel import load_cpu_kernel


def rms_norm_cpu(self: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None):
    out, summed = load_cpu_kernel("elementwise_cpu").rms_norm(x, residual, self.weight, self.eps)
    return out if residual is None else (out, summed)


def silu_and_mul_cpu(self: SiluAndMul, x: torch.Tensor) -> torch.Tensor:
    return load_cpu_kernel("elementwise_cpu").silu_and_mul(x)


def rotary_embedding_cpu(self: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor,
                         k: torch.Tensor):
    return load_cpu_kernel("elementwise_cpu").rotary_embedding(positions, q, k, self.cos_sin_cache)


CPU_FORWARDS = {RMSNorm: rms_norm_cpu, SiluAndMul: silu_and_mul_cpu,
                RotaryEmbedding: rotary_embedding_cpu}
