"""attention_backend="flash_attn" on CUDA: flash-attn's kernels read the paged cache in place
(layers/torch_attention.py has the PyTorch version of the same contract, torch_paged_attention)."""
import torch


def flash_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                          scale: float, window: int = 0) -> torch.Tensor:
    """flash-attn on CUDA: the same contract as torch_paged_attention (meta: its AttentionMetadata),
    in fused kernels."""
    # CUDA only: import lazily
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    # keys to the left, to the right (-1: all)
    window_size = (window - 1, 0) if window else (-1, -1)

    if meta.max_seqlen_q == 1:  # decode: the kernel CUDA graphs capture
        return flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache,
                                       cache_seqlens=meta.context_lens,
                                       block_table=meta.block_tables, softmax_scale=scale,
                                       causal=True, window_size=window_size).squeeze(1)
    return flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q,
                                  cu_seqlens_k=meta.cu_seqlens_k, max_seqlen_q=meta.max_seqlen_q,
                                  max_seqlen_k=meta.max_seqlen_k, softmax_scale=scale, causal=True,
                                  block_table=meta.block_tables, window_size=window_size)
