"""Every attention backend with a sliding window against a plain reference (a loop over each token's last `window`
keys): decodes, prompts, chunks that start before the window's edge and end past it, GQA; the blocks wholly
behind each sequence's window are the null block (zeros), as the block manager leaves them."""
from itertools import accumulate

import pytest
import torch

from nanoserve.layers.attention import AttentionMetadata
from nanoserve.layers.selector import attention_backend
from nanoserve.utils.cpu_kernel import load_cpu_kernel

BACKENDS = ["torch", "triton"]
if not isinstance(load_cpu_kernel("paged_attention_cpu"), str):
    BACKENDS.append("cpu")
# (context length after this step, new tokens): decodes, a prompt, chunks across the window's edge
BATCH = [(37, 1), (70, 1), (16, 1), (45, 45), (50, 13), (90, 24), (9, 9), (33, 2)]


def reference(q, k, v, batch, window, scale):
    """Each new token at position p: softmax over keys max(0, p - window + 1) .. p, one at a time."""
    out, row = torch.empty_like(q), 0
    group = q.shape[1] // k[0].shape[1]
    for (ctx, n), ks, vs in zip(batch, k, v):
        for p in range(ctx - n, ctx):
            lo = max(0, p - window + 1)
            kk, vv = ks[lo : p + 1].repeat_interleave(group, 1), vs[lo : p + 1].repeat_interleave(group, 1)
            weights = torch.softmax(torch.einsum("hd,khd->hk", q[row], kk) * scale, dim=-1)
            out[row] = torch.einsum("hk,khd->hd", weights, vv)
            row += 1
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [1, 7, 16, 20, 64])
@pytest.mark.parametrize("gqa", [1, 3])
def test_backend_equals_the_reference(backend, window, gqa):
    block_size, kv_heads, dim = 16, 2, 16
    gen = torch.Generator().manual_seed(window * 10 + gqa)
    store, attend = attention_backend(backend)
    blocks = [-(-ctx // block_size) for ctx, _ in BATCH]
    order = torch.randperm(sum(blocks) + 3, generator=gen).tolist()
    order.remove(0)  # block 0: the null block, zeros
    k_cache = torch.zeros(sum(blocks) + 3, block_size, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    tables, ks, vs = [], [], []
    for (ctx, n), num in zip(BATCH, blocks):
        table = [order.pop() for _ in range(num)]
        k, v = torch.randn(2, ctx, kv_heads, dim, generator=gen)
        slots = torch.tensor([table[i // block_size] * block_size + i % block_size for i in range(ctx)])
        store(k, v, k_cache, v_cache, slots)
        first_needed = max(ctx - n - window + 1, 0) // block_size  # as SlidingWindowBlockManager frees
        tables.append([0] * first_needed + table[first_needed:] + [-1] * (max(blocks) - num))
        ks.append(k), vs.append(v)
    q = torch.randn(sum(n for _, n in BATCH), kv_heads * gqa, dim, generator=gen)
    i32 = dict(dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([], dtype=torch.int64), block_tables=torch.tensor(tables, **i32),
        context_lens=torch.tensor([ctx for ctx, _ in BATCH], **i32),
        cu_seqlens_q=torch.tensor(list(accumulate([n for _, n in BATCH], initial=0)), **i32),
        cu_seqlens_k=torch.tensor(list(accumulate([ctx for ctx, _ in BATCH], initial=0)), **i32),
        max_seqlen_q=max(n for _, n in BATCH), max_seqlen_k=max(ctx for ctx, _ in BATCH))
    expected = reference(q, ks, vs, BATCH, window, dim**-0.5)
    torch.testing.assert_close(attend(q, k_cache, v_cache, meta, dim**-0.5, window), expected, atol=1e-5, rtol=1e-5)
    # The window matters: attention over the whole context answers otherwise.
    assert not torch.allclose(reference(q, ks, vs, BATCH, 10**6, dim**-0.5), expected, atol=1e-3)
