from torch import nn
from transformers import PretrainedConfig

from nanoserve.models.qwen3 import ARCHITECTURES, Qwen3ForCausalLM


def build_model(config: PretrainedConfig) -> nn.Module:
    """The model class named by config.json's `architectures`, or a ValueError listing ours."""
    arch = (getattr(config, "architectures", None) or ["<none>"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    return Qwen3ForCausalLM(config, ARCHITECTURES[arch])
