import glob
import os

from safetensors import safe_open
from torch import nn


def load_weights(model: nn.Module, path: str) -> None:
    """Copy every tensor of a Hugging Face folder's *.safetensors into the model, fusing q/k/v and gate/up."""
    files = glob.glob(os.path.join(path, "*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {path!r}")
    packed = getattr(model, "packed_modules_mapping", {})
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                if tied and name.startswith("lm_head."):
                    continue  # the same tensor as embed_tokens
                tensor = f.get_tensor(name)
                for part, (fused, shard) in packed.items():
                    if f".{part}." in name:
                        fused_name = name.replace(f".{part}.", f".{fused}.")
                        module = model.get_submodule(fused_name.rsplit(".", 1)[0])
                        module.load_shard(model.get_parameter(fused_name), tensor, shard)
                        break
                else:
                    model.get_parameter(name).data.copy_(tensor)
