"""Reading a LoRA adapter in PEFT's format: adapter_config.json (rank, lora_alpha, targets, rsLoRA)
and adapter_model.safetensors (each target's lora_A [r, in] and lora_B [out, r]), checked against
the base model."""
import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors.torch import load_file
from transformers import PretrainedConfig

from nanoserve.lora_request import LoRARequest

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT's key for one target: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                 r"(\w+)\.lora_([AB])\.weight$")
# adapter_config.json fields that change what the weights mean; an adapter that sets them is
# refused.
UNSUPPORTED = {"use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None,
               "bias": "none", "fan_in_fan_out": False}


@dataclass
class LoRAAdapter:
    """One adapter, read into host memory: (layer, target) -> (A [r, in], B [out, r]), and its
    scaling."""

    lora_request: LoRARequest
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def target_shapes(config: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """Each target's (in, out) features in the whole model, as PEFT's weights have them (a
    tensor-parallel rank holds a share of each)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, intermediate = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, intermediate),
            "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden)}


def read_adapter(lora: LoRARequest, shapes: dict[str, tuple[int, int]], num_layers: int,
                 max_rank: int) -> LoRAAdapter:
    """lora's folder, checked: shapes maps each target to the base model's (in, out) features. A
    ValueError names the file or field that is wrong."""
    config_path = os.path.join(lora.lora_path, "adapter_config.json")
    weights_path = os.path.join(lora.lora_path, "adapter_model.safetensors")
    for path in (config_path, weights_path):
        if not os.path.isfile(path):
            raise ValueError(f"lora_path: {path} does not exist (a PEFT adapter folder has "
                             "adapter_config.json and adapter_model.safetensors)")
    with open(config_path) as f:
        config = json.load(f)
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"{config_path}: r must be an integer >= 1 and lora_alpha a number, "
                         f"got {rank!r}, {alpha!r}")
    if rank > max_rank:
        raise ValueError(f"{config_path}: r ({rank}) exceeds max_lora_rank ({max_rank})")
    for name, default in UNSUPPORTED.items():
        if config.get(name, default) not in (default, None):
            raise ValueError(f"{config_path}: {name}={config[name]!r} is not supported")
    weights: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(weights_path).items():
        match = KEY.match(key)
        if match is None or match[2] not in TARGETS or int(match[1]) >= num_layers:
            raise ValueError(f"{weights_path}: {key} is not a LoRA weight of a target "
                             f"among {TARGETS} in the model's {num_layers} layers")
        weights.setdefault((int(match[1]), match[2]), {})[match[3]] = tensor.float()
    pairs = {}
    for (layer, target), ab in weights.items():
        in_features, out_features = shapes[target]
        expected = {"A": (rank, in_features), "B": (out_features, rank)}
        for name, shape in expected.items():
            if name not in ab or tuple(ab[name].shape) != shape:
                got = tuple(ab[name].shape) if name in ab else "missing"
                raise ValueError(f"{weights_path}: layers.{layer}.{target}.lora_{name} must "
                                 f"be {shape} for this base model and r={rank}, got {got}")
        pairs[(layer, target)] = (ab["A"], ab["B"])
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoRAAdapter(lora, rank, scaling, pairs)
