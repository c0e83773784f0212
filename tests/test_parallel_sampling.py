"""Parallel sampling (SamplingParams.n): the prompt is prefilled once, the n sequences fork from it sharing its
KV blocks, a shared partly filled block is copied before a write (copy-on-write), and preemption takes all of
a request's sequences (vLLM V0's sequence group). Scheduler tests use fake tokens, as in the policy tests."""
import asyncio

import pytest
from test_scheduling_policies import (
    BS,
    TOKEN,
    all_free,
    batch,
    ids,
    make,  # noqa: F401 (the fixture)
    run_to_end,
)

from conftest import random_prompts
from nanoserve import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence, SequenceStatus

OPTIONS = dict(block_size=4, max_model_len=64)


def add_request(s: Scheduler, first_id: int, num_tokens: int, n: int, **params) -> list[Sequence]:
    """What EngineCore.add_request does: n sequences of one prompt; the first is queued, the others fork."""
    params = SamplingParams(n=n, **params)
    seqs = [Sequence(first_id + i, [100 + 10 * first_id + j for j in range(num_tokens)], params, BS, index=i)
            for i in range(n)]
    for seq in seqs:
        seq.group = seqs
    s.add(seqs[0])
    return seqs


def refs(s: Scheduler, num: int) -> list[int]:
    return [b.ref_count for b in s.block_manager.blocks[:num]]


def test_fork_then_copy_on_write(make):  # noqa: F811
    s = make(num_blocks=8)
    family = add_request(s, 0, 6, n=3, max_tokens=3)  # blocks 0 and 1; block 1 holds 2 of its 4 tokens
    out = s.schedule()
    assert batch(out) == [(0, 6)] and [r.forks for r in out.rows] == [family[1:]]  # the prompt is computed once
    s.postprocess(out, [7, 8, 9])  # its last row is sampled 3 times: one first token per sequence
    assert [seq.completion_token_ids for seq in family] == [[7], [8], [9]]
    assert [seq.block_table for seq in family] == [[0, 1]] * 3 and refs(s, 3) == [3, 3, 0]
    assert ids(s.running) == [0, 1, 2] and [seq.num_computed_tokens for seq in family] == [6, 6, 6]
    out = s.schedule()  # each writes its token into block 1's 3rd slot: the first two get copies
    assert batch(out) == [(0, 1), (1, 1), (2, 1)] and out.blocks_to_copy == [(1, 2), (1, 3)]
    assert [seq.block_table for seq in family] == [[0, 2], [0, 3], [0, 1]] and refs(s, 4) == [3, 1, 1, 1]
    s.postprocess(out, [TOKEN] * 3)
    out = s.schedule()
    assert out.blocks_to_copy == [] and refs(s, 5) == [3, 1, 1, 1, 0]  # private blocks now: no more copies
    s.postprocess(out, [TOKEN] * 3)
    assert all(seq.is_finished for seq in family) and all_free(s)  # the books balance


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_takes_all_sequences_of_a_request(make, mode):  # noqa: F811
    s = make(num_blocks=5, num_host_blocks=8 if mode == "swap" else 0, preemption_mode=mode)
    x = add_request(s, 0, 5, n=1, max_tokens=6)[0]  # blocks 0, 1
    family = add_request(s, 1, 6, n=2, max_tokens=3)  # blocks 2, 3, shared after the fork; 1 block is free
    step_out = s.schedule()
    s.postprocess(step_out, [TOKEN] * 3)
    out = s.schedule()  # both need a copy of block 3, one block is free: the request gives all its KV up
    assert batch(out) == [(0, 1)] and out.preempted == family
    if mode == "swap":
        assert out.blocks_to_swap_out == [(2, 0), (3, 1)]  # shared blocks move once and stay shared
        assert [seq.block_table for seq in family] == [[0, 1]] * 2 and ids(s.swapped) == [1, 2]
        assert [b.ref_count for b in s.host_block_manager.blocks[:2]] == [2, 2]
    else:
        assert [seq.block_table for seq in family] == [[], []] and ids(s.waiting) == [1, 2]
    assert {seq.status for seq in family} == {SequenceStatus.SWAPPED if mode == "swap" else SequenceStatus.WAITING}
    s.postprocess(out, [TOKEN])
    run_to_end(s)
    assert x.is_finished and all(len(seq.completion_token_ids) == 3 for seq in family) and all_free(s)


def test_every_sequence_reports_the_prompt_cache_hits(tiny_models):
    """The first sequence prefills the prompt for all n: the request's num_cached_tokens is its hits."""
    llm = LLM(tiny_models["llama"], **OPTIONS, num_kvcache_blocks=64)
    prompt = random_prompts(1, seed=12, low=20, high=21)[0]
    llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    outputs = llm.generate([prompt], SamplingParams(n=3, seed=1, max_tokens=6), use_tqdm=False)
    assert outputs[0].num_cached_tokens == 16  # 4 full blocks of the 20 tokens (the last one is computed)


def test_n_sequences_equal_n_requests_seeded_by_the_rule(tiny_models):
    """Sequence i of a request with seed s samples as a request of its own with seed s + i."""
    llm = LLM(tiny_models["llama"], **OPTIONS, num_kvcache_blocks=64, max_logprobs=2)
    prompts = random_prompts(2, seed=4, low=5, high=14)
    params = SamplingParams(n=4, seed=11, max_tokens=12, presence_penalty=0.5, logprobs=2, prompt_logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        alone = llm.generate([prompt] * 4, [SamplingParams(seed=11 + i, max_tokens=12, presence_penalty=0.5,
                                                           logprobs=2) for i in range(4)], use_tqdm=False)
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        assert [c.token_ids for c in out.outputs] == [a.outputs[0].token_ids for a in alone]
        assert [list(map(list, c.logprobs)) for c in out.outputs] == [list(map(list, a.outputs[0].logprobs))
                                                                      for a in alone]
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # they did diverge
        assert out.prompt_logprobs[0] is None  # computed once, by the first sequence, for all of them:
        assert all(t in d for d, t in zip(out.prompt_logprobs[1:], prompt[1:]))
    assert llm.stats.num_prompt_tokens == sum(map(len, prompts)) * 5  # the n=4 prompts were prefilled once


@pytest.mark.parametrize("options", [dict(preemption_mode="recompute"), dict(preemption_mode="swap", swap_space=0.01),
                                     dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
                                     dict(async_scheduling=True, preemption_mode="swap", swap_space=0.01)])
def test_preemption_and_swap_keep_outputs_right(tiny_models, options):
    prompts = random_prompts(4, seed=5, low=5, high=20)
    params = SamplingParams(n=3, seed=3, max_tokens=16, ignore_eos=True)
    roomy = LLM(tiny_models["qwen3"], **OPTIONS, num_kvcache_blocks=128).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_models["qwen3"], **OPTIONS, num_kvcache_blocks=24, **options)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[c.token_ids for c in o.outputs] for o in roomy]
    assert llm.stats.num_preemptions > 0
    assert llm.stats.num_swapped_out > 0 or options.get("preemption_mode") != "swap"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_async_llm_streams_each_sequence_with_its_index(tiny_models):
    prompt, params = [5, 6, 7, 8, 9], dict(n=3, seed=2, max_tokens=6, ignore_eos=True)
    expected = LLM(tiny_models["llama"], **OPTIONS, num_kvcache_blocks=64).generate(
        [prompt], SamplingParams(**params), use_tqdm=False)[0]

    async def stream():
        llm = AsyncLLM(tiny_models["llama"], **OPTIONS, num_kvcache_blocks=64)
        try:
            deltas = [out async for out in llm.generate(prompt, SamplingParams(
                **params, output_kind=RequestOutputKind.DELTA))]
            aborted = []
            async for out in llm.generate(prompt, SamplingParams(n=3, max_tokens=40), request_id="long"):
                aborted.append(out)
                if len(aborted) == 2:
                    llm.abort("long")  # one abort ends all three sequences
            return deltas, aborted[-1]
        finally:
            llm.shutdown()

    deltas, aborted = asyncio.run(stream())
    assert aborted.finished and {c.finish_reason for c in aborted.outputs} == {"abort"}
    tokens = {i: [] for i in range(3)}
    for out in deltas:
        for c in out.outputs:
            tokens[c.index] += c.token_ids
    assert list(tokens.values()) == [c.token_ids for c in expected.outputs]
    assert [out.finished for out in deltas].count(True) == 1 and deltas[-1].finished


def test_bad_n(tiny_models):
    with pytest.raises(ValueError, match="n must be an integer >= 1, got 0"):
        SamplingParams(n=0)
    llm = LLM(tiny_models["llama"], **OPTIONS, num_kvcache_blocks=8, max_num_seqs=2)
    with pytest.raises(ValueError, match=r"n \(3\) exceeds max_num_seqs \(2\)"):
        llm.generate([[5, 6]], SamplingParams(n=3), use_tqdm=False)
    # 6 prompt tokens: 1 shared full block, then each of the 2 sequences needs (2 + 12) / 4 -> 4 blocks
    with pytest.raises(ValueError, match="needs 9 KV blocks but num_kvcache_blocks is 8"):
        llm.generate([list(range(5, 11))], SamplingParams(n=2, max_tokens=12), use_tqdm=False)
