"""The backbone: greedy output equals Hugging Face transformers token for token (float32, CPU)."""
import pytest

from conftest import ARCHS, ROOMY_POOL, hf_greedy, random_prompts
from nanoserve import LLM, SamplingParams

MAX_TOKENS = 40
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def completions(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def references(tiny_models):
    """HF's greedy output for plain prompts and for prompts sharing prefixes, per architecture."""
    prompts = random_prompts(8, seed=1)
    shared = [random_prompts(1, seed=2, low=20, high=21)[0] + p for p in random_prompts(6, seed=3, low=1, high=30)]
    return {arch: {"plain": (prompts, hf_greedy(path, prompts, MAX_TOKENS)),
                   "shared": (shared, hf_greedy(path, shared, MAX_TOKENS))}
            for arch, path in tiny_models.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_equals_transformers(tiny_models, references, arch):
    prompts, expected = references[arch]["plain"]
    llm = LLM(tiny_models[arch], block_size=16, enable_prefix_caching=False, **ROOMY_POOL)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert completions(outputs) == expected
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert llm.stats.num_preemptions == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hits_and_still_equals_transformers(tiny_models, references, arch):
    prompts, expected = references[arch]["shared"]
    llm = LLM(tiny_models[arch], block_size=4, **ROOMY_POOL)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert completions(first) == expected
    second = llm.generate(prompts, GREEDY, use_tqdm=False)  # every prompt is now in the cache
    assert completions(second) == expected
    assert all(o.num_cached_tokens > 0 for o in second)
    assert llm.stats.num_cached_tokens >= sum(o.num_cached_tokens for o in second) > 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_still_equals_transformers(tiny_models, references, arch, prefix_caching):
    prompts, expected = references[arch]["plain"]
    # 14 blocks of 8 tokens: one sequence fits (<= 100 tokens), eight cannot run together.
    llm = LLM(tiny_models[arch], block_size=8, num_kvcache_blocks=14, enable_prefix_caching=prefix_caching)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert completions(outputs) == expected
    assert llm.stats.num_preemptions > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every block came back
