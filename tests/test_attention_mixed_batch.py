"""One attention call runs a mixed batch, as chunked prefill sends it: a prompt chunk that continues a
cached context, decodes and a fresh prompt. Each sequence's output equals causal attention over its own
tokens, on the PyTorch path and (where CUDA and flash-attn exist) the flash-attn path."""
import importlib.util
from itertools import accumulate

import pytest
import torch

from nanoserve.layers.attention import AttentionMetadata
from nanoserve.layers.flash_attention import flash_paged_attention
from nanoserve.layers.torch_attention import torch_paged_attention

HAS_FLASH = torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None
HEADS, KV_HEADS, DIM = 4, 2, 16
BATCH = [(10, 3), (7, 1), (5, 5), (9, 1)]  # (context length after this step, new tokens): chunk, decode, prompt, decode


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last len(q) positions over all len(k) tokens, in float64."""
    k, v = (t.double().repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))  # GQA: heads share kv
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(len(k) - len(q), len(k))[:, None]
    scores = scores.masked_fill(torch.arange(len(k))[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("impl", [
    torch_paged_attention,
    pytest.param(flash_paged_attention, marks=pytest.mark.skipif(not HAS_FLASH, reason="needs CUDA and flash-attn")),
])
def test_mixed_batch_equals_per_sequence_attention(impl):
    torch.manual_seed(0)
    is_flash = impl is flash_paged_attention
    device, dtype = ("cuda", torch.bfloat16) if is_flash else ("cpu", torch.float32)
    block_size = 256 if is_flash else 4  # flash-attn's paged kernels need multiples of 256
    blocks_per_seq = [-(-ctx // block_size) for ctx, _ in BATCH]
    order = torch.randperm(sum(blocks_per_seq) + 2).tolist()  # scattered blocks, and some unused ones
    k_cache = torch.randn(len(order), block_size, KV_HEADS, DIM, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    block_tables, qs, expected = [], [], []
    scale = DIM**-0.5
    for (ctx, q_len), n in zip(BATCH, blocks_per_seq):
        table = [order.pop() for _ in range(n)]
        k = k_cache[table].flatten(0, 1)[:ctx]  # the cache holds the whole context, this step's tokens too
        v = v_cache[table].flatten(0, 1)[:ctx]
        q = torch.randn(q_len, HEADS, DIM, dtype=dtype, device=device)
        block_tables.append(table + [-1] * (max(blocks_per_seq) - n))
        qs.append(q)
        expected.append(reference(q.cpu(), k.cpu(), v.cpu(), scale))
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([], dtype=torch.int64, device=device),  # only store_kvcache reads it
        block_tables=torch.tensor(block_tables, **i32),
        context_lens=torch.tensor([ctx for ctx, _ in BATCH], **i32),
        cu_seqlens_q=torch.tensor(list(accumulate([q for _, q in BATCH], initial=0)), **i32),
        cu_seqlens_k=torch.tensor(list(accumulate([ctx for ctx, _ in BATCH], initial=0)), **i32),
        max_seqlen_q=max(q for _, q in BATCH), max_seqlen_k=max(ctx for ctx, _ in BATCH),
    )
    out = impl(torch.cat(qs), k_cache, v_cache, meta, scale).cpu().double()
    tol = 2e-2 if is_flash else 1e-5
    torch.testing.assert_close(out, torch.cat(expected), atol=tol, rtol=tol)
