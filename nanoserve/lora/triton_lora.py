"""The batched LoRA matmuls as a Triton kernel (punica's SGMV and BGMV, as vLLM's shrink and expand kernels), used
on CUDA in place of LoRALinear's PyTorch path, which multiplies every row by every slot's A and masks out all but
its own. A fused layer (qkv_proj: q, k, v) costs two launches, whatever its parts and adapters:

- shrink: h = x A_slot, from the layer's input to the slot's rank-r space, every part at once (A holds a slot's
  parts side by side: [in, slots * parts * r]). A row's input is long (1,024 to 3,072 values in Qwen3-0.6B) and
  h is narrow, so a few programs would walk it alone: split-K, as vLLM's shrink, gives every SHRINK_K input
  values their own program, each writing its partial sums to its own slice of h ([splits, rows, parts * r],
  float32);
- expand: y += h_part B_slot * scaling, each part's r values into its columns of the base layer's output, in
  place; one program computes one part's column block (B holds a slot's parts side by side: [slots * r, out]).
  It adds h's partial sums up as it loads them (no launch for it), then rounds them to the model's dtype, as
  the PyTorch path's h is.

Two ways to find a program's rows and slot (lora_kernel's GROUPED):
- grouped: the rows sorted by slot once per step (LoRARows.set: their indices, each slot's start and count), a
  program multiplies a tile of BLOCK_M rows of one slot by its weights with tl.dot;
- decode (one row per sequence, at most DECODE_ROWS rows): a program per row reads the row's own slot and
  multiplies it alone: no idle tile rows, no group to find.

Base-model rows (slot -1) are in no group and their decode programs return at once, so a CUDA graph captured
with LoRA on costs a base step almost nothing. Only shapes decide a launch, and the kernel reads the rows and the
scalings from LoRARows' static buffers: nothing waits for the GPU, and a captured graph replays whatever the step
copied into them. Under TRITON_INTERPRET=1 it runs on CPU tensors (tests/test_lora_triton.py checks it against
the PyTorch path).
"""
import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows per grouped program (tl.dot's minimum on a GPU)
# A decode of at most this many rows takes a program per row; a larger one is grouped too: a program per row reads
# its slot's weights once a row, a tile once per BLOCK_M rows (unmeasured on a GPU yet).
DECODE_ROWS = 16
SHRINK_K = 256  # input values per shrink program (split-K; unmeasured on a GPU yet)


@triton.jit
def lora_kernel(x_ptr, w_ptr, out_ptr, cols_ptr, order_ptr, starts_ptr, counts_ptr, slots_ptr, scaling_ptr, K,
                stride_x, stride_w, stride_slot, stride_out, stride_split,
                NUM_PARTS: tl.constexpr, EXPAND: tl.constexpr, GROUPED: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT_K: tl.constexpr,  # h's slices: a shrink's programs per row's K values; an expand adds them up
                PRECISION: tl.constexpr):  # "ieee" keeps float32 matmuls exact; tensor cores round them to tf32
    # Program (rows, column block (shrink: and K split), slot * NUM_PARTS + part; decode: part): out[rows, part's
    # columns] (+)= x[rows, part's K values] @ W_slot[:, part's columns]. cols_ptr: each part's first output
    # column, and the end.
    pid_m, pid_1, pid_2 = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if EXPAND:  # a program per column block, over all of K (a rank's r values)
        n_block, k_split, k_step = pid_1, 0, BLOCK_K
    else:  # split-K: SPLIT_K programs per column block, each every SPLIT_K-th BLOCK_K of K, into its slice of h
        n_block, k_split, k_step = pid_1 // SPLIT_K, pid_1 % SPLIT_K, SPLIT_K * BLOCK_K
    part = pid_2 % NUM_PARTS
    if GROUPED:  # BLOCK_M rows of one slot's group
        slot = pid_2 // NUM_PARTS
        count = tl.load(counts_ptr + slot)
        if pid_m * BLOCK_M >= count:  # the grid has room for every row in one slot; most slots hold fewer
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < count
        rows = tl.load(order_ptr + tl.load(starts_ptr + slot) + offs_m, mask=m_mask, other=0).to(tl.int64)
    else:  # one row (BLOCK_M == 1), under its own slot
        slot = tl.load(slots_ptr + pid_m)
        if slot < 0:  # a base-model row, or a CUDA graph's padding
            return
        rows = pid_m + tl.arange(0, BLOCK_M).to(tl.int64)
        m_mask = rows >= 0
    col0 = tl.load(cols_ptr + part)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < tl.load(cols_ptr + part + 1) - col0
    x_ptr += part * K  # expand: this part's r values of h (a shrink has one part)
    w_ptr += slot.to(tl.int64) * stride_slot + col0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_split * BLOCK_K, K, k_step):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x_offs, x_mask = rows[:, None] * stride_x + ks[None, :], m_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0)
        w = tl.load(w_ptr + ks[:, None] * stride_w + cols[None, :], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if EXPAND:  # h, the shrink's partial sums added up (float32), rounded as the PyTorch path rounds h
            for s in tl.static_range(1, SPLIT_K):
                x += tl.load(x_ptr + s * stride_split + x_offs, mask=x_mask, other=0.0)
            x = x.to(w.dtype)
        if GROUPED:
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        else:  # one row: a matrix-vector product, no tensor cores to feed
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], 1)
    out_ptrs = out_ptr + k_split * stride_split + col0 + rows[:, None] * stride_out + cols[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if EXPAND:  # y + (h B) * scaling, as the PyTorch path orders it
        acc = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + acc * tl.load(scaling_ptr + slot)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cols: torch.Tensor, rows, max_n: int,
           stride_slot: int, expand: bool) -> None:
    """One shrink (x [T, in] into out, h: [splits, T, parts * r]) or expand (x, h, into out [T, out]) over the
    step's rows (rows: LoRARows, its static buffers); max_n: the widest part."""
    h = x if expand else out
    num_parts, num_rows, split_k = cols.shape[0] - 1, h.shape[1], h.shape[0]
    k = h.shape[2] // num_parts if expand else x.shape[1]
    block_n, block_k = (max(16, min(64, triton.next_power_of_2(size))) for size in (max_n, min(k, SHRINK_K)))
    grouped = rows.path == "grouped" or num_rows > DECODE_ROWS  # (shapes alone decide: graphs capture it)
    n_programs = triton.cdiv(max_n, block_n) * (1 if expand else split_k)
    grid = ((triton.cdiv(num_rows, BLOCK_M), n_programs, rows.counts.shape[0] * num_parts)
            if grouped else (num_rows, n_programs, num_parts))
    lora_kernel[grid](x, w, out, cols, rows.order, rows.starts, rows.counts, rows.slots, rows.slot_scaling, k,
                      x.stride(-2), w.stride(0), stride_slot, out.stride(-2), h.stride(0), NUM_PARTS=num_parts,
                      EXPAND=expand, GROUPED=grouped, BLOCK_M=BLOCK_M if grouped else 1, BLOCK_N=block_n,
                      BLOCK_K=block_k, SPLIT_K=split_k, PRECISION="ieee" if w.dtype == torch.float32 else "tf32")


def add_lora(x: torch.Tensor, y: torch.Tensor, layer, rows) -> None:
    """y += each adapter row's B(A(x)) * scaling, every part of the fused layer (a LoRALinear) in one shrink and one
    expand. x: [T, in], rows contiguous; y: [T, sum of outs], in place."""
    if x.shape[0] == 0:
        return
    r, num_parts = layer.max_rank, len(layer.output_sizes)
    # float32 partial sums, one slice per split of x's row (base rows: left unset)
    h = torch.empty(triton.cdiv(x.shape[1], SHRINK_K), x.shape[0], num_parts * r, dtype=torch.float32,
                    device=x.device)
    launch(x, layer.lora_a, h, layer.shrink_cols, rows, num_parts * r, num_parts * r, expand=False)
    launch(h, layer.lora_b, y, layer.part_cols, rows, max(layer.output_sizes), r * layer.lora_b.stride(0),
           expand=True)
