"""The "cpu" attention backend (layers/attention.py): a C++ kernel that reads the paged cache in place, in a
layout of its own within each block. Written through its own store function, read by its own attention, it
equals the PyTorch path on every shape of batch; "auto" picks it on CPU in float32, and where it cannot be built
"auto" keeps the PyTorch path while asking for it by name is a clear error."""
import random
from itertools import accumulate

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.config import Config
from nanoserve.layers.attention import AttentionMetadata
from nanoserve.layers.selector import attention_backend
from nanoserve.layers.torch_attention import to_cache_dtype
from nanoserve.utils.backends import pick_attention_backend
from nanoserve.utils.cpu_kernel import load_cpu_kernel

KERNEL = load_cpu_kernel("paged_attention_cpu")
pytestmark = pytest.mark.skipif(isinstance(KERNEL, str), reason=f"no kernel: {KERNEL}")


def run_backend(name: str, batch: list[tuple[int, int]], block_size: int, heads: int, kv_heads: int, dim: int,
                seed: int = 0, cache_dtype: torch.dtype = torch.float32, kv_scale: float = 1.0,
                round_kv_to: torch.dtype | None = None, device: str = "cpu",
                q_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Store every sequence's whole context with the backend's store, in scattered blocks, then attend: batch is
    (context length after this step, new tokens) per sequence. The same seed gives the same K/V/q values.
    K/V are kv_scale times larger (q as much smaller); round_kv_to: rounded to that dtype before they are stored.
    device: where the caches and the batch live (the same values: drawn on the CPU); the output comes back.
    q_dtype: the model's dtype, as q arrives in it."""
    gen = torch.Generator().manual_seed(seed)
    store, attend = attention_backend(name)
    blocks = [-(-ctx // block_size) for ctx, _ in batch]
    order = torch.randperm(sum(blocks) + 3, generator=gen).tolist()  # scattered blocks, and some unused ones
    k_cache = torch.zeros(len(order), block_size, kv_heads, dim, dtype=cache_dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    tables = [[order.pop() for _ in range(n)] for n in blocks]
    for (ctx, _), table in zip(batch, tables):
        slots = torch.tensor([table[i // block_size] * block_size + i % block_size for i in range(ctx)])
        k, v = torch.randn(2, ctx, kv_heads, dim, generator=gen) * kv_scale
        if round_kv_to is not None:
            k, v = (to_cache_dtype(x, round_kv_to).float() for x in (k, v))
        store(k.to(device), v.to(device), k_cache, v_cache, slots.to(device))
    q = (torch.randn(sum(q for _, q in batch), heads, dim, generator=gen) / kv_scale).to(device, q_dtype)
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([], dtype=torch.int64, device=device),
        block_tables=torch.tensor([t + [-1] * (max(blocks) - len(t)) for t in tables], **i32),
        context_lens=torch.tensor([ctx for ctx, _ in batch], **i32),
        cu_seqlens_q=torch.tensor(list(accumulate([q for _, q in batch], initial=0)), **i32),
        cu_seqlens_k=torch.tensor(list(accumulate([ctx for ctx, _ in batch], initial=0)), **i32),
        max_seqlen_q=max(q for _, q in batch), max_seqlen_k=max(ctx for ctx, _ in batch))
    return attend(q, k_cache, v_cache, meta, dim**-0.5).cpu()


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 16), (9, 3, 64), (3, 3, 24), (8, 1, 40)])
def test_equals_the_pytorch_path(block_size, heads, kv_heads, dim):
    """Decodes, a prompt, a chunk after a cached context, verify-like rows of 4, a prompt longer than a work item
    (16 new tokens), contexts on and off block boundaries; head sizes that fill, and do not fill, a vector."""
    batch = [(37, 1), (block_size * 3, 1), (20, 20), (50, 13), (9, 4), (70, 35), (1, 1)]
    expected = run_backend("torch", batch, block_size, heads, kv_heads, dim)
    torch.testing.assert_close(run_backend("cpu", batch, block_size, heads, kv_heads, dim), expected,
                               atol=1e-5, rtol=1e-5)


def test_random_batches_equal_the_pytorch_path():
    rng = random.Random(0)
    for seed in range(20):
        contexts = [rng.randint(1, 300) for _ in range(rng.randint(1, 12))]
        batch = [(ctx, rng.choice([1, 1, 2, 5, ctx])) for ctx in contexts]  # decodes, verify rows, chunks, prompts
        block_size = rng.choice([2, 8, 16])
        expected = run_backend("torch", batch, block_size, 6, 2, 32, seed)
        where = f"batch {batch}, block_size {block_size}"
        torch.testing.assert_close(run_backend("cpu", batch, block_size, 6, 2, 32, seed), expected,
                                   atol=1e-5, rtol=1e-5, msg=lambda m, where=where: f"{where}: {m}")


def test_llm_on_either_backend_gives_the_same_greedy_tokens(tiny_models):
    """Both paths in one engine configuration that exercises chunks, prefix hits and preemption."""
    prompts = [[(7 * i + j) % 500 for j in range(5 + 9 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "cpu"):
        llm = LLM(tiny_models["llama"], attention_backend=backend, block_size=8, num_kvcache_blocks=24,
                  enable_chunked_prefill=True, max_num_batched_tokens=32)
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.config.attention_backend == backend and llm.stats.num_preemptions > 0
    assert outputs["cpu"] == outputs["torch"]


def test_backend_choice(tiny_models, monkeypatch):
    path = tiny_models["qwen3"]
    assert Config(path, device="cpu").attention_backend == "cpu"  # "auto" in float32
    assert Config(path, device="cpu", dtype="bfloat16").attention_backend == "torch"
    with pytest.raises(ValueError, match="float32 kernel for the CPU, got device 'cpu' and dtype 'bfloat16'"):
        Config(path, device="cpu", dtype="bfloat16", attention_backend="cpu")
    with pytest.raises(ValueError, match="float32 kernel for the CPU, got device 'cuda'"):
        pick_attention_backend("cpu", "cuda", "float32")
    # Where it cannot be built (no compiler, no OpenMP): "auto" keeps PyTorch's path, asking for it says why.
    monkeypatch.setattr("nanoserve.utils.backends.load_cpu_kernel", lambda source: "CalledProcessError: no compiler")
    assert Config(path, device="cpu").attention_backend == "torch"
    with pytest.raises(ValueError, match=r"attention_backend='cpu': the kernel could not be built here \(.*compiler"):
        Config(path, device="cpu", attention_backend="cpu")
