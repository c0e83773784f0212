"""attention_backend="torch", the one to read: paged attention in plain PyTorch, SDPA over K/V
blocks copied out of the cache. Imported only when chosen; the "cpu" backend (attention.py) walks
the blocks in place instead. `meta` is attention.py's AttentionMetadata."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # the largest finite float8 e4m3 value


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it. To fp8 (kv_cache_dtype="fp8"): saturated at +-448 as vLLM's kernels
    do (older PyTorch versions cast values past 480 to NaN), then rounded to the nearest e4m3
    value."""
    if dtype == torch.float8_e4m3fn:
        x = x.clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write this step's K/V into their slots; attention then reads everything from the cache."""
    for x, cache in ((k, k_cache), (v, v_cache)):
        x = to_cache_dtype(x, cache.dtype)
        if cache.dtype == torch.float8_e4m3fn:
            # PyTorch has no index_copy_ for float8: copy the bytes
            cache, x = cache.view(torch.uint8), x.view(torch.uint8)
        cache.view(-1, *x.shape[1:]).index_copy_(0, slot_mapping, x)


# The PyTorch path batches decoding sequences until a group's padded context reaches this many
# tokens: enough to amortize the per-call cost, few enough that the K/V it copies out stays in the
# CPU's cache.
DECODE_GROUP_TOKENS = 4096


@dataclass
class TorchAttentionPlan:
    """How torch_paged_attention splits a batch; the same for every layer, so built once per
    step."""

    # (rows, block_ids, padding mask)
    decode_groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    # (start, end, block_ids, len, mask)
    prefills: list[tuple[int, int, torch.Tensor, int, torch.Tensor | None]]
    # Where every group of every layer copies its K/V blocks to: a fresh multi-MB tensor per copy
    # costs the CPU new zeroed pages each time, which doubled the decode attention's time.
    k_scratch: torch.Tensor
    v_scratch: torch.Tensor


def plan_torch_attention(meta, k_cache: torch.Tensor, window: int = 0) -> TorchAttentionPlan:
    """A sequence with one new token (a decode) joins a group of sequences of similar context
    length: sorted by length, so padding a group to its longest wastes little. A sequence with
    several new tokens (a prefill) gets its own causal SDPA call over exactly its context.
    window > 0: a token sees only the last `window` positions."""
    dev, block_size = meta.block_tables.device, k_cache.shape[1]
    starts, q_lens = meta.cu_seqlens_q[:-1].tolist(), meta.cu_seqlens_q.diff().tolist()
    context_lens = meta.context_lens.tolist()
    plan = TorchAttentionPlan([], [], k_scratch=k_cache[:0], v_scratch=k_cache[:0])
    decodes = sorted((i for i, n in enumerate(q_lens) if n == 1), key=lambda i: context_lens[i])
    while decodes:
        # grow the group while its padded size (n sequences x the longest context) fits the budget
        n = 1
        while n < len(decodes) and (n + 1) * context_lens[decodes[n]] <= DECODE_GROUP_TOKENS:
            n += 1
        seqs, decodes = decodes[:n], decodes[n:]
        num_blocks = -(-context_lens[seqs[-1]] // block_size)  # (ceiling division)
        # -1 padding: masked out
        block_ids = meta.block_tables[seqs, :num_blocks].flatten().clamp(min=0)
        positions = torch.arange(num_blocks * block_size, device=dev)
        context = meta.context_lens[seqs, None]
        mask = (positions < context) & (positions >= context - window if window else True)
        # each sequence's row in the flat batch
        rows = torch.tensor([starts[i] for i in seqs], device=dev)
        plan.decode_groups.append((rows, block_ids, mask[:, None, None, :]))
    for i, (start, q_len, context_len) in enumerate(zip(starts, q_lens, context_lens)):
        if q_len > 1:
            # Causal, aligned bottom-right: the new tokens come after context_len - q_len cached
            # ones. windowed: some key lies `window` or more positions back: masked
            windowed = window and context_len > window
            mask = None if q_len == context_len and not windowed else torch.ones(
                q_len, context_len, dtype=torch.bool, device=dev).tril(context_len - q_len).triu(
                # (-q_len: no lower bound)
                context_len - q_len - window + 1 if windowed else -q_len)
            block_ids = meta.block_tables[i, : -(-context_len // block_size)]
            plan.prefills.append((start, start + q_len, block_ids, context_len, mask))
    max_blocks = max((len(block_ids) for _, block_ids, _ in plan.decode_groups), default=0)
    plan.k_scratch, plan.v_scratch = (k_cache.new_empty(max_blocks, *k_cache.shape[1:])
                                      for _ in range(2))
    return plan


def torch_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta, scale: float, window: int = 0) -> torch.Tensor:
    """Pure-PyTorch paged attention: copy each sequence's KV blocks out of the cache, then run SDPA
    on them. An fp8 cache's copies are converted to q's dtype (.to() is a no-op otherwise)."""
    name = "torch_window_plan" if window else "torch_plan"
    if getattr(meta, name) is None:
        setattr(meta, name, plan_torch_attention(meta, k_cache, window))
    plan, (kv_heads, head_dim) = getattr(meta, name), k_cache.shape[2:]
    out = torch.empty_like(q)
    for rows, block_ids, mask in plan.decode_groups:
        # [n, kv_heads, padded context, head_dim]; index_select copies whole blocks into the step's
        # scratch.
        k = torch.index_select(k_cache, 0, block_ids, out=plan.k_scratch[: len(block_ids)])
        v = torch.index_select(v_cache, 0, block_ids, out=plan.v_scratch[: len(block_ids)])
        k, v = (x.to(q.dtype).view(len(rows), -1, kv_heads, head_dim).transpose(1, 2)
                for x in (k, v))
        # GQA: the query heads that share a KV head become its rows of queries, so each key is read
        # once.
        o = F.scaled_dot_product_attention(q[rows].view(len(rows), kv_heads, -1, head_dim), k, v,
                                           attn_mask=mask, scale=scale)
        # (CUDA's SDPA may return another memory layout)
        out[rows] = o.reshape(len(rows), -1, head_dim)
    for start, end, block_ids, context_len, mask in plan.prefills:
        # [1, kv_heads, context_len, head_dim] (4-D: SDPA's fast CPU kernel needs a batch dimension)
        k, v = (cache.index_select(0, block_ids).flatten(0, 1)[:context_len].to(q.dtype)
                .transpose(0, 1).unsqueeze(0) for cache in (k_cache, v_cache))
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1).unsqueeze(0), k, v,
                                           attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out
