"""The elementwise chains between the matmuls (RMSNorm with its residual add, SwiGLU's gate, RoPE), four ways;
Config.elementwise_backend picks one:

- "torch": the modules' own forwards (layers/layernorm.py, activation.py, rotary_embedding.py), the code to read.
  Eager PyTorch runs each chain as 5 to 10 ops, each reading and writing all the activations; in decode each op
  costs more in dispatch than in arithmetic.
- "cpu": csrc/elementwise_cpu.cpp, one C++ loop per chain, as vLLM's CPU build has kernels of its own for them.
  The default on the CPU in float32 (built on first use, like the "cpu" attention backend).
- "triton": layers/triton_elementwise.py, one Triton kernel per chain; the default on CUDA (CUDA graphs capture
  them). Qwen3's per-head q_norm and k_norm are RMSNorms too: one kernel reads them in place in the qkv output.
- "compile": torch.compile, as vLLM compiles its model: Inductor fuses each chain into one loop. Compiling costs
  2.5 to 11 s at start.

What each gains: docs/benchmarks.md. The matmuls and attention are not touched here.
"""
import types
from functools import cache

import torch
from torch import nn

from nanoserve.layers.activation import SiluAndMul
from nanoserve.layers.layernorm import RMSNorm
from nanoserve.layers.rotary_embedding import RotaryEmbedding
from nanoserve.utils.cpu_kernel import load_cpu_kernel


def rms_norm_cpu(self: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None):
    out, summed = load_cpu_kernel("elementwise_cpu").rms_norm(x, residual, self.weight, self.eps)
    return out if residual is None else (out, summed)


def silu_and_mul_cpu(self: SiluAndMul, x: torch.Tensor) -> torch.Tensor:
    return load_cpu_kernel("elementwise_cpu").silu_and_mul(x)


def rotary_embedding_cpu(self: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    q, k = load_cpu_kernel("elementwise_cpu").rotary_embedding(positions, q, k, self.cos_sin_cache)
    return q, k


CPU_FORWARDS = {RMSNorm: rms_norm_cpu, SiluAndMul: silu_and_mul_cpu, RotaryEmbedding: rotary_embedding_cpu}


def rms_norm_triton(self: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None):
    from nanoserve.layers.triton_elementwise import triton_rms_norm  # triton: imported only when chosen

    out, summed = triton_rms_norm(x, residual, self.weight, self.eps)
    return out if residual is None else (out, summed)


def silu_and_mul_triton(self: SiluAndMul, x: torch.Tensor) -> torch.Tensor:
    from nanoserve.layers.triton_elementwise import triton_silu_and_mul

    return triton_silu_and_mul(x)


def rotary_embedding_triton(self: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    from nanoserve.layers.triton_elementwise import triton_rotary_embedding

    return (triton_rotary_embedding(positions, q, self.cos_sin_cache),
            triton_rotary_embedding(positions, k, self.cos_sin_cache))


TRITON_FORWARDS = {RMSNorm: rms_norm_triton, SiluAndMul: silu_and_mul_triton, RotaryEmbedding: rotary_embedding_triton}


@cache
def compiled_forward(cls: type[nn.Module]):
    """One compiled forward per class, shared by all its modules: Dynamo takes the module as an input, so the
    model's RMSNorms share their graphs instead of compiling one each. dynamic=True: any number of tokens."""
    return torch.compile(cls.forward, dynamic=True)


def use_elementwise_backend(model: nn.Module, backend: str) -> None:
    """Give model's RMSNorm, SiluAndMul and RotaryEmbedding modules the backend's forward ("torch": their own)."""
    if backend == "torch":
        return
    kernels = {"cpu": CPU_FORWARDS, "triton": TRITON_FORWARDS}.get(backend)
    for module in model.modules():
        if type(module) in CPU_FORWARDS:
            forward = kernels[type(module)] if kernels else compiled_forward(type(module))
            module.forward = types.MethodType(forward, module)
