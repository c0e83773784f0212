"""LLM.beam_search through the engine (beam_search/scheduler.py) against transformers' generate(num_beams=...):
token for token and in order, on the three tiny architectures, in blocks of 4 (every prompt crosses block
boundaries, and siblings split a shared last block by copy-on-write); the block books step by step; preemption;
the demo model; the refusals."""
import asyncio

import pytest
import torch
from test_beam_search import eos_met_by, hf_beam_search
from transformers import AutoModelForCausalLM

from conftest import ARCHS, make_model, random_prompts
from nanoserve import LLM, AsyncLLM
from nanoserve.beam_search_params import BeamSearchParams
from nanoserve.chapters import beam_search_feature
from nanoserve.engine.core import EngineCore
from nanoserve.sampling_params import SamplingParams

OPTIONS = dict(block_size=4, num_kvcache_blocks=512, max_model_len=64, max_num_seqs=300, enforce_eager=True,
               enable_beam_search=True)
PROMPTS = random_prompts(3, seed=7, low=5, high=14)
MAX_TOKENS = 7


@pytest.fixture(scope="module", params=ARCHS)
def arch_setup(request, tmp_path_factory):
    """An engine on the tiny model whose EOS is a token the search meets (a random model rarely ends by
    itself), transformers' model and those EOS ids."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"beam_{arch}")
    hf = AutoModelForCausalLM.from_pretrained(make_model(root / "plain", arch), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    eos = sorted({eos_met_by(hf, PROMPTS[0], BeamSearchParams(beam_width=w, max_tokens=MAX_TOKENS), [2])[0]
                  for w in (1, 4)})  # tokens that greedy and a wider search meet
    llm = LLM(make_model(root / "eos", arch, eos_token_id=eos), **OPTIONS)
    assert llm.engine.config.eos_token_ids == eos
    yield llm, hf, eos
    del llm


@pytest.mark.parametrize("beam_width", [1, 2, 4, 8])
def test_equals_transformers(arch_setup, beam_width):
    """All prompts at once (one group each), with and without EOS, length penalties 0.5, 1 and 2."""
    llm, hf, eos = arch_setup
    num_stops = 0
    for ignore_eos in (True, False):
        for length_penalty in (0.5, 1.0, 2.0):
            params = BeamSearchParams(beam_width=beam_width, max_tokens=MAX_TOKENS, ignore_eos=ignore_eos,
                                      length_penalty=length_penalty)
            outputs = llm.beam_search(PROMPTS, params, use_tqdm=False)
            for prompt, output in zip(PROMPTS, outputs):
                token_ids, scores = hf_beam_search(hf, prompt, params, eos)
                assert [c.token_ids for c in output.outputs] == token_ids
                if scores is not None:  # transformers' sequences_scores: the penalised cumulative logprob
                    ours = [c.cumulative_logprob / len(c.token_ids) ** length_penalty for c in output.outputs]
                    assert ours == pytest.approx(scores, abs=1e-4)
                num_stops += sum(c.finish_reason == "stop" for c in output.outputs)
    assert num_stops > 0  # EOS did end some beams
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_width_one_is_greedy(arch_setup):
    llm, _, _ = arch_setup
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=MAX_TOKENS), use_tqdm=False)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [b.outputs[0].token_ids for b in beams] == [g.outputs[0].token_ids for g in greedy]


def test_block_books(tiny_models):
    """Step by step: beams share blocks (fewer physical blocks than the beams' block tables list), split a
    shared last block by copy-on-write, every ref count is the number of block tables holding the block, and
    every block is free at the end."""
    llm = LLM(tiny_models["qwen3"], **{**OPTIONS, "enable_prefix_caching": False})
    engine, bm = llm.engine, llm.engine.block_manager
    plans, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]  # to read each step's copies
    params = BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True)
    beam_search_feature(engine).add_beam_request("r", PROMPTS[0], params)
    saving = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        tables = [s.block_table for s in engine.requests["r"].seqs] if "r" in engine.requests else []
        for block in bm.blocks:
            assert block.ref_count == sum(t.count(block.block_id) for t in tables)
        saving.append(sum(map(len, tables)) - (bm.num_blocks - bm.num_free_blocks))
    assert max(saving) > 0 and min(saving) >= 0
    assert sum(len(p.blocks_to_copy) for p in plans) > 0
    assert len(outputs) == 4 and all(len(o.new_token_ids) == 12 for o in outputs)
    assert bm.num_free_blocks == bm.num_blocks


def test_beam_rows_skip_the_sampler(tiny_models):
    """Nothing is drawn for a beam: beside a beam search in the same batches, the sampler sees only the other
    request's row each step, and both give what they give alone."""
    llm = LLM(tiny_models["qwen3"], **OPTIONS)
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    beam_alone = [c.token_ids for c in llm.beam_search([PROMPTS[0]], params, use_tqdm=False)[0].outputs]
    greedy_alone = llm.generate([PROMPTS[1]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    rows = []
    llm.engine.model_runner.sampler.register_forward_pre_hook(lambda _, args: rows.append(len(args[0])))
    beam_search_feature(llm.engine).add_beam_request("beams", PROMPTS[0], params)
    llm.engine.add_request("greedy", PROMPTS[1], greedy)
    tokens = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
    assert rows == [1] * 6  # the greedy request's row in each of the 6 steps, never a beam's
    assert [tokens["beams", i] for i in range(3)] == beam_alone and tokens["greedy", 0] == greedy_alone


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_equal_results(tiny_models, mode):
    prompts = random_prompts(4, seed=3, low=6, high=12)
    params = BeamSearchParams(beam_width=4, max_tokens=10, ignore_eos=True)
    roomy = LLM(tiny_models["qwen3"], **OPTIONS).beam_search(prompts, params, use_tqdm=False)
    small = LLM(tiny_models["qwen3"], **{**OPTIONS, "num_kvcache_blocks": 20, "preemption_mode": mode,
                                         "swap_space": 0.01})
    tight = small.beam_search(prompts, params, use_tqdm=False)
    assert small.stats.num_preemptions > 0
    if mode == "swap":
        assert small.stats.num_swapped_in > 0
    assert [[c.token_ids for c in o.outputs] for o in tight] == [[c.token_ids for c in o.outputs] for o in roomy]
    assert small.engine.block_manager.num_free_blocks == small.engine.block_manager.num_blocks


@pytest.mark.parametrize("budget", [4, 6, 7, 16])
def test_chunked_prefill_gives_equal_results(tiny_models, budget):
    """With enable_chunked_prefill the token budget cuts the prompts into chunks and, at 6 or 7 tokens, runs only
    part of a request's beams in some steps (those compute their token again with the others the next step):
    the same results as without, every block free at the end."""
    params = BeamSearchParams(beam_width=4, max_tokens=10, ignore_eos=True)
    plain = LLM(tiny_models["qwen3"], **OPTIONS).beam_search(PROMPTS, params, use_tqdm=False)
    llm = LLM(tiny_models["qwen3"], **OPTIONS, enable_chunked_prefill=True, max_num_batched_tokens=budget)
    partial, schedule = [], llm.engine.scheduler.schedule

    def schedule_and_watch():
        out = schedule()
        ran = {r.seq.seq_id for r in out.rows if r.do_sample}
        partial.extend(0 < sum(s.seq_id in ran for s in r.seqs) < len(r.seqs) for r in llm.engine.requests.values())
        return out

    llm.engine.scheduler.schedule = schedule_and_watch
    chunked = llm.beam_search(PROMPTS, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in chunked] == [[c.token_ids for c in o.outputs] for o in plain]
    assert llm.stats.num_chunked_prefills > 0 and any(partial) == (budget in (6, 7))
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_demo_model(converted):
    """The demo model (SmolLM2-135M-Instruct) on a real prompt, with its own EOS, against transformers."""
    path = str(converted[1])
    llm = LLM(path, max_model_len=128, enforce_eager=True, enable_beam_search=True)
    prompt = llm.tokenizer.encode("The capital of France is")
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    output = llm.beam_search([prompt], params, use_tqdm=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    token_ids, _ = hf_beam_search(hf, prompt, params, llm.engine.config.eos_token_ids)
    assert [c.token_ids for c in output.outputs] == token_ids
    assert output.outputs[0].text == llm.tokenizer.decode(token_ids[0], skip_special_tokens=True)


@pytest.mark.parametrize("options, params, words", [
    ({}, dict(beam_width=301, max_tokens=4), ["beam_width (301)", "max_num_seqs (300)"]),
    ({}, dict(beam_width=300, max_tokens=4), ["beam_width (300)", "600 candidates", "512 tokens"]),
    ({}, dict(beam_width=8, max_tokens=60), ["max_tokens (60)", "max_model_len"]),
    ({"num_kvcache_blocks": 30}, dict(beam_width=8, max_tokens=40), ["KV blocks", "num_kvcache_blocks is 30"]),
    ({"async_scheduling": True}, dict(beam_width=2, max_tokens=4), ["async_scheduling"]),
    ({"enable_chunked_prefill": True, "max_num_batched_tokens": 3}, dict(beam_width=4, max_tokens=4),
     ["beam_width (4)", "max_num_batched_tokens (3)"]),  # a step could never run all the beams
])
def test_refused_before_work(tiny_models, options, params, words):
    llm = LLM(tiny_models["qwen3"], **{**OPTIONS, **options})
    with pytest.raises(ValueError) as e:
        llm.beam_search([PROMPTS[0], PROMPTS[1]], BeamSearchParams(**params), use_tqdm=False)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert not llm.engine.requests and llm.engine.scheduler.is_finished()


def test_an_engine_built_without_beam_search_refuses_it(tiny_models):
    """Beam search is switched on by the config: without enable_beam_search the engine has none of it, and
    LLM.beam_search and AsyncLLM.beam_search are refused naming the option, before anything is queued."""
    options, params = {**OPTIONS, "enable_beam_search": False}, BeamSearchParams(beam_width=2, max_tokens=3)
    message = r"^beam search: this engine was built without it; pass LLM\(\.\.\., enable_beam_search=True\)$"
    llm = LLM(tiny_models["qwen3"], **options)
    assert getattr(llm.engine, "beam_search_config", None) is None
    with pytest.raises(ValueError, match=message):
        llm.beam_search(PROMPTS, params, use_tqdm=False)
    assert not llm.engine.requests and llm.engine.scheduler.is_finished()
    # the same from the chapters' composite engine (another chapter asked for), built without beam search
    llm = LLM(tiny_models["qwen3"], trace=True, **options)
    assert type(llm.engine) is not EngineCore and llm.engine.beam_search_config is None
    with pytest.raises(ValueError, match=message):
        llm.beam_search(PROMPTS, params, use_tqdm=False)
    assert not llm.engine.requests and llm.engine.scheduler.is_finished()
    engine = AsyncLLM(tiny_models["qwen3"], **options)

    async def search() -> None:
        async for _ in engine.beam_search(PROMPTS[0], params):
            pass

    try:
        with pytest.raises(ValueError, match=message):
            engine.check_beam_request(PROMPTS[0], params)  # what the server asks first
        with pytest.raises(ValueError, match=message):
            asyncio.run(search())
        assert not engine.engine_core.requests
    finally:
        engine.shutdown()


def test_speculation_leaves_beams_alone(tiny_models):
    """Beams take one token a step through their search: n-gram drafts (which these repeating prompts would
    invite) are never proposed for them, and the results equal an engine without speculation."""
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11] * 4]
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    plain = LLM(tiny_models["qwen3"], **OPTIONS).beam_search(prompts, params, use_tqdm=False)
    spec = LLM(tiny_models["qwen3"], **OPTIONS, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                    "prompt_lookup_min": 2, "prompt_lookup_max": 3})
    outputs = spec.beam_search(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[c.token_ids for c in o.outputs] for o in plain]
    assert spec.stats.spec_decoding.num_drafts == 0
