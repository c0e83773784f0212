"""The PyTorch path copies each decode group's K/V blocks into one scratch buffer that every group and
every layer of a step reuses. Groups of different sizes, several layers sharing one plan, and prefills
(one continuing a cached prefix) beside them must each still equal causal attention over their own tokens."""
from itertools import accumulate

import torch

from nanoserve.layers import torch_attention
from nanoserve.layers.attention import AttentionMetadata
from nanoserve.layers.torch_attention import torch_paged_attention
from tests.test_attention_mixed_batch import DIM, HEADS, KV_HEADS, reference

BLOCK_SIZE = 4
# (context length after this step, new tokens): decodes of mixed lengths, a prefix-hit prompt, a fresh prompt
BATCH = [(23, 1), (5, 1), (40, 1), (17, 6), (9, 1), (31, 1), (12, 12), (2, 1), (38, 1)]


def test_decode_groups_share_scratch_across_groups_and_layers(monkeypatch):
    monkeypatch.setattr(torch_attention, "DECODE_GROUP_TOKENS", 48)  # several groups, the largest not first
    torch.manual_seed(0)
    blocks_per_seq = [-(-ctx // BLOCK_SIZE) for ctx, _ in BATCH]
    order = torch.randperm(sum(blocks_per_seq) + 3).tolist()
    tables = [[order.pop() for _ in range(n)] for n in blocks_per_seq]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([], dtype=torch.int64),
        block_tables=torch.tensor([t + [-1] * (max(blocks_per_seq) - len(t)) for t in tables]),
        context_lens=torch.tensor([ctx for ctx, _ in BATCH]),
        cu_seqlens_q=torch.tensor(list(accumulate([q for _, q in BATCH], initial=0))),
        cu_seqlens_k=torch.tensor(list(accumulate([ctx for ctx, _ in BATCH], initial=0))),
        max_seqlen_q=max(q for _, q in BATCH), max_seqlen_k=max(ctx for ctx, _ in BATCH),
    )
    scale = DIM**-0.5
    for _layer in range(3):  # the plan (and its scratch) is built by the first layer, reused by the others
        k_cache = torch.randn(len(order) + sum(blocks_per_seq), BLOCK_SIZE, KV_HEADS, DIM)
        v_cache = torch.randn_like(k_cache)
        qs = [torch.randn(q_len, HEADS, DIM) for _, q_len in BATCH]
        expected = [reference(q, k_cache[t].flatten(0, 1)[:ctx], v_cache[t].flatten(0, 1)[:ctx], scale)
                    for q, t, (ctx, _) in zip(qs, tables, BATCH)]
        out = torch_paged_attention(torch.cat(qs), k_cache, v_cache, meta, scale)
        torch.testing.assert_close(out.double(), torch.cat(expected), atol=1e-5, rtol=1e-5)
    assert len(meta.torch_plan.decode_groups) >= 3
    sizes = [len(block_ids) for _, block_ids, _ in meta.torch_plan.decode_groups]
    assert len(meta.torch_plan.k_scratch) == max(sizes) > min(sizes)
