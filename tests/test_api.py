"""The LLM API: bad input is a clear ValueError that leaves the engine usable; outputs, ordering, seeds."""
import gc
import importlib.util
import json
import shutil

import numpy as np
import pytest

from conftest import hf_greedy
from nanoserve import LLM, SamplingParams
from nanoserve.config import make_config

EOS = 2
MAX_TOKENS = 8
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 43))]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
OPTIONS = dict(block_size=4, num_kvcache_blocks=16, max_model_len=48, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["qwen3"], **OPTIONS)


@pytest.fixture(scope="module")
def expected(tiny_models):
    return hf_greedy(tiny_models["qwen3"], PROMPTS, MAX_TOKENS)


def completions(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_idle(llm: LLM) -> None:
    """No request left queued and every KV block back in the pool."""
    scheduler, bm = llm.engine.scheduler, llm.engine.block_manager
    assert not scheduler.waiting and not scheduler.running
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def assert_usable(llm: LLM, expected) -> None:
    assert completions(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    assert_idle(llm)


def fail_on_call(llm: LLM, monkeypatch, n: int) -> None:
    """Make the n-th model forward raise, as an out-of-memory or a kernel error would."""
    execute, calls = llm.engine.executor.execute_model, []

    def failing_execute(out, inputs):
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError("injected failure")
        return execute(out, inputs)

    monkeypatch.setattr(llm.engine.executor, "execute_model", failing_execute)


# ---- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, params, words", [
    ([], GREEDY, ["prompt", "at least one token"]),
    ({"prompt_token_ids": []}, GREEDY, ["prompt", "at least one token"]),
    (list(range(3, 43)), SamplingParams(max_tokens=9), ["prompt (40 tokens)", "max_tokens (9)", "max_model_len (48)"]),
    ([5, 512, 6], GREEDY, ["prompt", "[0, vocab_size=512)", "[512]"]),
    ({"prompt_token_ids": [-1, 5]}, GREEDY, ["prompt", "[0, vocab_size=512)", "[-1]"]),
    # a stop token past the logits once crashed the step that masks it (min_tokens) mid-run
    (PROMPTS[2], SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[600]),
     ["stop_token_ids", "[0, vocab_size=512)", "[600]"]),
])
def test_bad_prompt_rejects_the_whole_batch(llm, expected, prompt, params, words):
    num_steps = llm.stats.num_steps
    with pytest.raises(ValueError) as e:
        llm.generate([PROMPTS[0], prompt, PROMPTS[1]], params, use_tqdm=False)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert llm.stats.num_steps == num_steps  # not even the good prompts ran
    assert_idle(llm)
    assert_usable(llm, expected)


def test_request_that_can_never_fit_the_kv_pool(tiny_models):
    llm = LLM(tiny_models["qwen3"], **{**OPTIONS, "num_kvcache_blocks": 4})  # 16 tokens
    with pytest.raises(ValueError) as e:  # 10 + 8 tokens need 5 blocks
        llm.generate([[5, 6, 7], list(range(10, 20)), [8, 9]], GREEDY, use_tqdm=False)
    assert "needs 5 KV blocks" in str(e.value) and "num_kvcache_blocks is 4" in str(e.value)
    assert llm.stats.num_steps == 0
    assert_idle(llm)
    outputs = llm.generate([[5, 6, 7], [8, 9]], GREEDY, use_tqdm=False)
    assert all(o.outputs[0].finish_reason in ("length", "stop") for o in outputs)
    assert_idle(llm)


@pytest.mark.parametrize("kwargs, words", [
    (dict(max_tokens=0), ["max_tokens", ">= 1", "got 0"]),
    (dict(temperature=-0.5), ["temperature", ">= 0", "got -0.5"]),
    (dict(top_p=0), ["top_p", "(0, 1]", "got 0"]),
    (dict(top_p=1.5), ["top_p", "(0, 1]", "got 1.5"]),
    (dict(top_k=0), ["top_k", ">= 1", "got 0"]),
    (dict(top_k=-2), ["top_k", "[-1, ", "got -2"]),
    (dict(top_k=2 ** 63), ["top_k", f"an integer in [-1, {2 ** 63})", f"got {2 ** 63}"]),  # past the sampler's int64
    (dict(min_p=1.5), ["min_p", "[0, 1]", "got 1.5"]),
    (dict(presence_penalty=2.5), ["presence_penalty", "[-2, 2]", "got 2.5"]),
    (dict(frequency_penalty=-3), ["frequency_penalty", "[-2, 2]", "got -3"]),
    (dict(repetition_penalty=0), ["repetition_penalty", "> 0", "got 0"]),
    (dict(logprobs=-1), ["logprobs", ">= 0", "got -1"]),
    (dict(prompt_logprobs=-2), ["prompt_logprobs", ">= 0", "got -2"]),
    (dict(min_tokens=17), ["min_tokens", "[0, max_tokens=16]", "got 17"]),
    (dict(stop=["ok", ""]), ["stop", "empty string"]),
    # NaN and infinity pass no interval; every float option refuses them
    *[(dict({name: value}), [name, "finite number", f"got {value}"])
      for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
      for value in (float("nan"), float("inf"), float("-inf"))],
    # wrong types: a string, a bool or a float where an integer belongs, a bool for a number
    (dict(temperature="0.5"), ["temperature", "got '0.5' (str)"]),
    (dict(top_p=None), ["top_p", "got None"]),
    (dict(max_tokens=8.0), ["max_tokens", "an integer", "got 8.0 (float)"]),
    (dict(n=True), ["n", "an integer", "got True (bool)"]),
    (dict(top_k=2.5), ["top_k", "an integer", "got 2.5"]),
    (dict(min_tokens="3"), ["min_tokens", "got '3' (str)"]),
    (dict(seed=1.5), ["seed", "an integer", "got 1.5"]),
    (dict(seed=2 ** 64), ["seed", "an integer in [", f"got {2 ** 64}"]),
    (dict(logprobs=True), ["logprobs", "got True (bool)"]),
    (dict(repetition_penalty=False), ["repetition_penalty", "got False (bool)"]),
    (dict(temperature=10 ** 400), ["temperature", "finite number"]),  # an int too large for a float
    (dict(ignore_eos="no"), ["ignore_eos", "True or False", "got 'no'"]),
    (dict(stop=7), ["stop", "a string or a list of strings", "got 7"]),
    (dict(stop_token_ids=[5, -1]), ["stop_token_ids", ">= 0", "got -1"]),
    (dict(stop_token_ids=[5.0]), ["stop_token_ids", "an integer", "got 5.0"]),
    (dict(output_kind="delta"), ["output_kind", "RequestOutputKind", "got 'delta'"]),
])
def test_bad_sampling_params(kwargs, words):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_numpy_numbers_become_python_numbers():
    params = SamplingParams(temperature=np.float32(0.5), max_tokens=np.int64(8), seed=np.int32(3),
                            stop_token_ids=(np.int64(7),), stop=("a", "b"))
    assert (type(params.temperature), type(params.max_tokens), type(params.seed)) == (float, int, int)
    assert params.stop_token_ids == [7] and type(params.stop_token_ids[0]) is int and params.stop == ["a", "b"]


def test_folder_without_config_json(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path))


def test_unknown_architecture_lists_the_supported_ones(tiny_models, tmp_path):
    path = shutil.copytree(tiny_models["qwen3"], tmp_path / "model")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as e:
        LLM(str(path))
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg
    assert all(a in msg for a in ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM")), msg


@pytest.mark.parametrize("option, value, words", [
    ("gpu_memory_utilization", float("nan"), ["gpu_memory_utilization", "(0, 1]", "nan"]),
    ("gpu_memory_utilization", 1.5, ["gpu_memory_utilization", "(0, 1]", "1.5"]),
    ("cpu_kvcache_space", float("inf"), ["cpu_kvcache_space", "> 0", "inf"]),
    ("cpu_kvcache_space", 0, ["cpu_kvcache_space", "> 0"]),
    ("swap_space", float("nan"), ["swap_space", ">= 0", "nan"]),
    ("swap_space", float("-inf"), ["swap_space", "-inf"]),
    ("max_num_seqs", 0, ["max_num_seqs", ">= 1", "got 0"]),
    ("max_num_seqs", 2.5, ["max_num_seqs", "an integer", "2.5"]),
    ("block_size", "16", ["block_size", "an integer", "'16'"]),
    ("num_kvcache_blocks", 0, ["num_kvcache_blocks", ">= 1"]),
    ("swap_space", True, ["swap_space", "a number", "True"]),
    ("dtype", "int8", ["dtype", "float32", "int8"]),
    ("max_logprobs", -1, ["max_logprobs", ">= 0 (0: off)", "got -1"]),
    ("max_logprobs", 2.5, ["max_logprobs", "an integer", "2.5"]),
])
def test_bad_engine_options_name_the_field(tiny_models, option, value, words):
    with pytest.raises(ValueError) as e:
        make_config(tiny_models["qwen3"], {option: value})
    assert all(w in str(e.value) for w in words), str(e.value)


def test_the_chapters_a_request_asks_for_are_off_unless_the_config_asks(tiny_models, monkeypatch):
    """logprobs, structured outputs and beam search: no record by default (a plain engine runs the core alone),
    a record with max_logprobs > 0 or their enable_ switch; structured outputs without xgrammar say how to get it."""
    from nanoserve.chapter_configs import BeamSearchConfig, LogprobsConfig, StructuredOutputsConfig

    names = ("logprobs_config", "structured_outputs_config", "beam_search_config")
    plain = make_config(tiny_models["qwen3"], {"max_logprobs": 0})
    assert [getattr(plain, name) for name in names] == [None, None, None]
    on = make_config(tiny_models["qwen3"], {"max_logprobs": 5, "enable_structured_outputs": True,
                                            "enable_beam_search": True})
    assert [getattr(on, name) for name in names] == [LogprobsConfig(5), StructuredOutputsConfig(), BeamSearchConfig()]
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "xgrammar" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"^enable_structured_outputs needs xgrammar: "
                       r"pip install 'nanoserve\[structured\]'"):
        make_config(tiny_models["qwen3"], {"enable_structured_outputs": True})


def test_unknown_option_lists_the_options(tiny_models):
    with pytest.raises(ValueError) as e:
        LLM(tiny_models["qwen3"], max_num_seq=4)
    assert "unknown option(s) ['max_num_seq']" in str(e.value) and "'max_num_seqs'" in str(e.value)


def test_text_prompt_or_stop_string_without_tokenizer(llm, expected):
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("Hello", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="stop: .*no tokenizer"):
        llm.generate(PROMPTS[0], SamplingParams(stop="."), use_tqdm=False)
    assert_usable(llm, expected)


# ---- outputs --------------------------------------------------------------------------------

def test_outputs_in_input_order_with_per_request_params(llm, expected):
    stop = expected[1][2]  # the 3rd greedy token of prompt 1
    params = [SamplingParams(temperature=0, max_tokens=3), SamplingParams(temperature=0, stop_token_ids=[stop]),
              SamplingParams(temperature=0, max_tokens=5)]
    prompts = [PROMPTS[0], {"prompt_token_ids": PROMPTS[1]}, PROMPTS[2]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    assert [int(o.request_id) for o in outputs] == sorted(int(o.request_id) for o in outputs)
    assert completions(outputs) == [expected[0][:3], expected[1][: expected[1].index(stop) + 1], expected[2][:5]]
    assert expected[0][-1] == EOS and len(expected[0]) < 3  # the tiny model stops prompt 0 early
    assert [o.outputs[0].finish_reason for o in outputs] == ["stop", "stop", "length"]
    assert_idle(llm)


def test_a_list_of_ints_is_one_prompt(llm, expected):
    outputs = llm.generate(PROMPTS[2], GREEDY, use_tqdm=False)
    assert completions(outputs) == [expected[2]]


def test_seeded_sampling_is_reproducible(llm):
    def sample(seed):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=20, ignore_eos=True)
        return completions(llm.generate([PROMPTS[0]], params, use_tqdm=False))[0]

    first = sample(1)
    assert len(first) == 20
    assert sample(1) == first
    assert sample(2) != first


def test_top_k_1_is_greedy(llm, expected):
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert completions(outputs) == expected


@pytest.mark.parametrize("option", [dict(top_p=1e-6), dict(min_p=1.0)])
def test_top_p_or_min_p_alone_narrowed_to_one_token_is_greedy(llm, expected, option):
    """Each option on its own (the sampler gets None for the unused ones), over a batch of rows."""
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, **option)
    assert completions(llm.generate(PROMPTS, params, use_tqdm=False)) == expected


def test_a_batch_mixing_greedy_and_seeded_rows_samples_each_as_alone(llm):
    params = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=1.0, seed=3, max_tokens=12)]
    together = completions(llm.generate(PROMPTS[:2], params, use_tqdm=False))
    alone = [completions(llm.generate([p], sp, use_tqdm=False))[0] for p, sp in zip(PROMPTS[:2], params)]
    assert together == alone
    assert alone[1] != completions(llm.generate([PROMPTS[1]], params[0], use_tqdm=False))[0]  # it did sample


def test_generate_steps_with_the_heap_frozen_and_unfreezes_it_after(tiny_models, expected, monkeypatch):
    """As vLLM: the objects alive before the run (torch, the model) sit out the garbage collector's full
    collections while the engine steps, and are back in them after, even when a step fails."""
    llm = LLM(tiny_models["qwen3"], **OPTIONS)
    gc.unfreeze()  # (another engine's loop in this process may have frozen it)
    step, frozen = llm.engine.step, []
    monkeypatch.setattr(llm.engine, "step", lambda: frozen.append(gc.get_freeze_count()) or step())
    assert completions(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    assert frozen and min(frozen) > 10_000 and gc.get_freeze_count() == 0
    fail_on_call(llm, monkeypatch, 2)
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert gc.get_freeze_count() == 0


# ---- failures -------------------------------------------------------------------------------

def test_failure_mid_generate_frees_every_block(tiny_models, expected, monkeypatch):
    llm = LLM(tiny_models["qwen3"], **OPTIONS)
    fail_on_call(llm, monkeypatch, 3)  # a decode step
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_idle(llm)
    monkeypatch.undo()
    assert_usable(llm, expected)


def test_failed_prefill_leaves_no_uncomputed_block_in_the_prefix_cache(tiny_models, expected, monkeypatch):
    """ENGINE BUG: the prompt's blocks are registered in the prefix cache when allocated, before the
    forward pass computes their KV. If that forward fails, the blocks are freed but stay registered,
    and the next request with the same prompt reuses KV that was never written."""
    llm = LLM(tiny_models["qwen3"], **OPTIONS)
    fail_on_call(llm, monkeypatch, 1)  # the prefill
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_idle(llm)
    monkeypatch.undo()
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert completions(outputs) == expected
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 0]  # nothing was ever computed


def test_failed_decode_leaves_no_uncomputed_block_in_the_prefix_cache(tiny_models, expected, monkeypatch):
    """ENGINE BUG, decode side: may_append registers the block the step's token fills before the
    forward pass writes that token's KV; a failed step leaves the block registered without it."""
    llm = LLM(tiny_models["qwen3"], **OPTIONS)
    fail_on_call(llm, monkeypatch, 2)  # the decode that computes token 7, filling block 1
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    prompt = PROMPTS[0] + [expected[0][0], 99]  # its 8 tokens so far, then something new
    outputs = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert completions(outputs) == hf_greedy(tiny_models["qwen3"], [prompt], MAX_TOKENS)
    assert outputs[0].num_cached_tokens == 4  # block 0 was computed; block 1 lacks token 7's KV
