import glob
import os

from safetensors import safe_open
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded) -> None:
    param.data.copy_(loaded[:])


def load_weights(model: nn.Module, path: str) -> None:
    """Copy every tensor of a Hugging Face folder's *.safetensors into the model, fusing q/k/v and
    gate/up.

    A module with a `weight_loader` picks its part: its fused shard, and its rank's slice under
    tensor parallelism. It gets a lazy safetensors slice: indexing it reads only those rows or
    columns from the file.
    """
    files = glob.glob(os.path.join(path, "*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {path!r}")
    packed = getattr(model, "packed_modules_mapping", {})
    # A pipeline stage holds only its own parts (parallel/pipeline.py): the others' tensors are
    # skipped. A tied LM head is embed_tokens (one parameter, listed once), or, on a last stage
    # without the embedding, its copy.
    params = dict(model.named_parameters())
    names = {name for file in files for name in safe_open(file, "pt", "cpu").keys()}
    tied_head = ["lm_head.weight"] if "lm_head.weight" not in names else []
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                targets = [name, *tied_head] if name == "model.embed_tokens.weight" else [name]
                for target in targets:
                    param_name, shard = target, ()
                    for part, (fused, index) in packed.items():
                        if f".{part}." in target:
                            param_name, shard = target.replace(f".{part}.", f".{fused}."), (index,)
                            break
                    if param_name not in params:
                        continue
                    module = model.get_submodule(param_name.rsplit(".", 1)[0])
                    weight_loader = getattr(module, "weight_loader", default_weight_loader)
                    weight_loader(params[param_name], f.get_slice(name), *shard)
