"""Paged attention's interface: each step's metadata, and the layer that calls the backend's
(store K/V, attend) pair (selector.py binds it). The PyTorch backend (torch_attention.py) is the
one to read; the C++ "cpu" backend is CPU's default."""
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from nanoserve.utils.cpu_kernel import load_cpu_kernel


@dataclass
class AttentionMetadata:
    """Where each sequence's tokens sit in the flat batch and in the paged KV cache. The batch is
    the concatenation of every sequence's new tokens ("varlen"): sequence i owns rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1], and attends to context_lens[i] cached tokens in total."""

    # [num_tokens]: cache slot (block_id * block_size + offset) of each new token
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks]: physical block ids, padded with -1
    context_lens: torch.Tensor  # [num_seqs]: tokens in the cache after this step (cached + new)
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1]: prefix sums of new tokens per sequence
    cu_seqlens_k: torch.Tensor  # [num_seqs + 1]: prefix sums of context_lens
    max_seqlen_q: int
    max_seqlen_k: int
    # torch_attention.py's TorchAttentionPlan: the batch's split, built by layer 0
    torch_plan: object = None
    torch_window_plan: object = None  # the same for the sliding-window layers, if any


# The "cpu" backend, the default on CPU: the PyTorch path (torch_attention.py) copies the blocks
# out, which costs as much as the attention itself, so csrc/paged_attention_cpu.cpp walks the block
# table in place instead (the same scores, softmax and weighted values, its own layout within a
# block). utils/cpu_kernel.py compiles it on first use.
def cpu_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
    return load_cpu_kernel("paged_attention_cpu").paged_attention(
        q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.cu_seqlens_q, scale, window)


class Attention(nn.Module):
    """Stores new K/V into the paged cache, then attends over each sequence's context (its last
    sliding_window)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.sliding_window = scale, sliding_window
        # The cache's views and the backend's (store K/V, attend): bound by the ModelRunner once it
        # sizes the cache.
        self.k_cache = self.v_cache = torch.tensor([])
        self.store: Callable | None = None
        self.impl: Callable | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        self.store(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.impl(q, self.k_cache, self.v_cache, meta, self.scale, self.sliding_window)
