"""Paged attention in Triton: the GPU path that needs no flash-attn, and a lesson in how paged
kernels work.

Two kernels, with the same contract as `torch_paged_attention` (torch_attention.py):

1. `store_kvcache_kernel` writes this step's K and V into the paged cache: one program per new
   token, which copies the token's kv_heads x head_dim values to the cache slot that `slot_mapping`
   names.
2. `paged_attention_kernel` computes attention for every sequence of the batch straight out of the
   cache. There is no separate decode kernel: a decode is a prefill of one query token. (vLLM's
   Triton backend, "unified attention", makes the same choice.) That one kernel serves fresh
   prompts, prefix-cache hits, chunks of a chunked prefill, decodes, and the mixed batches of the
   token-budget policy.

Triton runs each kernel as a grid of independent program instances; each one computes one tile of
the output with block-wide vector operations. Under `TRITON_INTERPRET=1` the same code runs on CPU
tensors through NumPy, one program after another (slowly): that is how the tests check these kernels
on a machine without a GPU. `triton.jit` reads that variable when a kernel is defined, i.e. when
this module is first imported.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def to_cache(x, cache_ptr, FP8: tl.constexpr):
    """x as the cache stores it: an fp8 cache's values saturate at +-448 (FP8_MAX in
    torch_attention.py), then round."""
    if FP8:
        x = tl.clamp(x.to(tl.float32), -448.0, 448.0)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def store_kvcache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                         stride_k, stride_v, stride_slot, KV_SIZE: tl.constexpr,
                         KV_SIZE_PAD: tl.constexpr, FP8: tl.constexpr):
    token = tl.program_id(0)
    # block_id * block_size + offset, computed by the model runner
    slot = tl.load(slot_mapping_ptr + token)
    offs = tl.arange(0, KV_SIZE_PAD)  # tl.arange needs a power of two: pad and mask
    mask = offs < KV_SIZE
    k = to_cache(tl.load(k_ptr + token * stride_k + offs, mask=mask), k_cache_ptr, FP8)
    v = to_cache(tl.load(v_ptr + token * stride_v + offs, mask=mask), v_cache_ptr, FP8)
    tl.store(k_cache_ptr + slot * stride_slot + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * stride_slot + offs, v, mask=mask)


def triton_store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, kv_heads, head_dim], each token's values contiguous (rows may be strided
    views). The caches: the model's dtype, or float8 e4m3 (kv_cache_dtype="fp8")."""
    k, v = k.flatten(1), v.flatten(1)
    kv_size = k.shape[1]
    store_kvcache_kernel[(k.shape[0],)](k, v, k_cache, v_cache, slot_mapping, k.stride(0),
                                        v.stride(0), k_cache.stride(1), kv_size,
                                        triton.next_power_of_2(kv_size),
                                        FP8=k_cache.dtype == torch.float8_e4m3fn)


@triton.jit
def paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, cu_seqlens_q_ptr,
    scale_log2e, stride_qt, stride_qh, stride_ot, stride_oh, stride_slot, stride_kvh, stride_bt,
    # > 0: each token sees only the last `window` positions (sliding-window attention); 0: all
    window,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block (a power of two)
    # query heads per KV head (GQA), and rounded up to a power of 2
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,  # keys per step of the loop
    PRECISION: tl.constexpr,  # "ieee" keeps float32 matmuls exact; tensor cores round them to tf32
):
    # Program (seq, q_block, kv_head) computes the outputs of BLOCK_Q new tokens of one sequence for
    # the GROUP query heads that share one KV head. Those BLOCK_Q x GROUP_PAD query vectors become
    # the rows of one tile, so each key and value is read once per KV head, not once per query head.
    seq, q_block, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:  # the grid is sized for the longest query in the batch
        return
    # cached tokens + this step's, all already in the cache
    context_len = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    # which new token of the sequence a row belongs to
    token = q_block * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD  # and which query head
    row_ok = (token < q_len) & (rows % GROUP_PAD < GROUP)
    # Causal, aligned bottom-right: the q_len new tokens are the last ones of the context, so new
    # token i sits at position context_len - q_len + i and sees the keys at positions up to that
    # one.
    pos = context_len - q_len + token
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_offs = (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    # fp8 converts to float16 in one instruction, to bfloat16 in two (through float16): a bfloat16
    # model's dots over an fp8 cache run in float16 (benchmarks/ptx_census.py counts them).
    FP8: tl.constexpr = v_cache_ptr.dtype.element_ty.is_fp8()
    if FP8 and q.dtype == tl.bfloat16:
        q = q.to(tl.float16)
    # An fp8 cache's V is read as 16-bit pairs, dims 2i and 2i + 1 of a key (HEAD_DIM is even),
    # and its even and odd dims are multiplied apart: acc holds the even ones, acc_odd the odd
    # ones, joined at the end. Triton then converts V before it goes to shared memory, so V
    # reaches the tensor cores as 16-bit values (ldmatrix.trans), not one byte at a time
    # (benchmarks/ptx_census.py counts them).

    # Online softmax (flash attention): walk the context BLOCK_N keys at a time and keep, per row,
    # the running max m_i, the running sum l_i of exp(score - m_i) and the running output acc. When
    # a larger max turns up, the old l_i and acc are rescaled by exp(old m_i - new m_i). So the
    # scores of a whole row never have to sit in memory at once, and K/V are read once, whatever the
    # context length.
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD // (2 if FP8 else 1)], dtype=tl.float32)
    acc_odd = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD // 2], dtype=tl.float32)  # (fp8 only)
    # Keys after this program's last query position are masked for every row: don't even load them.
    num_keys = tl.minimum(context_len, context_len - q_len + (q_block + 1) * BLOCK_Q)
    # With a window, keys before the first row's window are masked for every row too: start at its
    # tile.
    first_key = tl.where(window > 0,
                         tl.maximum(context_len - q_len + q_block * BLOCK_Q - window + 1, 0), 0)
    for start in range(first_key // BLOCK_N * BLOCK_N, num_keys, BLOCK_N):
        key = start + tl.arange(0, BLOCK_N)  # positions in the sequence
        # Paging: position p lives in block block_table[p // BLOCK_SIZE] at offset p % BLOCK_SIZE,
        # the same arithmetic that built slot_mapping. A tile may span several blocks, scattered
        # anywhere in the cache.
        block_id = tl.load(block_tables_ptr + seq * stride_bt + key // BLOCK_SIZE,
                           mask=key < num_keys, other=0)
        slot = block_id.to(tl.int64) * BLOCK_SIZE + key % BLOCK_SIZE
        kv_offs = slot[:, None] * stride_slot + kv_head * stride_kvh + dims[None, :]
        kv_mask = (key < num_keys)[:, None] & dim_ok[None, :]
        # [BLOCK_N, HEAD_DIM_PAD], an fp8 cache's converted to q's dtype as they arrive: half of
        # bfloat16's bytes read
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
        if FP8:  # V: [BLOCK_N, HEAD_DIM_PAD // 2] pairs, each byte bitcast to e4m3, then converted
            pairs = tl.arange(0, HEAD_DIM_PAD // 2)
            pair_offs = (slot[:, None] * stride_slot + kv_head * stride_kvh) // 2 + pairs[None, :]
            pair_mask = (key < num_keys)[:, None] & (pairs < HEAD_DIM // 2)[None, :]
            v_pairs = tl.load(v_cache_ptr.to(tl.pointer_type(tl.int16)) + pair_offs, mask=pair_mask,
                              other=0)
            v = v_pairs.to(tl.int8).to(tl.float8e4nv, bitcast=True).to(q.dtype)  # the even dims
            v_odd = (v_pairs >> 8).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(q.dtype)
        else:
            v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
        # Scores in base 2 (exp2 is the GPU's native exponential): s * log2(e) * scale.
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e
        in_window = (key[None, :] > pos[:, None] - window) | (window == 0)
        visible = (key[None, :] <= pos[:, None]) & in_window
        # causal (and window) mask; also hides key >= num_keys
        s = tl.where(visible, s, float("-inf"))
        # A row may see no key of a tile yet (its window starts later): its max stays -inf, and
        # exp2(-inf - -inf) would be NaN, so such a row subtracts 0 instead (its terms are
        # exp2(-inf) = 0).
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)  # rescales what was accumulated under the old max
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        if FP8:
            pv_odd = tl.dot(p.to(v.dtype), v_odd, input_precision=PRECISION)
            acc_odd = acc_odd * alpha[:, None] + pv_odd
        m_i = m_new
    if FP8:  # dims 2i and 2i + 1 side by side again
        acc = tl.reshape(tl.join(acc, acc_odd), [BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD])
    # A padding row of a CUDA graph has no context at all (l_i = 0): write zeros there, not 0/0.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_offs = (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


# Keys per step of the loop, whatever the cache's dtype: on an H200, 128 keys a step from an fp8
# cache (as many bytes a load as bfloat16's 64) took 0.395 ms a call against 64's 0.384
# (benchmarks/paged_attention.py --block-n).
BLOCK_N = 64


def triton_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                           scale: float, window: int = 0) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim].

    Only shapes and Python ints decide the launch: nothing waits for the GPU, so CUDA graphs can
    capture it.
    """
    num_heads, head_dim = q.shape[1:]
    block_size, kv_heads = k_cache.shape[1:3]
    group = num_heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    # Enough query tokens to fill a tile of 64 rows, but at least 16 rows (tl.dot's minimum on a
    # GPU): a decode batch gets one token per program, with GQA's heads as its rows.
    block_q = max(min(triton.next_power_of_2(meta.max_seqlen_q), 64 // group_pad),
                  16 // group_pad, 1)
    head_dim_pad = triton.next_power_of_2(head_dim)
    if v_cache.dtype == torch.float8_e4m3fn:  # V read in pairs of values, half of the dims a dot
        if head_dim % 2:
            raise ValueError(f"an fp8 KV cache needs an even head_dim, got {head_dim}")
        head_dim_pad = max(head_dim_pad, 32)  # (tl.dot's 16 columns at least, on a GPU)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    grid = (meta.context_lens.shape[0], triton.cdiv(meta.max_seqlen_q, block_q), kv_heads)
    # No split over the context ("split-K", "flash-decoding"): a decode batch of 256 sequences x 8
    # KV heads already gives a GPU thousands of programs. It would pay for a few very long
    # sequences, at extra cost.
    paged_attention_kernel[grid](
        out, q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.cu_seqlens_q,
        scale * 1.4426950408889634, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0), window,
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, BLOCK_Q=block_q, BLOCK_N=BLOCK_N,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
