"""LoRA's expand as a Triton kernel (punica's SGMV and BGMV, as vLLM's expand kernel), used on CUDA
in place of LoRALinear's PyTorch path, which multiplies every row by every slot's A and B and masks
out all but its own.

The shrink (h = x A) costs no launch of its own: every slot's A sits under the base layer's weight
as extra rows (LoRALinear.stacked_weight), so the base model's matmul, which reads x anyway, also
writes every slot's h in the columns past the base output's, rounded to the model's dtype as the
PyTorch path's h is. This kernel then adds y += h_slot B_slot * scaling to each row, reading its own
slot's r values of each part out of those columns, into the base output in place: one launch per
fused layer (qkv_proj: q, k, v), whatever its parts and adapters. A program computes one part's
column block (B holds a slot's parts side by side: [slots * r, out]).

Two ways to find a program's rows and slot (lora_kernel's GROUPED):
- grouped: the rows sorted by slot once per step (LoRARows.set: their indices, each slot's start and
  count), a program multiplies a tile of BLOCK_M rows of one slot by its weights with tl.dot;
- decode (one row per sequence, at most DECODE_ROWS rows): a program per row reads the row's own
  slot and multiplies it alone: no idle tile rows, no group to find.

Base-model rows (slot -1) are in no group and their decode programs return at once, so a CUDA graph
captured with LoRA on costs a base step almost nothing. Only shapes decide a launch, and the kernel
reads the rows and the scalings from LoRARows' static buffers: nothing waits for the GPU, and a
captured graph replays whatever the step copied into them. Under TRITON_INTERPRET=1 it runs on CPU
tensors (tests/test_lora_triton.py checks it against the PyTorch path).
"""
import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows per grouped program (tl.dot's minimum on a GPU)
# A decode of at most this many rows takes a program per row; a larger one is grouped too: a program
# per row reads its slot's weights once a row, a tile once per BLOCK_M rows (unmeasured on a GPU).
DECODE_ROWS = 16


@triton.jit
def lora_kernel(h_ptr, w_ptr, out_ptr, cols_ptr, order_ptr, starts_ptr, counts_ptr, slots_ptr,
                scaling_ptr, R, stride_h, stride_w, stride_slot, stride_out,
                NUM_PARTS: tl.constexpr, GROUPED: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PRECISION: tl.constexpr):  # "ieee": float32 exact; tensor cores round to tf32
    # Program (rows, column block, slot * NUM_PARTS + part; decode: part):
    # out[rows, part's columns] += h[rows, the slot's part's R values] @ B_slot[:, part's columns]
    # * scaling. h holds every slot's parts side by side (R values each); cols_ptr: each part's
    # first output column, and the end.
    pid_m, n_block, pid_2 = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    part = pid_2 % NUM_PARTS
    if GROUPED:  # BLOCK_M rows of one slot's group
        slot = pid_2 // NUM_PARTS
        count = tl.load(counts_ptr + slot)
        if pid_m * BLOCK_M >= count:  # the grid has room for all rows in one slot; most hold fewer
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < count
        rows = tl.load(order_ptr + tl.load(starts_ptr + slot) + offs_m, mask=m_mask, other=0)
        rows = rows.to(tl.int64)
    else:  # one row (BLOCK_M == 1), under its own slot
        slot = tl.load(slots_ptr + pid_m)
        if slot < 0:  # a base-model row, or a CUDA graph's padding
            return
        rows = pid_m + tl.arange(0, BLOCK_M).to(tl.int64)
        m_mask = rows >= 0
    col0 = tl.load(cols_ptr + part)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < tl.load(cols_ptr + part + 1) - col0
    h_ptr += (slot * NUM_PARTS + part) * R  # this row's slot's part: its R values of h
    w_ptr += slot.to(tl.int64) * stride_slot + col0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, R, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < R
        h = tl.load(h_ptr + rows[:, None] * stride_h + ks[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + ks[:, None] * stride_w + cols[None, :],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if GROUPED:
            acc = tl.dot(h, w, acc, input_precision=PRECISION)
        else:  # one row: a matrix-vector product, no tensor cores to feed
            acc += tl.sum(h.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], 1)
    out_ptrs = out_ptr + col0 + rows[:, None] * stride_out + cols[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    # y + (h B) * scaling, as the PyTorch path orders it
    acc = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + acc * tl.load(scaling_ptr + slot)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def add_lora(y_stacked: torch.Tensor, layer, rows) -> torch.Tensor:
    """The stacked matmul's output y_stacked [T, out + slots * parts * r] (the base output, then
    every slot's h) -> the base output, a view of its first columns, plus each adapter row's
    h_slot B_slot * scaling, every part of the fused layer (a LoRALinear) in one launch."""
    out_features = layer.part_offsets[-1]
    y, h = y_stacked[:, :out_features], y_stacked[:, out_features:]
    num_rows, num_parts, r = y.shape[0], len(layer.output_sizes), layer.max_rank
    if num_rows == 0:
        return y
    max_n = max(layer.output_sizes)
    block_n, block_k = (max(16, min(64, triton.next_power_of_2(size))) for size in (max_n, r))
    grouped = rows.path == "grouped" or num_rows > DECODE_ROWS  # (shapes alone: graphs capture it)
    n_blocks = triton.cdiv(max_n, block_n)
    grid = ((triton.cdiv(num_rows, BLOCK_M), n_blocks, rows.counts.shape[0] * num_parts) if grouped
            else (num_rows, n_blocks, num_parts))
    b = layer.lora_b
    lora_kernel[grid](h, b, y, layer.part_cols, rows.order, rows.starts, rows.counts, rows.slots,
                      rows.slot_scaling, r, h.stride(0), b.stride(0), r * b.stride(0), y.stride(0),
                      NUM_PARTS=num_parts, GROUPED=grouped, BLOCK_M=BLOCK_M if grouped else 1,
                      BLOCK_N=block_n, BLOCK_K=block_k,
                      PRECISION="ieee" if y.dtype == torch.float32 else "tf32")
    return y
