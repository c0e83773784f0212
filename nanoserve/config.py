import importlib.util
import os
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, GenerationConfig, PretrainedConfig


@dataclass
class Config:
    """Engine settings, named as in vLLM's `LLM(...)` so workshop code ports."""

    model: str
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_model_len: int = 4096
    block_size: int | None = None  # tokens per KV block; None: 256 with flash-attn (its minimum), else 16
    num_kvcache_blocks: int | None = None  # force the KV pool size; None sizes it from memory
    gpu_memory_utilization: float = 0.9  # CUDA: share of GPU memory the engine may fill
    cpu_kvcache_space: float = 2.0  # CPU: GiB of RAM for the KV cache (like VLLM_CPU_KVCACHE_SPACE)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = False  # vLLM V1: a token budget per step; long prompts are cut into chunks
    scheduling_policy: str = "fcfs"  # "fcfs", or "priority": lower `priority` values are served first (V0)
    preemption_mode: str = "recompute"  # "recompute" drops a preempted request's KV; "swap" moves it to host RAM
    swap_space: float = 4.0  # GiB of host memory for swapped-out KV blocks (preemption_mode="swap")
    async_scheduling: bool = False  # plan step N+1 while step N's forward runs (docs/engine.md)
    enforce_eager: bool = False  # True disables CUDA graphs
    dtype: str = "auto"  # "auto": bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # "auto": CUDA when available, else CPU
    seed: int = 0
    hf_config: PretrainedConfig = field(init=False, repr=False)
    use_flash_attn: bool = field(init=False, repr=False)
    eos_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"model: {self.model!r} is not a model folder (no config.json found in it)")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        # The PyTorch attention copies each sequence's KV out block by block, padding to whole blocks,
        # so small blocks waste less (16 is vLLM's default); flash-attn's paged kernels need 256.
        self.use_flash_attn = self.device == "cuda" and importlib.util.find_spec("flash_attn") is not None
        if self.block_size is None:
            self.block_size = 256 if self.use_flash_attn else 16
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kvcache_blocks is not None and self.num_kvcache_blocks < 1:
            raise ValueError(f"num_kvcache_blocks must be >= 1, got {self.num_kvcache_blocks}")
        for name, choices in (("scheduling_policy", ("fcfs", "priority")), ("preemption_mode", ("recompute", "swap"))):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 (GiB), got {self.swap_space}")
        if self.preemption_mode == "swap" and self.swap_space == 0:
            raise ValueError("preemption_mode='swap' needs swap_space > 0: with no host memory nothing can be swapped")
        self.hf_config = AutoConfig.from_pretrained(self.model)
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)
        # Without chunked prefill a prompt is computed in one step, so it must fit the token budget.
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}), or set enable_chunked_prefill=True"
            )
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device == "cuda" else "float32"
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {self.dtype!r}")
        eos = self.hf_config.eos_token_id
        if os.path.isfile(os.path.join(self.model, "generation_config.json")):
            eos = GenerationConfig.from_pretrained(self.model).eos_token_id or eos  # what HF generate stops on
        self.eos_token_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)
