"""elementwise_backend="compile": torch.compile, as vLLM compiles its model. Inductor fuses each
elementwise chain (RMSNorm with its residual add, SwiGLU's gate, RoPE) into one loop; compiling
costs 2.5 to 11 s at start."""
from functools import cache

import torch
from torch import nn


@cache
def compiled_forward(cls: type[nn.Module]):
    """One compiled forward per class, shared by all its modules: Dynamo takes the module as an
    input, so the model's RMSNorms share their graphs instead of compiling one each. dynamic=True:
    any number of tokens."""
    return torch.compile(cls.forward, dynamic=True)
