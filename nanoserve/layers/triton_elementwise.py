"""The elementwise chains between the matmuls as one Triton kernel each:
elementwise_backend="triton", the default on CUDA. Eager PyTorch runs RMSNorm as 6 to 8 kernels (the
residual add, a float32 copy, pow, mean, add, rsqrt, two multiplies, a copy back), each reading and
writing every activation; a decode step of a 28-layer model launched about 1,000 such small kernels.
Here each chain reads its inputs once and writes its outputs once.

Each kernel rounds where its PyTorch version does (layers/layernorm.py, activation.py,
rotary_embedding.py): in bfloat16 the residual sum, the normalized x and silu(gate) are rounded to
bfloat16 before the next multiply, as there, so the only difference left is the order of the float32
sum of squares. Under TRITON_INTERPRET=1 the same kernels run on CPU tensors
(tests/test_triton_elementwise.py). Only shapes decide a launch: CUDA graphs capture them.
"""
import torch
import triton
import triton.language as tl

from nanoserve.layers.activation import SiluAndMul
from nanoserve.layers.layernorm import RMSNorm
from nanoserve.layers.rotary_embedding import RotaryEmbedding


@triton.jit
def rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, eps, stride_token,
                    stride_head, heads, SIZE: tl.constexpr, SIZE_PAD: tl.constexpr,
                    HAS_RESIDUAL: tl.constexpr):
    # One program per row: row = token * heads + head (heads = 1 for the hidden state, the heads of
    # q or k for Qwen3's per-head q_norm and k_norm, read in place in the fused qkv output).
    row = tl.program_id(0)
    cols = tl.arange(0, SIZE_PAD)
    mask = cols < SIZE
    x_row = (row // heads).to(tl.int64) * stride_token + (row % heads) * stride_head
    x = tl.load(x_ptr + x_row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # x + residual, rounded to the model's dtype: this norm's input, and the next residual
        residual = tl.load(residual_ptr + row * SIZE + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32))
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * SIZE + cols, x, mask=mask)
    x = x.to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / SIZE + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # weight * x.to(dtype), as Hugging Face
    out = normed.to(out_ptr.dtype.element_ty).to(tl.float32) * weight
    tl.store(out_ptr + row * SIZE + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def triton_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [tokens, size], or [tokens, heads, size] with rows contiguous (a strided view is fine).
    Returns the normalized rows (contiguous, x's shape) and, with residual ([tokens, size]),
    x + residual."""
    x3 = x.unsqueeze(1) if x.dim() == 2 else x
    tokens, heads, size = x3.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = None if residual is None else torch.empty_like(out)
    if residual is not None:
        residual = residual.contiguous()
    if tokens * heads:
        rms_norm_kernel[(tokens * heads,)](x3, residual, weight, out, summed, eps, x3.stride(0),
                                           x3.stride(1), heads, SIZE=size,
                                           SIZE_PAD=triton.next_power_of_2(size),
                                           HAS_RESIDUAL=residual is not None)
    return out, summed


@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, stride_x, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    # Program (token, block of columns): silu(gate) * up on the fused [gate | up] row.
    token, start = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK
    cols = start + tl.arange(0, BLOCK)
    mask = cols < WIDTH
    gate = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_x + WIDTH + cols, mask=mask, other=0.0).to(tl.float32)
    # F.silu rounds, then * up
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + token * WIDTH + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def triton_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [tokens, 2 * width], rows contiguous. Returns silu(x[:, :width]) * x[:, width:]."""
    width = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], width, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(width))
    if x.shape[0]:
        silu_and_mul_kernel[(x.shape[0], triton.cdiv(width, block))](x, out, x.stride(0),
                                                                     WIDTH=width, BLOCK=block)
    return out


@triton.jit
def rotary_embedding_kernel(positions_ptr, x_ptr, out_ptr, cos_sin_ptr, stride_token, stride_head,
                            heads, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                            HEADS_PAD: tl.constexpr):
    # Program per token: every head of q (or k) rotated by the token's angles, read from the
    # cos | sin table row.
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    h, d = tl.arange(0, HEADS_PAD)[:, None], tl.arange(0, HALF_PAD)[None, :]
    mask = (h < heads) & (d < HALF)
    cos = tl.load(cos_sin_ptr + pos * 2 * HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * 2 * HALF + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    x = x_ptr + token * stride_token + h * stride_head + d
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
    out = out_ptr + (token * heads + h) * 2 * HALF + d
    tl.store(out, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


def triton_rotary_embedding(positions: torch.Tensor, x: torch.Tensor,
                            cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim], rows contiguous (a view of the fused qkv output is fine).
    Returns x rotated."""
    tokens, heads, head_dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if tokens:
        rotary_embedding_kernel[(tokens,)](positions, x, out, cos_sin_cache, x.stride(0),
                                           x.stride(1), heads, HALF=head_dim // 2,
                                           HALF_PAD=triton.next_power_of_2(head_dim // 2),
                                           HEADS_PAD=triton.next_power_of_2(heads))
    return out


# The modules' forwards on these kernels (selector.use_elementwise_backend binds them).
def rms_norm_triton(self: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None):
    out, summed = triton_rms_norm(x, residual, self.weight, self.eps)
    return out if residual is None else (out, summed)


def silu_and_mul_triton(self: SiluAndMul, x: torch.Tensor) -> torch.Tensor:
    return triton_silu_and_mul(x)


def rotary_embedding_triton(self: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor,
                            k: torch.Tensor):
    return (triton_rotary_embedding(positions, q, self.cos_sin_cache),
            triton_rotary_embedding(positions, k, self.cos_sin_cache))


TRITON_FORWARDS = {RMSNorm: rms_norm_triton, SiluAndMul: silu_and_mul_triton,
                   RotaryEmbedding: rotary_embedding_triton}
