"""`compile_elementwise=True`: torch.compile for the elementwise chains between the matmuls (RMSNorm with its
residual add, SwiGLU's gate, RoPE), as vLLM compiles its model. Inductor fuses each chain into one loop over the
activations, where eager PyTorch runs one op at a time, each reading and writing all of them. The matmuls and
attention stay eager. What it gains and what compiling costs: docs/benchmarks.md."""
import types
from functools import cache

import torch
from torch import nn

from nanoserve.layers.activation import SiluAndMul
from nanoserve.layers.layernorm import RMSNorm
from nanoserve.layers.rotary_embedding import RotaryEmbedding


@cache
def compiled_forward(cls: type[nn.Module]):
    """One compiled forward per class, shared by all its modules: Dynamo takes the module as an input, so the
    model's RMSNorms share their graphs instead of compiling one each. dynamic=True: any number of tokens."""
    return torch.compile(cls.forward, dynamic=True)


def compile_elementwise(model: nn.Module) -> None:
    """Give model's RMSNorm, SiluAndMul and RotaryEmbedding modules compiled forwards (compiled on first call)."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, SiluAndMul, RotaryEmbedding)):
            module.forward = types.MethodType(compiled_forward(type(module)), module)
