"""The "cpu" attention backend: a C++ kernel that reads each sequence's K/V in place in the paged cache.

torch_paged_attention (layers/attention.py) is the version to read: it copies a sequence's blocks out of the
pool, then runs PyTorch's SDPA on the copy. The copy costs as much as the attention itself, so on CPU the
default is csrc/paged_attention_cpu.cpp: the same three steps (scores, softmax, weighted values) walking the
block table, vectorized with PyTorch's own at::vec. nanoserve/utils/cpu_kernel.py compiles it on first use
(25-40 s on 2 cores, once) and loads it afterwards; where it cannot be built, "auto" keeps the PyTorch path.
"""
import torch

from nanoserve.utils.cpu_kernel import load_cpu_kernel


def cpu_store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write this step's K/V into their slots, in the kernel's layout within each block."""
    load_cpu_kernel("paged_attention_cpu").store_kvcache(k, v, k_cache, v_cache, slot_mapping)


def cpu_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float
                        ) -> torch.Tensor:
    """torch_paged_attention's contract (meta: its AttentionMetadata), reading the cache in place."""
    return load_cpu_kernel("paged_attention_cpu").paged_attention(
        q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.cu_seqlens_q, scale)
