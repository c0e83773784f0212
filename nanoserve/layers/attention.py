from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionMetadata:
    """Where each sequence's tokens sit in the flat batch and in the paged KV cache.

    The batch is the concatenation of every sequence's new tokens ("varlen"): sequence i owns
    rows cu_seqlens_q[i]:cu_seqlens_q[i+1], and attends to context_lens[i] cached tokens in total.
    """

    slot_mapping: torch.Tensor  # [num_tokens]: cache slot (block_id * block_size + offset) of each new token
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks]: physical block ids, padded with -1
    context_lens: torch.Tensor  # [num_seqs]: tokens in the cache after this step (cached + new)
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1]: prefix sums of new tokens per sequence
    cu_seqlens_k: torch.Tensor  # [num_seqs + 1]: prefix sums of context_lens
    max_seqlen_q: int
    max_seqlen_k: int


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write this step's K/V into their slots; attention then reads everything from the cache."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def torch_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Pure-PyTorch paged attention: gather each sequence's blocks, pad, and run SDPA with a mask."""
    num_seqs = meta.block_tables.shape[0]
    # [num_seqs, max_num_blocks * block_size, kv_heads, head_dim]: every sequence's context, padded.
    k = k_cache[meta.block_tables].flatten(1, 2).transpose(1, 2)
    v = v_cache[meta.block_tables].flatten(1, 2).transpose(1, 2)
    q_lens = meta.cu_seqlens_q.diff()
    max_q = meta.max_seqlen_q
    if max_q == 1:  # decode: one query per sequence, no padding needed
        q_padded = q.unsqueeze(1)
    else:  # scatter the flat queries into a [num_seqs, max_q] grid
        seq_idx = torch.repeat_interleave(torch.arange(num_seqs, device=q.device), q_lens)
        row = torch.arange(q.shape[0], device=q.device) - meta.cu_seqlens_q[seq_idx]
        flat_idx = seq_idx * max_q + row
        q_padded = q.new_zeros(num_seqs * max_q, *q.shape[1:])
        q_padded[flat_idx] = q
        q_padded = q_padded.view(num_seqs, max_q, *q.shape[1:])
    # Causal over the whole context: query i of a sequence sits at position context_len - q_len + i.
    q_pos = (meta.context_lens - q_lens)[:, None] + torch.arange(max_q, device=q.device)
    k_pos = torch.arange(k.shape[2], device=q.device)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)
    out = F.scaled_dot_product_attention(q_padded.transpose(1, 2), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=True).transpose(1, 2)
    return out.squeeze(1) if max_q == 1 else out.reshape(num_seqs * max_q, *q.shape[1:])[flat_idx]


def flash_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """flash-attn on CUDA: the same contract as torch_paged_attention, in fused kernels."""
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # CUDA only: import lazily

    if meta.max_seqlen_q == 1:  # decode: the kernel CUDA graphs capture
        return flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens,
                                       block_table=meta.block_tables, softmax_scale=scale,
                                       causal=True).squeeze(1)
    return flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q,
                                  cu_seqlens_k=meta.cu_seqlens_k, max_seqlen_q=meta.max_seqlen_q,
                                  max_seqlen_k=meta.max_seqlen_k, softmax_scale=scale, causal=True,
                                  block_table=meta.block_tables)


class Attention(nn.Module):
    """Stores new K/V into the paged cache, then attends over each sequence's whole context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # Bound by the ModelRunner once it has sized the KV cache and picked the implementation.
        self.k_cache = self.v_cache = torch.tensor([])
        self.impl = torch_paged_attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.impl(q, self.k_cache, self.v_cache, meta, self.scale)
