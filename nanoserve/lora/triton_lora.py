"""The batched LoRA matmuls as a Triton kernel (punica's SGMV, as vLLM's shrink and expand kernels), used on CUDA in
place of LoRALinear's PyTorch path, which multiplies every row by every slot's A and masks out all but its own.
Here the step's rows are grouped by slot once (group_rows: their indices sorted by slot, with each slot's start
and count; base-model rows are in no group), and a program multiplies a tile of one slot's rows, gathered by
index, by that slot's weights alone:

- shrink: h = x A_slot^T, from the layer's input to the slot's rank-r space, for each part (q, k, v of qkv_proj);
- expand: y += h B_slot^T * scaling, into the part's columns of the base layer's output, in place.

One kernel does both (sgmv_kernel). Under TRITON_INTERPRET=1 it runs on CPU tensors (tests/test_lora_triton.py
checks it against the PyTorch path). Nothing waits for the GPU: the groups are computed on the device.
"""
import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows per program (tl.dot's minimum on a GPU)


@triton.jit
def sgmv_kernel(x_ptr, w_ptr, out_ptr, rows_ptr, starts_ptr, counts_ptr, scaling_ptr, K, N,
                stride_x, stride_w, stride_slot, stride_out,
                EXPAND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PRECISION: tl.constexpr):  # "ieee" keeps float32 matmuls exact; tensor cores round them to tf32
    # Program (tile, column block, slot): out[rows] = x[rows] @ W_slot for BLOCK_M rows of the slot's group, with
    # W_slot [K, N] at w_ptr + slot * stride_slot; EXPAND: out[rows] += that * each row's scaling instead.
    tile, n_block, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(counts_ptr + slot)
    if tile * BLOCK_M >= count:  # the grid has room for every row in one slot; most slots hold fewer
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    rows = tl.load(rows_ptr + tl.load(starts_ptr + slot) + offs_m, mask=m_mask, other=0).to(tl.int64)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < N
    w_ptr += slot.to(tl.int64) * stride_slot
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + ks[:, None] * stride_w + cols[None, :], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    out_ptrs = out_ptr + rows[:, None] * stride_out + cols[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if EXPAND:  # y + (h B^T) * scaling, as the PyTorch path orders it
        scaling = tl.load(scaling_ptr + rows, mask=m_mask, other=0.0).to(tl.float32)
        acc = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + acc * scaling[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def group_rows(row_slots: torch.Tensor, max_loras: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's slot (-1: the base model) -> (the row indices sorted by slot, each slot's first place among
    them, each slot's count), computed on the device (no wait for it)."""
    order = torch.argsort(row_slots, stable=True)  # base rows (-1) first
    counts = (row_slots == torch.arange(max_loras, device=row_slots.device)[:, None]).sum(1)
    starts = (row_slots < 0).sum() + torch.cumsum(counts, 0) - counts
    return order, starts, counts


def sgmv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, groups: tuple, scaling: torch.Tensor, k: int, n: int,
         stride_slot: int, expand: bool) -> None:
    rows, starts, counts = groups
    block_n, block_k = (max(16, min(64, triton.next_power_of_2(size))) for size in (n, k))
    grid = (triton.cdiv(x.shape[0], BLOCK_M), triton.cdiv(n, block_n), counts.shape[0])
    sgmv_kernel[grid](x, w, out, rows, starts, counts, scaling, k, n, x.stride(0), w.stride(0), stride_slot,
                      out.stride(0), EXPAND=expand, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
                      PRECISION="ieee" if x.dtype == torch.float32 else "tf32")


def add_lora(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: list[torch.Tensor], groups: tuple,
             scaling: torch.Tensor, max_loras: int, max_rank: int) -> None:
    """y += each grouped row's B(A(x)) * scaling, part by part, in place (LoRALinear's slots: lora_a
    [in, parts * slots * r], lora_b[part] [slots * r, out]). x: [T, in], rows contiguous; y: [T, sum of outs]."""
    if x.shape[0] == 0:
        return
    h = torch.empty(x.shape[0], len(lora_b) * max_rank, dtype=x.dtype, device=x.device)  # base rows: left unset
    offset = 0
    for part, b in enumerate(lora_b):
        a = lora_a[:, part * max_loras * max_rank:]  # this part's slots, side by side: slot s at columns s * r
        sgmv(x, a, h[:, part * max_rank:], groups, scaling, x.shape[1], max_rank, max_rank, expand=False)
        sgmv(h[:, part * max_rank:], b, y[:, offset:], groups, scaling, max_rank, b.shape[1], max_rank * b.stride(0),
             expand=True)
        offset += b.shape[1]
