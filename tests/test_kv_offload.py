"""The prefix cache's host tier (kv_offloading_size, nanoserve/kv_offload/) changes where KV comes from, never the
output: multi-turn conversations on a device pool too small to keep them, each turn re-sending its history, give
the same greedy tokens with the tier on as off, and as transformers, under every scheduler setting, n > 1,
speculative decoding and tensor parallelism; the tier really served blocks back."""
import gc
import math

import pytest

from conftest import ARCHS, hf_greedy, random_prompts
from nanoserve import LLM, SamplingParams

BLOCK_SIZE = 4
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * BLOCK_SIZE  # K and V, 2 layers, 2 KV heads, head_dim 16, float32
HOST_TIER = 64 * BLOCK_BYTES / 2**30  # GiB: 64 blocks
MAX_TOKENS = 6
TURNS = 3
COMBOS = [(chunked, policy, mode, asynchronous) for chunked in (False, True) for policy in ("fcfs", "priority")
          for mode in ("recompute", "swap") for asynchronous in (False, True)]


def conversations(llm: LLM, params: SamplingParams, num: int = 4, seed: int = 0) -> list[list[list[int]]]:
    """num conversations of TURNS turns: each turn sends the history (earlier prompts and answers) and a new
    user message; all of a turn's conversations go in one generate. Returns each turn's prompts and answers."""
    system = random_prompts(1, seed=seed, low=9, high=10)[0]  # a shared system prompt
    histories = [system + p for p in random_prompts(num, seed=seed + 1, low=3, high=8)]
    turns = []
    for turn in range(TURNS):
        outputs = llm.generate(histories, params, use_tqdm=False)
        answers = [[o.outputs[i].token_ids for i in range(len(o.outputs))] for o in outputs]
        turns.append((histories, answers))
        user = random_prompts(num, seed=seed + 10 + turn, low=2, high=6)
        histories = [h + a[0] + u for h, a, u in zip(histories, answers, user)]
    return turns


def tight_llm(path: str, offload: bool, **options) -> LLM:
    """20 blocks of 4 tokens: one conversation's last turn fits, the four together do not."""
    options = dict(dict(block_size=BLOCK_SIZE, num_kvcache_blocks=20, max_model_len=64, max_num_batched_tokens=64,
                        swap_space=24 * BLOCK_BYTES / 2**30), **options)
    return LLM(path, kv_offloading_size=HOST_TIER if offload else 0, **options)


def check_on_equals_off_equals_transformers(path: str, params: SamplingParams, **options) -> int:
    """Run the conversations with the tier on, then off: equal, and (greedy, n=1) equal to transformers; the tier
    really offloaded blocks and served some back, and no block leaked. Returns the tier's size in blocks."""
    llm = tight_llm(path, True, **options)
    on, stats, pool = conversations(llm, params), llm.stats, llm.engine.block_manager
    assert stats.num_offloaded_blocks > 0 and stats.num_loaded_blocks > 0
    assert 0 < stats.num_host_cached_tokens <= stats.num_cached_tokens
    assert pool.num_free_blocks == pool.num_blocks
    num_offload_blocks = llm.engine.model_runner.num_offload_blocks
    del llm, pool  # (a tensor-parallel engine's ranks must be gone before the next one starts)
    gc.collect()
    llm = tight_llm(path, False, **options)
    assert conversations(llm, params) == on
    del llm
    gc.collect()
    if params.n == 1:
        for prompts, answers in on:
            assert [a[0] for a in answers] == hf_greedy(path, prompts, params.max_tokens)
    return num_offload_blocks


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.mark.parametrize("chunked, policy, mode, asynchronous", COMBOS)
def test_every_scheduler_setting(tiny_models, chunked, policy, mode, asynchronous):
    arch = ARCHS[COMBOS.index((chunked, policy, mode, asynchronous)) % len(ARCHS)]
    check_on_equals_off_equals_transformers(
        tiny_models[arch], GREEDY, enable_chunked_prefill=chunked, max_num_batched_tokens=16 if chunked else 64,
        scheduling_policy=policy, preemption_mode=mode, async_scheduling=asynchronous)


def test_parallel_sampling_with_copy_on_write(tiny_models):
    """n=3 seeded samples per prompt share the prompt's blocks and copy the last one on write."""
    params = SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=MAX_TOKENS)
    check_on_equals_off_equals_transformers(tiny_models["qwen3"], params)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding(tiny_models, method):
    spec = {"method": method, "num_speculative_tokens": 3}
    spec.update({"prompt_lookup_max": 2} if method == "ngram" else {"model": tiny_models["qwen3"]})
    check_on_equals_off_equals_transformers(tiny_models["qwen3"], GREEDY, speculative_config=spec)


def test_tensor_parallel(tiny_models):
    """Each rank holds its share of the KV heads in its own host tier; rank 0's books hand out the blocks."""
    num_blocks = check_on_equals_off_equals_transformers(tiny_models["qwen3"], GREEDY, tensor_parallel_size=2)
    assert num_blocks == 2 * 64  # each rank holds half the heads: twice the blocks per GiB


@pytest.mark.parametrize("value, message", [
    (-1, r"kv_offloading_size must be >= 0 \(GiB\), got -1"),
    (math.nan, "kv_offloading_size must be >= 0 \\(GiB\\), got nan"),
    ("1", "kv_offloading_size must be a number"),
    (1e9, r"kv_offloading_size \(1000000000.0 GiB\) exceeds this host's memory"),
    (1e-12, r"kv_offloading_size \(1e-12 GiB\) is too small for one KV block"),
])
def test_bad_values(tiny_models, value, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_models["qwen3"], kv_offloading_size=value, **dict(num_kvcache_blocks=16))


def test_needs_prefix_caching(tiny_models):
    with pytest.raises(ValueError, match="kv_offloading_size needs enable_prefix_caching=True"):
        LLM(tiny_models["qwen3"], kv_offloading_size=0.01, enable_prefix_caching=False)


def test_off_plugs_nothing_in(tiny_models):
    llm = LLM(tiny_models["qwen3"], num_kvcache_blocks=16)
    assert llm.engine.seams.kv_cache_tier is None and llm.engine.model_runner.num_offload_blocks == 0


def test_stats_trace_and_metrics_agree(tiny_models):
    """llm.stats, the step records (trace=True) and /metrics' collector count the same copies and hits."""
    from nanoserve.serving.metrics import EngineCollector

    llm = tight_llm(tiny_models["qwen3"], True, trace=True)
    conversations(llm, GREEDY)
    stats, trace = llm.stats, llm.trace
    assert sum(len(r.blocks_offloaded) for r in trace) == stats.num_offloaded_blocks > 0
    assert sum(len(r.blocks_loaded) for r in trace) == stats.num_loaded_blocks > 0
    assert all(0 <= r.num_host_cached_blocks <= r.num_host_blocks == 64 for r in trace)
    assert trace[-1].num_host_cached_blocks > 0
    metrics = {m.name: m.samples[0].value for m in EngineCollector(llm.engine, "m").collect() if m.samples}
    assert metrics["nanoserve:external_prefix_cache_hits"] == stats.num_host_cached_tokens > 0
    assert metrics["nanoserve:kv_offload_blocks_offloaded"] == stats.num_offloaded_blocks
    assert metrics["nanoserve:kv_offload_blocks_loaded"] == stats.num_loaded_blocks
