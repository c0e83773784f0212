"""The Triton kernels against the PyTorch path, on random paged caches: on CPU through Triton's interpreter
(conftest.py sets TRITON_INTERPRET=1 before anything imports triton), natively where CUDA is available."""
import importlib.util
from itertools import accumulate

import pytest
import torch

from conftest import hf_greedy, random_prompts
from nanoserve import LLM, SamplingParams
from nanoserve.config import Config
from nanoserve.layers.attention import AttentionMetadata
from nanoserve.layers.torch_attention import store_kvcache, torch_paged_attention

pytest.importorskip("triton")
from nanoserve.layers.triton_attention import triton_paged_attention, triton_store_kvcache  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KV_HEADS, DIM = 2, 16
# (context length after this step, new tokens); lengths end mid-block for block sizes 16 and 32.
DECODES = [(37, 1), (5, 1), (70, 1)]
MIXED = [(45, 45), (50, 13), (21, 1), (33, 2), (9, 9)]  # fresh prompt, prompt after a prefix hit, decode, chunk


def random_batch(batch: list[tuple[int, int]], block_size: int, num_heads: int, seed: int):
    """Random caches whose blocks are handed out in random order, random queries, and the metadata."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for ctx, _ in batch]
    order = torch.randperm(sum(blocks_per_seq) + 3, generator=g).tolist()  # scattered, some unused
    k_cache = torch.randn(len(order), block_size, KV_HEADS, DIM, generator=g).to(DEVICE)
    v_cache = torch.randn(len(order), block_size, KV_HEADS, DIM, generator=g).to(DEVICE)
    tables = [[order.pop() for _ in range(n)] for n in blocks_per_seq]
    tables = [t + [-1] * (max(blocks_per_seq) - len(t)) for t in tables]
    q = torch.randn(sum(n for _, n in batch), num_heads, DIM, generator=g).to(DEVICE)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([], dtype=torch.int64, device=DEVICE),
        block_tables=torch.tensor(tables, **i32),
        context_lens=torch.tensor([ctx for ctx, _ in batch], **i32),
        cu_seqlens_q=torch.tensor(list(accumulate([n for _, n in batch], initial=0)), **i32),
        cu_seqlens_k=torch.tensor(list(accumulate([ctx for ctx, _ in batch], initial=0)), **i32),
        max_seqlen_q=max(n for _, n in batch), max_seqlen_k=max(ctx for ctx, _ in batch),
    )
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("gqa", [1, 2, 3, 4])  # 3: SmolLM2 has 9 query heads per 3 KV heads
@pytest.mark.parametrize("batch", [DECODES, MIXED], ids=["decode", "mixed"])
def test_paged_attention_equals_pytorch_path(block_size, gqa, batch):
    q, k_cache, v_cache, meta = random_batch(batch, block_size, KV_HEADS * gqa, seed=block_size + gqa)
    expected = torch_paged_attention(q.cpu(), k_cache.cpu(), v_cache.cpu(), meta_to_cpu(meta), DIM**-0.5)
    out = triton_paged_attention(q, k_cache, v_cache, meta, DIM**-0.5)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


def meta_to_cpu(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(*(x.cpu() if isinstance(x, torch.Tensor) else x for x in vars(meta).values()))


def test_store_kvcache_equals_pytorch_path():
    g = torch.Generator().manual_seed(0)
    # K and V as the model makes them: strided views of one fused qkv projection
    qkv = torch.randn(11, 3, KV_HEADS, DIM, generator=g).to(DEVICE)
    k, v = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(4 * 16, generator=g)[:11].to(DEVICE)
    caches = [torch.zeros(4, 16, KV_HEADS, DIM, device=DEVICE) for _ in range(4)]
    store_kvcache(k, v, caches[0], caches[1], slots)
    triton_store_kvcache(k, v, caches[2], caches[3], slots)
    assert caches[0].count_nonzero() == 11 * KV_HEADS * DIM
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def shared_prefix_prompts():
    return [random_prompts(1, seed=4, low=20, high=21)[0] + p for p in random_prompts(4, seed=5, low=1, high=20)]


def test_engine_with_prefix_caching_equals_transformers(tiny_models, shared_prefix_prompts):
    expected = hf_greedy(tiny_models["qwen3"], shared_prefix_prompts, MAX_TOKENS)
    llm = LLM(tiny_models["qwen3"], attention_backend="triton", dtype="float32", num_kvcache_blocks=32)
    assert llm.engine.config.block_size == 16
    assert llm.engine.model_runner.attn_layers[0].impl is triton_paged_attention
    for _ in range(2):  # the second time, every prompt's first block comes from the prefix cache
        outputs = llm.generate(shared_prefix_prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.num_cached_tokens >= 16 for o in outputs)


def test_engine_with_chunked_prefill_equals_transformers(tiny_models, shared_prefix_prompts):
    expected = hf_greedy(tiny_models["llama"], shared_prefix_prompts, MAX_TOKENS)
    llm = LLM(tiny_models["llama"], attention_backend="triton", dtype="float32", block_size=32, num_kvcache_blocks=16,
              enable_chunked_prefill=True, max_num_batched_tokens=16, enable_prefix_caching=False)
    outputs = llm.generate(shared_prefix_prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.stats.num_chunked_prefills > 0 and llm.stats.num_mixed_steps > 0


def test_backend_choice_and_errors(tiny_models, monkeypatch):
    path = tiny_models["qwen3"]
    assert Config(path, device="cpu", dtype="bfloat16").attention_backend == "torch"  # float32: "cpu"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        Config(path, attention_backend="xformers")
    with pytest.raises(ValueError, match="flash_attn"):  # not installed here, and no CUDA either
        Config(path, device="cpu", attention_backend="flash_attn")
    for block_size in (8, 24):
        with pytest.raises(ValueError, match="power of two >= 16"):
            Config(path, attention_backend="triton", block_size=block_size)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        Config(path, device="cpu", attention_backend="triton")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else find_spec(name))
    with pytest.raises(ValueError, match="triton is not installed"):
        Config(path, attention_backend="triton")


def test_decode_forward_never_waits_for_the_host(tiny_models, monkeypatch):
    """What lets CUDA graphs capture the Triton decode (they cannot run here): no value goes back to the host
    inside the forward of a decode batch, so no .item(), .tolist(), bool() or copy to the CPU. With the Triton
    elementwise kernels too, as on CUDA."""
    llm = LLM(tiny_models["qwen3"], attention_backend="triton", elementwise_backend="triton", num_kvcache_blocks=16)
    run_model, decodes = llm.engine.model_runner.run_model, []

    def run_model_without_host_syncs(input_ids, positions, meta, logits_rows):
        if meta.max_seqlen_q > 1:
            return run_model(input_ids, positions, meta, logits_rows)
        decodes.append(meta)
        with monkeypatch.context() as m:
            for name in ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy"):
                m.setattr(torch.Tensor, name, lambda *a, name=name: pytest.fail(f"Tensor.{name} in a decode"))
            return run_model(input_ids, positions, meta, logits_rows)

    monkeypatch.setattr(llm.engine.model_runner, "run_model", run_model_without_host_syncs)
    llm.generate(random_prompts(2, seed=6), SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(decodes) == 2
