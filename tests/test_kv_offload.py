"""The prefix cache's host tier (kv_offloading_size, nanoserve/kv_offload/) changes where KV comes from, never the
output: multi-turn conversations on a device pool too small to keep them, each turn re-sending its history, give
the same greedy tokens with the tier on as off, and as transformers, under every scheduler setting, n > 1,
speculative decoding and tensor parallelism; the tier really served blocks back."""
import gc
import math
import random

import pytest

from conftest import ARCHS, hf_greedy, random_prompts
from nanoserve import LLM, SamplingParams
from nanoserve.engine.sequence import compute_hash
from nanoserve.kv_offload import copy_tier_blocks

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
    num_offload_blocks = llm.engine.host_tier.num_blocks
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
    assert getattr(llm.engine, "host_tier", None) is None and not llm.engine.model_runner.kv_pools


def test_host_pool_is_block_first_and_copies_round_trip(tiny_models):
    """A host pool holds a block's KV, K and V of every layer, in one piece (pool[i]); copies out and back in
    bring the device blocks' KV back exactly."""
    from nanoserve.host_kv_pool import copy_host_blocks

    runner = tight_llm(tiny_models["qwen3"], True).engine.model_runner
    pool = runner.kv_pools["kv_offloading_size"]
    assert pool.shape == (64, *runner.kv_cache.shape[:2], *runner.kv_cache.shape[3:]) and pool.is_contiguous()
    runner.kv_cache.normal_()
    copy_host_blocks(runner, [(3, 5), (7, 0)], "device", "kv_offloading_size")
    assert pool[5].equal(runner.kv_cache[:, :, 3]) and pool[0].equal(runner.kv_cache[:, :, 7])
    copy_host_blocks(runner, [(5, 12), (0, 13)], "kv_offloading_size", "device")
    assert runner.kv_cache[:, :, 12].equal(runner.kv_cache[:, :, 3])
    assert runner.kv_cache[:, :, 13].equal(runner.kv_cache[:, :, 7])


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


# ---- a copy that fails fails only the requests that needed it ------------------------------------------------
def run_engine(llm: LLM, prompts: list[list[int]], tag: str) -> list[tuple[list[int], Exception | None]]:
    """The prompts' greedy tokens and errors, from the engine's outputs (LLM.generate raises the first error)."""
    results = {}
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"{tag}{i}", prompt, GREEDY)
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            tokens, _ = results.get(out.request_id, ([], None))
            results[out.request_id] = (tokens + out.new_token_ids, out.error)
    return [results[f"{tag}{i}"] for i in range(len(prompts))]


def block_hashes(prompt: list[int]) -> list[int]:
    """The chained hashes of the blocks a prefix lookup of prompt walks."""
    hashes = [-1]
    for i in range(0, len(prompt) - BLOCK_SIZE, BLOCK_SIZE):
        hashes.append(compute_hash(prompt[i : i + BLOCK_SIZE], hashes[-1]))
    return hashes[1:]


def fail_copies(monkeypatch, llm: LLM, fails) -> list[int]:
    """Make the model runner's copies to or from the host tier raise where fails(src_id, dst_id, offloading);
    returns the list the failed copies' host blocks are appended to."""
    runner, failed = llm.engine.model_runner, []
    copy = runner.copy_blocks

    def failing_copy(mapping, src=None, dst=None):
        for src_id, dst_id in mapping:
            pool = runner.kv_pools["kv_offloading_size"]
            offloading, loading = dst is pool, src is pool
            if (offloading or loading) and fails(src_id, dst_id, offloading):
                failed.append(dst_id if offloading else src_id)
                raise RuntimeError("injected copy failure")
        copy(mapping, src, dst)

    monkeypatch.setattr(runner, "copy_blocks", failing_copy)
    return failed


def check_books_agree(llm: LLM) -> None:
    """No block leaked; each device hash names its block; each host block is free or cached once, none of the
    cached ones lost its KV."""
    bm, tier = llm.engine.block_manager, llm.engine.host_tier
    assert bm.num_free_blocks == bm.num_blocks
    assert all(bm.blocks[block_id].hash == h for h, block_id in bm.hash_to_block_id.items())
    host_ids = [host_id for host_id, _ in tier.cached.values()]
    assert sorted(host_ids + tier.free_block_ids) == list(range(tier.num_blocks))
    assert llm.engine.executor.lost_blocks.isdisjoint(host_ids)


def two_turns(path: str, **options) -> tuple[LLM, list[list[int]], list[list[int]]]:
    """Turn 1 of four conversations with the tier on, then an unrelated prompt that moves most of their blocks to
    the host tier; returns the engine, the turn-2 prompts, and the turn-2
    answers with the tier off (equal to transformers: test_every_scheduler_setting)."""
    system = random_prompts(1, low=9, high=10)[0]
    first = [system + p for p in random_prompts(4, seed=1, low=3, high=8)]
    replies = random_prompts(4, seed=10, low=2, high=6)
    off = tight_llm(path, False, **options)
    second = [h + o.outputs[0].token_ids + u for h, o, u in zip(first, off.generate(first, GREEDY, False), replies)]
    expected = [o.outputs[0].token_ids for o in off.generate(second, GREEDY, False)]
    llm = tight_llm(path, True, **options)
    llm.generate(first, GREEDY, use_tqdm=False)
    llm.generate(random_prompts(1, seed=99, low=52, high=53), GREEDY, use_tqdm=False)  # evicts most of them
    return llm, second, expected


@pytest.mark.parametrize("asynchronous", [False, True])
def test_failed_load_fails_only_the_requests_that_needed_it(tiny_models, monkeypatch, asynchronous):
    """A block of one conversation's history fails to come back from the host: that request fails with the
    copy's error, the others of the same step answer as with the tier off, and the block is forgotten by both
    tiers, so the same prompt, sent again, is recomputed and answered right."""
    llm, second, expected = two_turns(tiny_models["qwen3"], async_scheduling=asynchronous, trace=True)
    bm, tier = llm.engine.block_manager, llm.engine.host_tier
    # A block only conversation c has, on the host and not on the device, after blocks a lookup finds.
    chains = [block_hashes(p) for p in second]
    c, target = next((c, h) for c, chain in enumerate(chains) for i, h in enumerate(chain)
                     if h in tier.cached and h not in bm.hash_to_block_id and not any(h in o for o in chains if o
                     is not chain) and all(p in bm.hash_to_block_id or p in tier.cached for p in chain[:i]))
    failed = fail_copies(monkeypatch, llm, lambda src, dst, offloading: not offloading and
                         src == tier.cached[target][0])
    results = run_engine(llm, second, "turn2-")
    [step] = [r for r in llm.trace if failed[0] in [host_id for host_id, _ in r.blocks_loaded]]
    assert len({r.request_id for r in step.scheduled}) > 1  # the step that failed ran other requests too
    tokens, error = results[c]
    assert "kv_offloading: copying KV back from host memory failed: injected copy failure" in str(error)
    assert [r for i, r in enumerate(results) if i != c] == [(e, None) for i, e in enumerate(expected) if i != c]
    assert target not in tier.cached and target not in bm.hash_to_block_id
    check_books_agree(llm)
    monkeypatch.undo()
    assert run_engine(llm, [second[c]], "again-") == [(expected[c], None)]
    check_books_agree(llm)


def test_failed_offload_costs_only_the_host_copy(tiny_models, monkeypatch):
    """Every offload of conversation 0's own blocks fails: no request fails, all answers equal the tier-off ones,
    and the host tier holds none of those blocks (they are recomputed), while it still serves the others."""
    llm, second, expected = two_turns(tiny_models["qwen3"])
    tier = llm.engine.host_tier
    own = set(block_hashes(second[0])).difference(*map(block_hashes, second[1:]))
    host_hash = lambda host_id: next(h for h, (i, _) in tier.cached.items() if i == host_id)  # noqa: E731
    failed = fail_copies(monkeypatch, llm, lambda src, dst, offloading: offloading and host_hash(dst) in own)
    assert run_engine(llm, second, "turn2-") == [(e, None) for e in expected]
    assert failed and own.isdisjoint(tier.cached)
    assert llm.stats.num_host_cached_tokens > 0
    check_books_agree(llm)


def test_a_lost_host_block_loads_nothing(tiny_models, monkeypatch):
    """copy_tier_blocks: a host block whose offload failed fails every load from it, in that step or a later
    one planned before the tier heard (async scheduling), until an offload into it succeeds."""
    llm = tight_llm(tiny_models["qwen3"], True)
    runner, lost = llm.engine.model_runner, llm.engine.executor.lost_blocks
    failed = fail_copies(monkeypatch, llm, lambda src, dst, offloading: offloading and dst == 5)
    offloads = copy_tier_blocks(runner, [(1, 5), (2, 6)], True, lost)
    loads = copy_tier_blocks(runner, [(5, 3), (6, 4)], False, lost)
    assert list(offloads) == [(1, 5)] and list(loads) == [(5, 3)] and failed == [5]
    assert "holds no KV" in str(loads[5, 3])
    assert list(copy_tier_blocks(runner, [(5, 7)], False, lost)) == [(5, 7)]
    monkeypatch.undo()
    runner.kv_cache[:, :, 1] = 0.5
    assert copy_tier_blocks(runner, [(1, 5)], True, lost) == copy_tier_blocks(runner, [(5, 7)], False, lost) == {}
    assert runner.kv_cache[:, :, 7].equal(runner.kv_cache[:, :, 1]) and runner.kv_cache[0, 0, 7, 0, 0, 0] == 0.5


@pytest.mark.parametrize("seed", range(6))
def test_random_failed_loads_under_async_swap_preemption(tiny_models, monkeypatch, seed):
    """Randomized: a third of the loads from the host tier fail, with async scheduling and swap preemption on the
    tight pool (a holder of a bad block may be swapped out by the step planned before the failure is known). Each
    turn sends the tier-off run's prompts: every request that did not fail answers as the tier-off run did; no
    block leaks and the books agree."""
    rng, options = random.Random(seed), dict(async_scheduling=True, preemption_mode="swap")
    turns = conversations(tight_llm(tiny_models["qwen3"], False, **options), GREEDY, num=6, seed=seed)
    llm = tight_llm(tiny_models["qwen3"], True, **options)
    fail_copies(monkeypatch, llm, lambda src, dst, offloading: not offloading and rng.random() < 0.35)
    num_failed = 0
    for turn, (prompts, answers) in enumerate(turns):
        for (tokens, error), answer in zip(run_engine(llm, prompts, f"turn{turn}-"), answers):
            assert error is not None or tokens == answer[0]
            num_failed += error is not None
    check_books_agree(llm)
