"""Every combination of the scheduling options changes the batches, never the output: greedy output equals
transformers, with a KV pool small enough that preemption (and swapping) really happens, with and without
async scheduling (step N+1 planned while step N runs)."""
import random

import pytest

from conftest import ARCHS, hf_greedy, random_prompts
from nanoserve import LLM, SamplingParams
from nanoserve.engine.core import EngineCore

MAX_TOKENS = 24
BLOCK_SIZE = 4
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * BLOCK_SIZE  # K and V, 2 layers, 2 KV heads, head_dim 16, float32
COMBOS = [(chunked, policy, mode) for chunked in (False, True) for policy in ("fcfs", "priority")
          for mode in ("recompute", "swap")]


Request = tuple[int, list[int], SamplingParams, int]  # (arrival step, prompt, sampling params, priority)


def requests(use_priority: bool) -> list[Request]:
    """Three long requests first, then three urgent ones, all sharing a prefix."""
    shared = random_prompts(1, seed=7, low=8, high=9)[0]
    prompts = [shared + p for p in random_prompts(6, seed=8, low=4, high=30)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return [(0 if i < 3 else 3, prompt, params, int(use_priority and i < 3)) for i, prompt in enumerate(prompts)]


def run(engine: EngineCore, reqs: list[Request]) -> list[list[int]]:
    """Step the engine, adding each request at its arrival step; returns the completions in request order."""
    pending, completions, step = sorted(range(len(reqs)), key=lambda i: reqs[i][0]), {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and reqs[pending[0]][0] <= step:
            i = pending.pop(0)
            engine.add_request(str(i), *reqs[i][1:])
            completions[str(i)] = []
        for out in engine.step():
            completions[out.request_id] += out.new_token_ids
        step += 1
    return [completions[str(i)] for i in range(len(reqs))]


@pytest.fixture(scope="module")
def expected(tiny_models):
    prompts = [prompt for _, prompt, _, _ in requests(False)]
    return {arch: hf_greedy(tiny_models[arch], prompts, MAX_TOKENS) for arch in ARCHS}


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("chunked, policy, mode", COMBOS)
def test_every_combination_equals_transformers(tiny_models, expected, chunked, policy, mode, prefix_caching,
                                               async_scheduling):
    arch = ARCHS[COMBOS.index((chunked, policy, mode)) % len(ARCHS)]
    # 16 blocks of 4 tokens: the longest request (62 tokens) fits alone, the six together do not.
    llm = LLM(tiny_models[arch], block_size=BLOCK_SIZE, num_kvcache_blocks=16, max_model_len=64,
              max_num_batched_tokens=16 if chunked else 64, enable_chunked_prefill=chunked,
              scheduling_policy=policy, preemption_mode=mode, swap_space=24 * BLOCK_BYTES / 2**30,
              enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling)
    assert run(llm.engine, requests(policy == "priority")) == expected[arch]
    stats = llm.stats
    assert stats.num_preemptions > 0
    if chunked:
        assert stats.num_chunked_prefills > 0 and stats.num_mixed_steps > 0
    if policy == "priority":
        assert stats.num_priority_preemptions > 0
    if mode == "swap":
        assert stats.num_swapped_in == stats.num_swapped_out > 0
    else:
        assert stats.num_swapped_out == 0
    if prefix_caching:
        assert stats.num_cached_tokens > 0
    scheduler = llm.engine.scheduler
    for pool in (scheduler.block_manager, getattr(scheduler, "host_block_manager", None)):
        assert pool is None or pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_equals_an_unconstrained_pool(tiny_models, seed):
    """Random options, arrivals, lengths, priorities and pool sizes against one roomy default engine
    (odd seeds schedule asynchronously)."""
    rng = random.Random(seed)
    arch = ARCHS[seed % len(ARCHS)]
    chunked, policy = rng.random() < 0.5, rng.choice(["fcfs", "priority"])
    shared = random_prompts(1, seed=seed, low=12, high=13)[0]
    prompts = [shared[: rng.randint(0, 12)] + p for p in random_prompts(6, seed=10 + seed, low=1, high=30)]
    reqs = [(rng.randint(0, 6), prompt, SamplingParams(temperature=0, max_tokens=rng.randint(4, 16)),
             rng.randint(0, 3) if policy == "priority" else 0) for prompt in prompts]
    largest = max(-(-(len(prompt) + params.max_tokens) // BLOCK_SIZE) for _, prompt, params, _ in reqs)
    llm = LLM(tiny_models[arch], block_size=BLOCK_SIZE, num_kvcache_blocks=rng.randint(largest, largest + 4),
              max_model_len=64, max_num_batched_tokens=rng.randint(4, 32) if chunked else 64,
              enable_chunked_prefill=chunked, scheduling_policy=policy,
              preemption_mode=rng.choice(["recompute", "swap"]), enable_prefix_caching=rng.random() < 0.5,
              swap_space=rng.randint(1, 2 * largest) * BLOCK_BYTES / 2**30, async_scheduling=seed % 2 == 1)
    roomy = LLM(tiny_models[arch], block_size=BLOCK_SIZE, num_kvcache_blocks=256, max_model_len=64)
    assert run(llm.engine, reqs) == run(roomy.engine, [(t, p, sp, 0) for t, p, sp, _ in reqs])
    assert llm.stats.num_preemptions > 0 and roomy.stats.num_preemptions == 0


def test_seeded_sampling_does_not_depend_on_the_schedule(tiny_models):
    """A chunk that stops short of its prompt's end draws no sample, so a seeded request's random numbers, and
    its tokens, are the same however its prompt is cut and however often it is preempted."""
    reqs = [(arrival, prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS), 0)
            for i, (arrival, prompt, _, _) in enumerate(requests(False))]
    roomy = LLM(tiny_models["qwen3"], block_size=BLOCK_SIZE, num_kvcache_blocks=256, max_model_len=64)
    tight = LLM(tiny_models["qwen3"], block_size=BLOCK_SIZE, num_kvcache_blocks=16, max_model_len=64,
                enable_chunked_prefill=True, max_num_batched_tokens=8, preemption_mode="swap",
                swap_space=8 * BLOCK_BYTES / 2**30)
    assert run(tight.engine, reqs) == run(roomy.engine, reqs)
    assert tight.stats.num_chunked_prefills > 0 and tight.stats.num_swapped_out > 0
    assert tight.stats.num_preemptions > tight.stats.num_swapped_out  # the small host pool also recomputed
