"""Randomized, end to end: the engine's output does not depend on how small the KV pool is (preemption
recomputes exactly). The scheduler-level randomized test, for every policy, is test_scheduling_random.py."""
import random

import pytest

from conftest import random_prompts
from nanoserve import LLM, SamplingParams


@pytest.mark.parametrize("case", range(3))
def test_tiny_pool_gives_the_same_outputs_as_a_large_one(tiny_models, case):
    rng = random.Random(case)
    shared = random_prompts(1, seed=100 + case, low=8, high=9)[0]
    prompts = [shared[: rng.randint(0, 8)] + p for p in random_prompts(5, seed=case, low=1, high=16)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(4, 16)) for _ in prompts]
    arch = ["qwen3", "qwen2", "llama"][case]

    def generate(num_kvcache_blocks):
        llm = LLM(tiny_models[arch], block_size=4, num_kvcache_blocks=num_kvcache_blocks,
                  enable_prefix_caching=case != 2)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        return [o.outputs[0].token_ids for o in outputs], llm.stats.num_preemptions

    expected, preemptions = generate(256)
    assert preemptions == 0
    largest = max(-(-(len(p) + sp.max_tokens) // 4) for p, sp in zip(prompts, params))
    outputs, preemptions = generate(largest)
    assert preemptions > 0
    assert outputs == expected
