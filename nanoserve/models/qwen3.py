"""Qwen3, and through two switches Qwen2 and Llama (and Mistral, Llama with sliding windows:
config.py): they differ only in their attention. Qwen3 normalizes q and k per head (qk_norm); Qwen2
adds a bias to q/k/v; Llama has neither."""
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoserve.config import sliding_windows
from nanoserve.layers.activation import SiluAndMul
from nanoserve.layers.attention import Attention, AttentionMetadata
from nanoserve.layers.layernorm import RMSNorm
from nanoserve.layers.linear import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from nanoserve.layers.rotary_embedding import RotaryEmbedding, rope_theta
from nanoserve.utils.distributed import tp_rank_size

# part(name, build) -> the model's part `name` ("embed_tokens", "layers.3", "norm", "lm_head"):
# build() here; a pipeline stage builds only its own (nanoserve/parallel/pipeline.py), through this
# parameter of the model's constructor.
Part = Callable[[str, Callable[[], nn.Module]], nn.Module]


def build_all(name: str, build: Callable[[], nn.Module]) -> nn.Module:
    return build()


@dataclass(frozen=True)
class Variant:
    qk_norm: bool = False
    qkv_bias: bool | None = None  # None: read config.attention_bias (which also biases o_proj)


ARCHITECTURES = {"Qwen3ForCausalLM": Variant(qk_norm=True),
                 "Qwen2ForCausalLM": Variant(qkv_bias=True),
                 "LlamaForCausalLM": Variant(), "MistralForCausalLM": Variant()}


class DecoderAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, variant: Variant, rotary_emb: RotaryEmbedding,
                 head_dim: int, window: int = 0):
        super().__init__()
        tp_size = tp_rank_size()[1]  # tensor parallelism: each rank computes its share of the heads
        num_heads = config.num_attention_heads // tp_size
        # fewer KV heads than ranks: replicated
        num_kv_heads = max(1, config.num_key_value_heads // tp_size)
        q_size, kv_size, self.head_dim = num_heads * head_dim, num_kv_heads * head_dim, head_dim
        bias = getattr(config, "attention_bias", False)
        qkv_bias, o_bias = (bias, bias) if variant.qkv_bias is None else (variant.qkv_bias, False)
        self.qkv_proj = MergedColumnParallelLinear(config.hidden_size, [q_size, kv_size, kv_size],
                                                   bias=qkv_bias)
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=o_bias)
        self.rotary_emb = rotary_emb
        self.attn = Attention(num_heads, num_kv_heads, head_dim, head_dim**-0.5, window)
        self.qk_norm = variant.qk_norm
        if self.qk_norm:
            self.q_norm, self.k_norm = (RMSNorm(head_dim, config.rms_norm_eps) for _ in range(2))

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x).split(self.qkv_proj.output_sizes, -1)
        # [tokens, heads, head_dim] views of the fused output (a Triton RMSNorm reads q, k in place)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in qkv)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta).flatten(1))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        size = config.intermediate_size // tp_rank_size()[1]
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, variant: Variant, rotary_emb: RotaryEmbedding,
                 head_dim: int, window: int = 0):
        super().__init__()
        self.self_attn = DecoderAttention(config, variant, rotary_emb, head_dim, window)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer has no residual yet: the input is it
            x, residual = self.input_layernorm(x), x
        else:  # every other layer adds it to x, fused with the norm
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Model(nn.Module):
    def __init__(self, config: PretrainedConfig, variant: Variant, part: Part = build_all):
        super().__init__()
        self.embed_tokens = part(
            "embed_tokens", lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size))
        head_dim = (getattr(config, "head_dim", None)
                    or config.hidden_size // config.num_attention_heads)
        rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings, rope_theta(config))
        self.layers = nn.ModuleList([  # w=w: each lambda keeps its own layer's window
            part(f"layers.{i}", lambda w=w: DecoderLayer(config, variant, rotary_emb, head_dim, w))
            for i, w in enumerate(sliding_windows(config))])
        self.norm = part("norm", lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        return self.norm(x, residual)[0]


class Qwen3ForCausalLM(nn.Module):
    # Checkpoint names that are fused here: (fused module, index of the part).
    packed_modules_mapping = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1),
                              "v_proj": ("qkv_proj", 2), "gate_proj": ("gate_up_proj", 0),
                              "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: PretrainedConfig,
                 variant: Variant = ARCHITECTURES["Qwen3ForCausalLM"], part: Part = build_all):
        super().__init__()
        self.model = Model(config, variant, part)
        self.lm_head = part("lm_head",
                            lambda: ParallelLMHead(config.vocab_size, config.hidden_size))
        if config.tie_word_embeddings:  # small models share the input and output embedding
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden[rows])  # None: a TP worker
