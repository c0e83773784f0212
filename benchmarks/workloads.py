"""What bench.py feeds the engines: its workloads (prompts and output lengths, the same for a given seed), seeded
random weights for a model folder that holds only a config, and random LoRA adapters.

The workload follows nano-vllm's bench.py: prompts of random token ids with random input and output lengths,
ignore_eos (every request produces exactly its output length). Every engine gets identical prompts and output
lengths and decodes greedily.
"""
import importlib
import inspect
import json
import os
import random
from pathlib import Path

from nanoserve import LoRARequest

# isort: split
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

# Scenario defaults: (prompts, (min, max) input tokens, (min, max) output tokens). CPU-sized, except
# nano-vllm's own (--memory-bound's too). For --shared-prefix the input range is the part after the shared prefix.
WORKLOADS = {
    "default": (64, (32, 512), (32, 256)),
    "quick": (16, (32, 256), (32, 128)),
    "nano-vllm": (256, (100, 1024), (100, 1024)),
    "shared-prefix": (64, (16, 64), (16, 64)),
    "lookup": (16, (0, 0), (64, 128)),  # input: a docstring of Python's standard library, whatever its length
    "multi-turn": (8, (32, 96), (16, 32)),  # conversations; each turn's new user message; each answer
    "memory-bound": (256, (100, 1024), (100, 1024)),  # nano-vllm's, in a KV pool of --kv-cache-memory-bytes
}
# --lookup's text: real prose that ships with Python (docstrings of these standard-library modules' public
# functions and classes), which each prompt asks the model to repeat: n-gram lookup finds what comes next.
LOOKUP_MODULES = ("argparse", "collections", "functools", "itertools", "json", "random", "textwrap", "threading")


def make_workload(args, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """Random prompts and output lengths, the same for a given seed."""
    rng = random.Random(args.seed)
    vocab = min(vocab_size, 10000)  # nano-vllm draws ids below 10000

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    prefix = tokens(args.prefix_len) if args.shared_prefix else []
    prompts = [prefix + tokens(rng.randint(*args.input_len)) for _ in range(args.num_prompts)]
    output_lens = [rng.randint(*args.output_len) for _ in prompts]
    return prompts, output_lens


def make_lookup_workload(args, path: str) -> tuple[list[list[int]], list[int]]:
    """Prompts asking to repeat a docstring of Python's standard library (LOOKUP_MODULES), the same for a given
    seed; each output length is drawn from --output-len, at most the docstring's length in tokens."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    docs = sorted({inspect.getdoc(obj) for module in map(importlib.import_module, LOOKUP_MODULES)
                   for name, obj in vars(module).items()
                   if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
                   and len(inspect.getdoc(obj) or "") >= 400})
    rng = random.Random(args.seed)
    rng.shuffle(docs)
    chosen = [docs[i % len(docs)] for i in range(args.num_prompts)]
    prompts = [tokenizer.encode(f"Repeat the text below word for word.\n\nText:\n{doc}\n\nRepeated text:\n")
               for doc in chosen]
    output_lens = [min(rng.randint(*args.output_len), len(tokenizer.encode(doc))) for doc in chosen]
    return prompts, output_lens


def random_weights(config_dir: str, seed: int, folder: str) -> str:
    """A checkpoint of config_dir's architecture with seeded random weights, in folder. Making them takes seconds
    (a GPU machine's every bench.py run spent them): a folder that holds this config's and seed's is reused."""
    made = {"config": Path(config_dir, "config.json").read_text(), "seed": seed}
    marker = Path(folder, "random_weights.json")
    if not (marker.exists() and json.loads(marker.read_text()) == made):
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir)).save_pretrained(folder)
        marker.write_text(json.dumps(made))  # last: a run cut short while writing leaves no marker
    return folder



LORA_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")


def make_lora_adapters(path: str, folder: str, n: int, rank: int = 16, seed: int = 0) -> list[LoRARequest]:
    """n random adapters of the given rank on every target, in PEFT's format (--lora): what serving many
    fine-tunes of one model costs does not depend on what they learned."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    loras = []
    for i in range(1, n + 1):
        weights = {}
        for layer in range(model.config.num_hidden_layers):
            for name in LORA_TARGETS:
                out_features, in_features = model.get_submodule(f"model.layers.{layer}.{name}").weight.shape
                key = f"base_model.model.model.layers.{layer}.{name}"
                weights[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
                weights[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
        os.makedirs(lora_path := os.path.join(folder, f"lora-{i}"))
        save_file(weights, os.path.join(lora_path, "adapter_model.safetensors"))
        with open(os.path.join(lora_path, "adapter_config.json"), "w") as f:
            json.dump(dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, base_model_name_or_path=path,
                           target_modules=[name.split(".")[1] for name in LORA_TARGETS]), f)
        loras.append(LoRARequest(f"lora-{i}", i, lora_path))
    return loras


def merge_lora(path: str, lora: LoRARequest, folder: str) -> str:
    """The base model with one adapter merged into its weights (W + scaling * B @ A): the peer that serves a
    single fine-tune at the base model's cost."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with open(os.path.join(lora.lora_path, "adapter_config.json")) as f:
        config = json.load(f)
    weights = load_file(os.path.join(lora.lora_path, "adapter_model.safetensors"))
    with torch.no_grad():
        for key, a in weights.items():
            if key.endswith("lora_A.weight"):
                name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = weights[key.replace("lora_A", "lora_B")]
                model.get_submodule(name).weight += config["lora_alpha"] / config["r"] * (b @ a)
    model.save_pretrained(folder)
    return folder

