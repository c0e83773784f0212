"""On an NVIDIA GPU: greedy output equals transformers' token for token in float32, under every scheduler
option, with the Triton kernels (CUDA graphs and eager) and with the PyTorch path; bfloat16 equals float32
within ties; seeded sampling, penalties and logprobs equal the CPU engine's.

CI has no GPU, so this file is skipped there. On a GPU machine, `python -m pytest tests/test_cuda.py
tests/test_triton_attention.py` runs it and the kernel tests (natively there). The reference,
transformers, runs on the CPU.
"""
import gc

import pytest
import test_sliding_window as window_tests
import torch

from conftest import ARCHS, assert_within_ties, hf_greedy, random_prompts
from nanoserve import LLM, SamplingParams
from nanoserve.sliding_window import SlidingWindowBlockManager

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")

MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
# A tiny model's KV block is 8 KB: sized from GPU memory, the pool would hold millions of them.
POOL = dict(num_kvcache_blocks=256)
OPTIONS = {  # name: (LLM options, whether the second pass must hit the prefix cache)
    "cuda-graphs": ({}, True),
    "eager": (dict(enforce_eager=True), True),
    "torch-backend": (dict(attention_backend="torch"), True),
    "block-64": (dict(block_size=64), False),
    "chunked-prefill": (dict(enable_chunked_prefill=True, max_num_batched_tokens=32), True),
    "async-scheduling": (dict(async_scheduling=True), True),
    "preemption": (dict(num_kvcache_blocks=8), False),
    "swap": (dict(num_kvcache_blocks=8, preemption_mode="swap", swap_space=0.01), False),
    "host-tier": (dict(num_kvcache_blocks=16, kv_offloading_size=0.01), False),  # copies on a side stream
    "pool-from-memory": (dict(num_kvcache_blocks=None, gpu_memory_utilization=0.03), True),
}


@pytest.fixture(autouse=True)
def free_gpu_memory():
    """An engine left for the garbage collector would still hold GPU memory when the next one sizes its pool."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def expected(tiny_models):
    prompts = random_prompts(8, seed=1)  # 3 to 59 tokens: decode batches shrink from 8 to 1 (graph padding)
    return prompts, {arch: hf_greedy(path, prompts, MAX_TOKENS) for arch, path in tiny_models.items()}


def count_graph_replays(llm: LLM) -> list[int]:
    graphs, replays = llm.engine.model_runner.cuda_graphs, []  # None: eager, nothing to count
    if graphs is not None:
        replay = graphs.replay
        graphs.replay = lambda *args: replays.append(len(args[0])) or replay(*args)
    return replays


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("arch", ARCHS)
def test_float32_equals_transformers(tiny_models, expected, arch, option):
    options, hits = OPTIONS[option]
    prompts, reference = expected
    llm = LLM(tiny_models[arch], dtype="float32", **{**POOL, **options})
    config = llm.engine.config
    assert config.device == "cuda" and config.attention_backend == options.get("attention_backend", "triton")
    replays = count_graph_replays(llm)
    for _ in range(2):  # the second time, the prompts' full blocks are in the prefix cache
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == reference[arch]
    if hits:
        assert sum(o.num_cached_tokens for o in outputs) > 0
    assert bool(replays) == (config.attention_backend == "triton" and not config.enforce_eager)
    if config.num_kvcache_blocks == 8:
        assert llm.stats.num_preemptions > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_equals_float32_within_ties(tiny_models, arch):
    """bfloat16 ("auto" on CUDA) rounds logits, so a near-tie may flip: each token must be within a tie of
    float32's best (the bound tests/test_bfloat16.py uses on CPU)."""
    prompts = random_prompts(8, seed=1)
    llm = LLM(tiny_models[arch], **POOL)
    assert llm.engine.config.dtype == "bfloat16"
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert_within_ties(tiny_models[arch], prompts, outputs, tie=0.1)


def test_sampling_options_equal_the_cpu_engine(tiny_models):
    """Seeded draws use CPU generators, so the GPU engine samples what the CPU engine does: with penalties,
    min_p/top-k/top-p, min_tokens, n=2 (copy-on-write) and logprobs."""
    prompts = random_prompts(4, seed=9, low=10, high=40)
    params = SamplingParams(n=2, seed=3, temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, min_tokens=4,
                            repetition_penalty=1.2, presence_penalty=0.5, max_tokens=12, logprobs=3,
                            prompt_logprobs=2)
    path = tiny_models["llama"]
    cpu = LLM(path, device="cpu", block_size=16, max_logprobs=3).generate(prompts, params, use_tqdm=False)
    gpu = LLM(path, dtype="float32", max_logprobs=3, **POOL).generate(prompts, params, use_tqdm=False)
    for a, b in zip(cpu, gpu):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for x, y in zip([*a.prompt_logprobs[1:], *a.outputs[0].logprobs],
                        [*b.prompt_logprobs[1:], *b.outputs[0].logprobs]):
            assert x.keys() == y.keys()
            assert all(abs(x[i].logprob - y[i].logprob) < 1e-4 for i in x)


def test_async_steps_never_make_the_host_wait(tiny_models, expected):
    """Async scheduling: the host plans and launches step N+1 while N runs, so nothing in a step may synchronize
    (CUDA's sync debug mode raises on a blocking copy or a read of a device tensor; the wait for a step's own
    sampled ids is an event, which it does not count). A blocking copy held the host until the step in flight
    ended, and the GPU idled while the next one launched (docs/benchmarks.md, async overhead)."""
    prompts, answers = expected
    llm = LLM(tiny_models["qwen3"], dtype="float32", async_scheduling=True, **POOL)
    llm.generate(prompts, GREEDY, use_tqdm=False)  # warm-up: Triton compiles, pinned buffers are made
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert [o.outputs[0].token_ids for o in outputs] == answers["qwen3"]


def test_host_pool_copies_run_on_a_side_stream_without_synchronizing(tiny_models):
    """The host tier's copies (host_kv_pool.py) out to its page-locked, block-first pool and back: no copy makes
    the host wait (CUDA's sync debug mode raises on one that does), and the compute stream's next work sees them."""
    from nanoserve.host_kv_pool import copy_host_blocks

    llm = LLM(tiny_models["qwen3"], dtype="float32", kv_offloading_size=0.01, **POOL)
    runner = llm.engine.model_runner
    runner.kv_cache.normal_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        copy_host_blocks(runner, [(3, 0), (7, 1)], "device", "kv_offloading_size")
        copy_host_blocks(runner, [(0, 10), (1, 11)], "kv_offloading_size", "device")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.equal(runner.kv_cache[:, :, a], runner.kv_cache[:, :, b]) for a, b in ((3, 10), (7, 11)))
    assert torch.equal(runner.kv_pools["kv_offloading_size"][1], runner.kv_cache[:, :, 7].cpu())


# Sliding windows (nanoserve/sliding_window/): the Triton kernels skip and mask what lies behind each layer's window,
# in CUDA graphs (decode) and in prefill chunks of 24 tokens that cross the window's edge (20 for Mistral, 32 for
# the windowed Qwen2); in a pool of 8 blocks, prompts allocated chunk by chunk and sequences preempted.
WINDOW_OPTIONS = {
    "cuda-graphs": {},
    "chunked-prefill": dict(enable_chunked_prefill=True, max_num_batched_tokens=24),
    "small-pool": dict(enable_chunked_prefill=True, max_num_batched_tokens=24, num_kvcache_blocks=8),
}


@pytest.fixture(scope="module")
def windowed(tmp_path_factory) -> dict[str, tuple[str, list[list[int]]]]:
    """tests/test_sliding_window.py's tiny Mistral and all-windowed Qwen2, and transformers' answers (CPU)."""
    root = tmp_path_factory.mktemp("windowed")
    windowed = {}
    for name in ("mistral", "qwen2"):
        path = window_tests.save_model(root / name, window_tests.CONFIGS[name]())
        windowed[name] = path, hf_greedy(path, window_tests.PROMPTS, window_tests.MAX_TOKENS)
    return windowed


@pytest.mark.parametrize("option", WINDOW_OPTIONS)
@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_sliding_window_equals_transformers(windowed, name, option):
    path, reference = windowed[name]
    llm = LLM(path, dtype="float32", block_size=window_tests.BLOCK_SIZE, **{**POOL, **WINDOW_OPTIONS[option]})
    config, bm = llm.engine.config, llm.engine.block_manager
    assert config.device == "cuda" and config.attention_backend == "triton" and not config.enforce_eager
    assert isinstance(bm, SlidingWindowBlockManager)
    replays = count_graph_replays(llm)
    outputs = llm.generate(window_tests.PROMPTS, window_tests.GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert replays and bm.num_freed_behind_window > 0  # decode ran in CUDA graphs; blocks went back
    if config.enable_chunked_prefill:
        assert llm.stats.num_chunked_prefills > 0
    if config.num_kvcache_blocks == 8:
        assert llm.stats.num_preemptions > 0
    assert bm.num_free_blocks == bm.num_blocks
