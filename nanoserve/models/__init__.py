import torch
from torch import nn
from transformers import PretrainedConfig

from nanoserve.layers.onednn import reorder_weights_for_cpu
from nanoserve.models.qwen3 import ARCHITECTURES, Qwen3ForCausalLM
from nanoserve.utils.loader import load_weights


def build_model(config: PretrainedConfig, model_class: type | None = None) -> nn.Module:
    """The model class named by config.json's `architectures`, or a ValueError listing ours.
    model_class: a subclass of Qwen3ForCausalLM to build instead (a pipeline stage's:
    nanoserve/parallel/pipeline.py)."""
    arch = (getattr(config, "architectures", None) or ["<none>"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported; "
                         f"supported: {', '.join(ARCHITECTURES)}")
    return (model_class or Qwen3ForCausalLM)(config, ARCHITECTURES[arch])


def load_model(config: PretrainedConfig, path: str, dtype: torch.dtype, device: torch.device,
               model_class: type | None = None) -> nn.Module:
    """The model built in dtype right on device (no float32 copy first), its weights read from path,
    in eval mode; on CPU with its weights laid out for the CPU's matmuls."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(config, model_class)
    finally:
        torch.set_default_dtype(default_dtype)
    load_weights(model, path)
    if device.type == "cpu":
        reorder_weights_for_cpu(model)
    return model.eval()
