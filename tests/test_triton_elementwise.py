"""elementwise_backend="triton" (layers/triton_elementwise.py): RMSNorm with its residual add, Qwen3's per-head q/k
norms, SwiGLU's gate and RoPE as one Triton kernel each equal the modules' own PyTorch forwards, in float32 (and in
bfloat16 on a GPU, rounded where PyTorch rounds), and the engine with them gives transformers' greedy tokens. On CPU
through Triton's interpreter (conftest.py sets TRITON_INTERPRET=1), natively where CUDA is available."""
import pytest
import torch

from conftest import ARCHS, ROOMY_POOL, hf_greedy, random_prompts
from nanoserve import LLM, SamplingParams
from nanoserve.config import Config
from nanoserve.layers.activation import SiluAndMul
from nanoserve.layers.layernorm import RMSNorm
from nanoserve.layers.rotary_embedding import RotaryEmbedding
from nanoserve.utils.backends import pick_elementwise_backend

pytest.importorskip("triton")
TRITON_FORWARDS = pytest.importorskip("nanoserve.layers.triton_elementwise").TRITON_FORWARDS
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32: the sum of squares is added in another order; bfloat16: that, and a rounding it may tip.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
# bfloat16 only on a GPU: Triton's interpreter (3.9) rounds down-casts by cutting the mantissa without carrying
# into the exponent (1.999 -> 1.0), so its bfloat16 results are not the GPU's.
DTYPES = [torch.float32] + [torch.bfloat16] * torch.cuda.is_available()


def triton(module, *args):
    return TRITON_FORWARDS[type(module)](module, *args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [0, 1, 7])
@pytest.mark.parametrize("size", [40, 64])  # 40: not a power of two (the kernel pads and masks)
def test_rms_norm_equals_pytorch(dtype, tokens, size):
    gen = torch.Generator().manual_seed(tokens * 1000 + size)
    norm = RMSNorm(size, eps=1e-5).to(DEVICE, dtype)
    norm.weight.data = torch.randn(size, generator=gen).to(DEVICE, dtype)
    x, residual = (torch.randn(tokens, size, generator=gen).to(DEVICE, dtype) for _ in range(2))
    x_before, residual_before = x.clone(), residual.clone()
    torch.testing.assert_close(triton(norm, x), norm(x), **TOLERANCE[dtype])
    (out, summed), (ref_out, ref_summed) = triton(norm, x, residual), norm(x, residual)
    torch.testing.assert_close(out, ref_out, **TOLERANCE[dtype])
    assert torch.equal(summed, ref_summed)  # the next residual: one add, rounded once, the same bits
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs untouched
    # Per-head norms (Qwen3's q_norm) on a view of the fused qkv output: rows of a strided [tokens, heads, size].
    qkv = torch.randn(tokens, 5 * size, generator=gen).to(DEVICE, dtype)
    q = qkv[:, size : 4 * size].view(tokens, 3, size)
    torch.testing.assert_close(triton(norm, q), norm(q), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [0, 1, 7])
@pytest.mark.parametrize("width", [40, 3072])  # 3072: several programs per row
def test_silu_and_mul_equals_pytorch(dtype, tokens, width):
    x = (torch.randn(tokens, width, generator=torch.Generator().manual_seed(tokens + width)) * 4).to(DEVICE, dtype)
    torch.testing.assert_close(triton(SiluAndMul(), x), SiluAndMul()(x), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [0, 1, 7])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (24, 4, 2)])  # 24: a half of 12, padded to 16
def test_rotary_embedding_equals_pytorch(dtype, tokens, head_dim, heads, kv_heads):
    gen = torch.Generator().manual_seed(tokens + head_dim)
    rope = RotaryEmbedding(head_dim, max_position=2048, base=10000.0).to(DEVICE, dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # q and k: views, as in the model
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 2048, (tokens,), generator=gen).to(DEVICE)
    for got, want in zip(triton(rope, positions, q, k), rope(positions, q, k)):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_equals_transformers(tiny_models, arch):
    prompts = random_prompts(3, seed=5, low=1, high=30)
    llm = LLM(tiny_models[arch], dtype="float32", attention_backend="torch", elementwise_backend="triton",
              **ROOMY_POOL)  # not a pool sized from the free memory other test workers hold on a GPU
    modules = [m for m in llm.engine.executor.model_runner.model.modules() if type(m) in TRITON_FORWARDS]
    assert {type(m) for m in modules} == {RMSNorm, SiluAndMul, RotaryEmbedding}
    assert all(m.forward.__func__ is TRITON_FORWARDS[type(m)] for m in modules)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(tiny_models[arch], prompts, 8)


def test_backend_choice(tiny_models, monkeypatch):
    path = tiny_models["llama"]
    with pytest.raises(ValueError, match="elementwise_backend must be one of"):
        Config(path, elementwise_backend="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="elementwise_backend='triton' on device 'cpu' needs Triton's interpreter"):
        Config(path, device="cpu", elementwise_backend="triton")
    assert pick_elementwise_backend("auto", "cuda", "bfloat16") == "triton"
