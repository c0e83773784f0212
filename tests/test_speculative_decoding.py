"""Speculative decoding end to end, with each proposer: n-gram lookup, a draft model that always agrees (the
target itself: acceptance 100%) and one that never does (a differently seeded tiny model). Greedy output equals
greedy output without it and transformers', token for token, for k in {1, 3, 5} and under the scheduler
options; proposals happen and are accepted (the prompts repeat patterns); and after random accept/reject
patterns the books balance and the prefix cache holds only verified tokens."""
import random

import pytest
from test_scheduling_equality import BLOCK_BYTES, BLOCK_SIZE, COMBOS, run

from conftest import (
    ARCHS,
    ROOMY_POOL,
    assert_killed_worker_fails_fast,
    hf_greedy,
    make_model,
    make_scheduler,
    random_prompts,
)
from nanoserve import LLM, SamplingParams
from nanoserve.config import Config
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence, compute_hash
from nanoserve.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID

MAX_TOKENS = 32


def ngram(k: int, **options) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            **options}


PROPOSERS = ["ngram", "draft_same", "draft_other"]


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory) -> str:
    """A tiny Qwen3 of another seed: the same vocabulary and KV shapes as every tiny model, other weights."""
    return make_model(tmp_path_factory.mktemp("draft") / "qwen3", "qwen3", seed=1)


def spec_config(proposer: str, k: int, target: str, other_draft: str) -> dict:
    if proposer == "ngram":
        return ngram(k)
    return {"method": "draft_model", "model": target if proposer == "draft_same" else other_draft,
            "num_speculative_tokens": k}


def check_acceptance(proposer: str, spec, k: int) -> None:
    """Drafts were verified; n-gram's sometimes accepted, the target's own always, the other model's rarely."""
    assert spec.num_drafts > 0 and spec.num_draft_tokens <= k * spec.num_drafts
    assert len(spec.num_accepted_tokens_per_pos) <= k and spec.mean_acceptance_length <= k + 1
    if proposer == "ngram":
        assert spec.num_accepted_tokens > 0 and spec.mean_acceptance_length > 1
    elif proposer == "draft_same":
        assert spec.acceptance_rate == 1.0
    else:
        assert spec.acceptance_rate < 0.5


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Random patterns repeated a few times: the n-gram proposer finds them, the model sometimes agrees."""
    rng = random.Random(seed)
    return [pattern * rng.randint(2, 4) + pattern[: rng.randint(0, len(pattern))]
            for pattern in random_prompts(n, seed=seed, low=2, high=12)]


def completions(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def expected(tiny_models):
    prompts = repetitive_prompts(12, seed=1)
    return prompts, {arch: hf_greedy(tiny_models[arch], prompts, MAX_TOKENS) for arch in ARCHS}


@pytest.mark.parametrize("proposer", PROPOSERS)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_transformers(tiny_models, other_draft, expected, proposer, arch, k):
    prompts, reference = expected
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    llm = LLM(tiny_models[arch], block_size=4, **ROOMY_POOL,
              speculative_config=spec_config(proposer, k, tiny_models[arch], other_draft))
    assert completions(llm.generate(prompts, greedy, use_tqdm=False)) == reference[arch]
    check_acceptance(proposer, llm.stats.spec_decoding, k)
    assert llm.stats.num_generated_tokens == sum(map(len, reference[arch]))
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def spec_requests(use_priority: bool) -> list[tuple[int, list[int], SamplingParams, int]]:
    """As test_scheduling_equality's (three long requests, then three urgent ones, a shared prefix), with
    repeated patterns."""
    shared = random_prompts(1, seed=7, low=8, high=9)[0]
    prompts = [shared + p for p in repetitive_prompts(6, seed=8)]
    params = SamplingParams(temperature=0, max_tokens=16)
    return [(0 if i < 3 else 3, prompt[:48], params, int(use_priority and i < 3)) for i, prompt in enumerate(prompts)]


@pytest.fixture(scope="module")
def expected_combos(tiny_models):
    prompts = [prompt for _, prompt, _, _ in spec_requests(False)]
    return {"qwen3": hf_greedy(tiny_models["qwen3"], prompts, 16)}


@pytest.mark.parametrize("proposer", PROPOSERS)
@pytest.mark.parametrize("prefix_caching, async_scheduling", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("chunked, policy, mode", COMBOS)
def test_every_scheduler_combination_equals_transformers(tiny_models, other_draft, expected_combos, chunked, policy,
                                                         mode, prefix_caching, async_scheduling, proposer):
    """A pool too small for all six (preemption, swapping), a token budget that trims drafts (chunked). (Qwen3:
    the tiny model whose output repeats itself most, so drafts get accepted.) A draft model's KV lives in the
    same blocks, so they are twice the bytes: twice the swap space for as many host blocks. Async scheduling:
    preempted (recomputed or swapped) while a step verifies its drafts, the rollback finds its KV where it is."""
    arch = "qwen3"
    block_bytes = BLOCK_BYTES * (1 if proposer == "ngram" else 2)
    llm = LLM(tiny_models[arch], block_size=BLOCK_SIZE, num_kvcache_blocks=18, max_model_len=64,
              max_num_batched_tokens=16 if chunked else 64, enable_chunked_prefill=chunked,
              scheduling_policy=policy, preemption_mode=mode, swap_space=24 * block_bytes / 2**30,
              enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling,
              speculative_config=spec_config(proposer, 3, tiny_models[arch], other_draft))
    assert run(llm.engine, spec_requests(policy == "priority")) == expected_combos[arch]
    stats = llm.stats
    assert stats.num_preemptions > 0
    check_acceptance(proposer, stats.spec_decoding, 3)
    if mode == "swap":
        assert stats.num_swapped_in == stats.num_swapped_out > 0
    scheduler = llm.engine.scheduler
    for pool in (scheduler.block_manager, getattr(scheduler, "host_block_manager", None)):
        assert pool is None or pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("proposer", ["ngram", "draft_same"])
def test_options_inside_an_accepted_run(tiny_models, proposer):
    """n > 1, logprobs, min_tokens, stop tokens and max_tokens landing inside a run of accepted drafts: the
    same tokens (and logprobs) as without speculation."""
    prompts = repetitive_prompts(4, seed=3)
    plain = LLM(tiny_models["qwen3"], block_size=4, max_logprobs=3, **ROOMY_POOL)
    ref = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    stop_ids = [ref[0].outputs[0].token_ids[5], ref[1].outputs[0].token_ids[3]]
    llm = LLM(tiny_models["qwen3"], block_size=4, max_logprobs=3, **ROOMY_POOL,
              speculative_config=spec_config(proposer, 5, tiny_models["qwen3"], tiny_models["qwen3"]))
    for params in (SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=2, logprobs=3),
                   SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=stop_ids, min_tokens=4),
                   SamplingParams(temperature=0, max_tokens=7, repetition_penalty=1.3, frequency_penalty=0.5)):
        want = plain.generate(prompts, params, use_tqdm=False)
        got = llm.generate(prompts, params, use_tqdm=False)
        for w, g in zip(want, got):
            for cw, cg in zip(w.outputs, g.outputs, strict=True):
                assert (cg.token_ids, cg.finish_reason, cg.stop_reason) == (cw.token_ids, cw.finish_reason,
                                                                            cw.stop_reason)
                if cw.logprobs is not None:
                    assert [sorted(d) for d in cg.logprobs] == [sorted(d) for d in cw.logprobs]
                    assert [d[t].logprob for d, t in zip(cg.logprobs, cg.token_ids)] == pytest.approx(
                        [d[t].logprob for d, t in zip(cw.logprobs, cw.token_ids)], abs=1e-4)
    assert llm.stats.spec_decoding.num_accepted_tokens > 0


@pytest.mark.parametrize("proposer", ["ngram", "draft_other"])
def test_seeded_sampling_is_reproducible(tiny_models, other_draft, proposer):
    prompts = repetitive_prompts(4, seed=4)
    params = [SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=MAX_TOKENS) for i in range(4)]
    spec = spec_config(proposer, 3, tiny_models["qwen3"], other_draft)
    runs = [completions(LLM(tiny_models["qwen3"], block_size=4, **ROOMY_POOL, speculative_config=spec)
                        .generate(prompts, params, use_tqdm=False)) for _ in range(2)]
    assert runs[0] == runs[1]


def test_disable_by_batch_size(tiny_models):
    prompts = repetitive_prompts(4, seed=5)
    llm = LLM(tiny_models["qwen3"], block_size=4, **ROOMY_POOL,
              speculative_config=ngram(3, disable_by_batch_size=2))
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert llm.stats.spec_decoding.num_drafts == 0  # four running requests, never more than two speculate
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert llm.stats.spec_decoding.num_drafts > 0


@pytest.mark.parametrize("options, message", [
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 3}, "model: 'x' is not a model folder"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    (ngram(0), "num_speculative_tokens must be in"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_config(tiny_models, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_models["qwen3"], speculative_config=options)


@pytest.mark.parametrize("overrides, options, message", [
    ({"vocab_size": 256}, {}, r"model: the draft's vocab_size \(256\) differs from the target's \(512\)"),
    ({"num_key_value_heads": 1}, {}, r"draft's num_key_value_heads \(1\) differs"),
    ({"head_dim": 8}, {}, r"draft's head_dim \(8\) differs"),
    ({}, {"pipeline_parallel_size": 2}, "needs pipeline_parallel_size=1: the draft runs whole before the target"),
    ({"num_attention_heads": 2}, {"tensor_parallel_size": 4},
     r"speculative_config.model: tensor_parallel_size \(4\) must divide num_attention_heads \(2\)"),
    ({"intermediate_size": 129}, {"tensor_parallel_size": 2},
     r"speculative_config.model: tensor_parallel_size \(2\) must divide intermediate_size \(129\)"),
])
def test_bad_draft_model(tiny_models, tmp_path, overrides, options, message):
    """A draft that cannot propose the target's tokens or share its KV blocks is refused before any work."""
    draft = make_model(tmp_path / "draft", "qwen3", seed=1, **overrides)
    with pytest.raises(ValueError, match=message):
        LLM(tiny_models["qwen3"], speculative_config={"model": draft, "num_speculative_tokens": 3}, **options)


@pytest.mark.parametrize("proposer", PROPOSERS)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_async_scheduling_equals_transformers(tiny_models, other_draft, expected, proposer, k):
    """Async scheduling plans a step while the one before runs: a request whose newest token that step samples
    sits the planned step out, and runs (drafts and all) in the step after."""
    prompts, reference = expected
    llm = LLM(tiny_models["qwen3"], block_size=4, **ROOMY_POOL, async_scheduling=True,
              speculative_config=spec_config(proposer, k, tiny_models["qwen3"], other_draft))
    assert completions(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                    use_tqdm=False)) == reference["qwen3"]
    check_acceptance(proposer, llm.stats.spec_decoding, k)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


# ---- the books, with fake model outputs ------------------------------------------------------------------
def check_books(scheduler: Scheduler, seqs: list[Sequence]) -> None:
    """Ref counts equal the block tables' references; free blocks are exactly those nobody holds; every block
    in the prefix cache holds a full block of some sequence's tokens, drafts never (they are not in token_ids
    until accepted), with the right chained hash."""
    bm = scheduler.block_manager
    refs = [0] * bm.num_blocks
    for seq in seqs:
        for b in seq.block_table:
            refs[b] += 1
    assert [b.ref_count for b in bm.blocks] == refs
    assert sorted(bm.free_block_ids) == [b for b in range(bm.num_blocks) if refs[b] == 0]
    verified = set()
    for seq in seqs:
        h = -1
        for i in range(len(seq.token_ids) // bm.block_size):
            h = compute_hash(seq.block(i), h)
            verified.add(h)
    for h, b in bm.hash_to_block_id.items():
        assert h in verified and bm.blocks[b].hash == h


@pytest.mark.parametrize("seed", range(8))
def test_random_accept_reject_keeps_the_books(tiny_models, seed):
    """Random drafts, random accepted lengths (the fake verifier), random budgets: the scheduler's rollback
    leaves the block books balanced and the prefix cache serving only verified tokens."""
    rng = random.Random(seed)
    bs, num_blocks = 4, 40
    config = Config(tiny_models["qwen3"], block_size=bs, num_kvcache_blocks=num_blocks, max_num_seqs=6,
                    max_num_batched_tokens=rng.choice([8, 16, 64]), max_model_len=64, enable_chunked_prefill=True,
                    speculative_config=ngram(5))
    scheduler = make_scheduler(config, BlockManager(num_blocks, bs))

    def propose_drafts() -> None:  # random drafts, as the proposer sets them: only for decoding sequences
        for seq in scheduler.running:
            if seq.num_computed_tokens == len(seq.token_ids) - 1:
                seq.spec_token_ids = [rng.randrange(3, 50) for _ in range(rng.randint(0, 5))]

    scheduler.propose_drafts = propose_drafts
    seqs = []
    shared = [rng.randrange(3, 50) for _ in range(8)]
    for i in range(6):
        prompt = shared[: rng.randint(0, 8)] + [rng.randrange(3, 50) for _ in range(rng.randint(1, 12))]
        seqs.append(Sequence(i, prompt, SamplingParams(max_tokens=rng.randint(4, 30), ignore_eos=True), bs))
        scheduler.add(seqs[-1])
    while not scheduler.is_finished():
        out = scheduler.schedule()
        rows = []
        for seq, do_sample in ((r.seq, r.do_sample) for r in out.rows):
            if not do_sample:
                continue
            drafts = out.scheduled_spec_decode_tokens.get(seq.seq_id, [])
            accepted = rng.randint(0, len(drafts))
            row = drafts[:accepted] + [rng.randrange(3, 50)]
            rows += row + [PLACEHOLDER_TOKEN_ID] * (len(drafts) + 1 - len(row)) if drafts else row
        scheduler.postprocess(out, rows)
        for seq in scheduler.running:
            assert seq.num_computed_tokens == len(seq.token_ids) - 1 or seq.num_completion_tokens == 0
            assert len(seq.block_table) <= -(-len(seq.token_ids) // bs)  # rejected drafts' blocks came back
        check_books(scheduler, seqs)
    for seq in seqs:
        assert seq.num_completion_tokens == seq.sampling_params.max_tokens
    stats = scheduler.stats.spec_decoding
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert scheduler.block_manager.num_free_blocks == num_blocks


def test_tensor_parallel(tiny_models):
    """Two ranks: the verify step's 1 + k rows run on both, rank 0 verifies; the same tokens as one rank."""
    prompts = repetitive_prompts(4, seed=6)
    greedy = SamplingParams(temperature=0, max_tokens=16)
    one = LLM(tiny_models["qwen3"], block_size=4, **ROOMY_POOL)
    want = completions(one.generate(prompts, greedy, use_tqdm=False))
    del one
    llm = LLM(tiny_models["qwen3"], block_size=4, **ROOMY_POOL, tensor_parallel_size=2, speculative_config=ngram(3))
    assert completions(llm.generate(prompts, greedy, use_tqdm=False)) == want
    assert llm.stats.spec_decoding.num_accepted_tokens > 0
    del llm


@pytest.mark.parametrize("proposer, k, options", [("draft_same", 3, {}),
                                                 ("draft_other", 1, {"async_scheduling": True})])
def test_draft_model_tensor_parallel(tiny_models, other_draft, expected, proposer, k, options):
    """Two ranks, each with its half of the draft's layers as of the target's: every draft forward runs on both
    (rank 0 takes the argmax), and the output is transformers', also with async scheduling. Then a worker killed
    as it runs a draft forward makes generate fail within seconds, naming it, instead of hanging in the draft's
    all-reduce."""
    prompts, reference = expected
    llm = LLM(tiny_models["qwen3"], block_size=4, **ROOMY_POOL, tensor_parallel_size=2, **options,
              speculative_config=spec_config(proposer, k, tiny_models["qwen3"], other_draft))
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    assert completions(llm.generate(prompts, greedy, use_tqdm=False)) == reference["qwen3"]
    check_acceptance(proposer, llm.stats.spec_decoding, k)
    runner, drafts = llm.engine.model_runner, []  # whether each run_model call is the draft's (draft=True)
    run_model = runner.run_model
    runner.run_model = lambda *args: drafts.append(args[4:] == (True,)) or run_model(*args)
    worker = assert_killed_worker_fails_fast(llm, prompts[:4], greedy)
    assert drafts[:3] == [True, False, True]  # step 1: the draft, the target; killed in step 2's first draft pass
    assert not worker.is_alive()
    del llm


def test_stop_string_inside_an_accepted_run(converted):
    """A stop string that ends inside a run of accepted drafts ends the text exactly there: the same text, token
    ids and reasons as without speculation. (The demo model copying a sentence from its prompt: n-gram lookup
    proposes the rest of it, and the model accepts runs of it.)"""
    path = str(converted[1])
    plain = LLM(path, max_model_len=256, cpu_kvcache_space=0.25)
    llm = LLM(path, max_model_len=256, cpu_kvcache_space=0.25,
              speculative_config=ngram(5, prompt_lookup_min=2, prompt_lookup_max=5))
    messages = [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog, twice."}]
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = llm.tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=40)
    llm.engine.add_request("runs", prompt, params)  # step by step: which tokens each step emitted
    runs = []
    while llm.engine.has_unfinished_requests():
        runs += [out.new_token_ids for out in llm.engine.step()]
    ids = sum(runs, [])
    # The first run of 3 or more accepted tokens; the stop string ends with the middle one.
    first = next(i for i, run in enumerate(runs) if len(run) >= 3)
    end = sum(map(len, runs[:first])) + len(runs[first]) // 2 + 1
    before, full = llm.tokenizer.decode(ids[:end]), llm.tokenizer.decode(ids)
    stop = next(before[-n:] for n in range(3, len(before) + 1) if full.find(before[-n:]) + n == len(before))
    want = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop=[stop]), use_tqdm=False)[0]
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop=[stop]), use_tqdm=False)[0]
    assert want.outputs[0].text == before[: -len(stop)] and want.outputs[0].token_ids == ids[:end]
    for field in ("text", "token_ids", "finish_reason", "stop_reason"):
        assert getattr(got.outputs[0], field) == getattr(want.outputs[0], field)
