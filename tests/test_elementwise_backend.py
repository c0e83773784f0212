"""The elementwise backends (layers/elementwise_backend.py): RMSNorm with its residual add, SwiGLU's gate and RoPE
as C++ loops ("cpu", the default on the CPU in float32) or compiled ("compile") equal the modules' own PyTorch
forwards ("torch") on every shape, and give the same greedy tokens as transformers."""
import importlib.util

import pytest
import torch

from conftest import ARCHS, ROOMY_POOL, hf_greedy, random_prompts
from nanoserve import LLM, SamplingParams
from nanoserve.config import Config
from nanoserve.layers.activation import SiluAndMul
from nanoserve.layers.elementwise_backend import CPU_FORWARDS
from nanoserve.layers.layernorm import RMSNorm
from nanoserve.layers.rotary_embedding import RotaryEmbedding
from nanoserve.layers.torch_compile import compiled_forward
from nanoserve.utils.backends import pick_elementwise_backend
from nanoserve.utils.cpu_kernel import load_cpu_kernel

KERNEL = load_cpu_kernel("elementwise_cpu")
needs_kernel = pytest.mark.skipif(isinstance(KERNEL, str), reason=f"no kernel: {KERNEL}")
MAX_TOKENS = 24


def cpu(module, *args):
    return CPU_FORWARDS[type(module)](module, *args)


@needs_kernel
@pytest.mark.parametrize("tokens", [0, 1, 7, 64, 300])
@pytest.mark.parametrize("size", [40, 64, 576])  # 40: not a whole number of vectors (AVX2 holds 8, AVX-512 16)
def test_rms_norm_equals_pytorch(tokens, size):
    gen = torch.Generator().manual_seed(tokens * 1000 + size)
    norm = RMSNorm(size, eps=1e-5)
    norm.weight.data = torch.randn(size, generator=gen)
    x, residual = torch.randn(tokens, size, generator=gen), torch.randn(tokens, size, generator=gen)
    x_before, residual_before = x.clone(), residual.clone()
    torch.testing.assert_close(cpu(norm, x), norm(x), atol=1e-5, rtol=1e-5)
    (out, summed), (ref_out, ref_summed) = cpu(norm, x, residual), norm(x, residual)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(summed, ref_summed)  # the next residual: one add, the same bits
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs untouched
    # Per-head norms (Qwen3's q_norm) on a view of the fused qkv output: rows of a strided [tokens, heads, size].
    qkv = torch.randn(tokens, 5 * size, generator=gen)
    q = qkv[:, size : 4 * size].view(tokens, 3, size)
    torch.testing.assert_close(cpu(norm, q), norm(q), atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("tokens", [0, 1, 7, 64, 300])
@pytest.mark.parametrize("width", [40, 3072])
def test_silu_and_mul_equals_pytorch(tokens, width):
    x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(tokens + width)) * 4
    torch.testing.assert_close(cpu(SiluAndMul(), x), SiluAndMul()(x), atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("tokens", [0, 1, 7, 64, 300])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (24, 4, 2), (16, 2, 2)])
def test_rotary_embedding_equals_pytorch(tokens, head_dim, heads, kv_heads):
    gen = torch.Generator().manual_seed(tokens + head_dim)
    rope = RotaryEmbedding(head_dim, max_position=2048, base=10000.0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)  # q and k: views, as in the model
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 2048, (tokens,), generator=gen)
    for got, want in zip(cpu(rope, positions, q, k), rope(positions, q, k)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", [pytest.param("cpu", marks=needs_kernel), "compile"])
@pytest.mark.parametrize("arch", ARCHS)
def test_backend_equals_transformers(tiny_models, arch, backend):
    # Prompts of 1 to 40 tokens: prefill batches, decode batches, and a batch of one token (Dynamo specializes 1).
    prompts = random_prompts(6, seed=5, low=1, high=40)
    llm = LLM(tiny_models[arch], block_size=16, elementwise_backend=backend, **ROOMY_POOL)
    model = llm.engine.executor.model_runner.model
    modules = [m for m in model.modules() if type(m) in CPU_FORWARDS]
    assert {type(m) for m in modules} == {RMSNorm, SiluAndMul, RotaryEmbedding}
    want = CPU_FORWARDS if backend == "cpu" else {cls: compiled_forward(cls) for cls in CPU_FORWARDS}
    assert all(m.forward.__func__ is want[type(m)] for m in modules)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(tiny_models[arch], prompts, MAX_TOKENS)
    one = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert one[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids


@needs_kernel
def test_draft_model_gets_the_backend_too(tiny_models):
    path = tiny_models["qwen3"]
    llm = LLM(path, block_size=16, **ROOMY_POOL,
              speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 2})
    runner = llm.engine.executor.model_runner
    for model in (runner.model, runner.draft_model):
        modules = [m for m in model.modules() if type(m) in CPU_FORWARDS]
        assert modules and all(m.forward.__func__ is CPU_FORWARDS[type(m)] for m in modules)


def test_backend_choice(tiny_models, monkeypatch):
    path = tiny_models["qwen3"]
    if not isinstance(KERNEL, str):
        assert Config(path, device="cpu").elementwise_backend == "cpu"  # "auto" in float32
    assert Config(path, device="cpu", dtype="bfloat16").elementwise_backend == "torch"
    triton = importlib.util.find_spec("triton") is not None  # "auto" on CUDA: one Triton kernel per chain
    assert pick_elementwise_backend("auto", "cuda", "bfloat16") == ("triton" if triton else "torch")
    for name, device, dtype, error in [
        ("cpu", "cpu", "bfloat16", "elementwise_backend='cpu' is a float32 kernel for the CPU, got device 'cpu'"),
        ("cpu", "cuda", "float32", "float32 kernel for the CPU, got device 'cuda'"),
        ("compile", "cuda", "bfloat16", "elementwise_backend='compile' is for the CPU"),
        ("fused", "cpu", "float32", "elementwise_backend must be one of"),
        (None, "cpu", "float32", "elementwise_backend must be one of"),
    ]:
        with pytest.raises(ValueError, match=error):
            pick_elementwise_backend(name, device, dtype)
    with pytest.raises(ValueError, match="elementwise_backend must be one of"):
        Config(path, device="cpu", elementwise_backend="fast")
    # Where it cannot be built (no compiler, no OpenMP): "auto" keeps PyTorch's path, asking for it says why.
    monkeypatch.setattr("nanoserve.utils.backends.load_cpu_kernel", lambda source: "CalledProcessError: no compiler")
    assert Config(path, device="cpu").elementwise_backend == "torch"
    with pytest.raises(ValueError, match=r"elementwise_backend='cpu': the kernel could not be built here \(.*compi"):
        Config(path, device="cpu", elementwise_backend="cpu")
