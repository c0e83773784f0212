import glob
import os

from safetensors import safe_open
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded) -> None:
    param.data.copy_(loaded[:])


def load_weights(model: nn.Module, path: str) -> None:
    """Copy every tensor of a Hugging Face folder's *.safetensors into the model, fusing q/k/v and gate/up.

    A module with a `weight_loader` picks its part: its fused shard, and its rank's slice under tensor
    parallelism. It gets a lazy safetensors slice: indexing it reads only those rows or columns from the file.
    """
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
                param_name, shard = name, ()
                for part, (fused, index) in packed.items():
                    if f".{part}." in name:
                        param_name, shard = name.replace(f".{part}.", f".{fused}."), (index,)
                        break
                module = model.get_submodule(param_name.rsplit(".", 1)[0])
                weight_loader = getattr(module, "weight_loader", default_weight_loader)
                weight_loader(model.get_parameter(param_name), f.get_slice(name), *shard)
