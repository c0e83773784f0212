"""EngineCore driven step by step: async scheduling's batch queue, a failing forward, min_tokens."""
import gc
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import hf_greedy
from nanoserve import LLM, BeamSearchParams, SamplingParams
from nanoserve.engine.core import EngineCore

EOS = 2
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 43))]
OPTIONS = dict(block_size=4, num_kvcache_blocks=32, max_model_len=48)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


def assert_idle(engine: EngineCore) -> None:
    bm = engine.block_manager
    assert not engine.requests and engine.scheduler.is_finished()
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def drain(engine: EngineCore, outputs: dict[str, list]) -> None:
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)


def test_batch_queue_overlaps_steps_and_drops_the_token_after_the_finish(tiny_models):
    """Step N+1 is planned (a placeholder for N's token) before N's output is taken in; a request that
    finishes at N loses the token N+1 computed for it, and its blocks come back at once."""
    engine = LLM(tiny_models["qwen3"], **OPTIONS, async_scheduling=True).engine
    engine.add_request("a", PROMPTS[2], greedy(2, ignore_eos=True))
    seq = engine.requests["a"].first_seq
    assert engine.step() == []  # step 1 (the prefill) launched, nothing back yet
    assert seq.num_output_placeholders == 1 and len(seq) == len(PROMPTS[2]) + 1
    first = engine.step()  # step 2 (a decode of the placeholder) launched, then step 1 taken in
    assert len(engine.batch_queue) == 1 and [o.new_token_ids for o in first] == [seq.token_ids[-1:]]
    assert seq.num_output_placeholders == 1  # step 2's token
    second = engine.step()  # step 3 launched with a placeholder; step 2 taken in: max_tokens reached
    assert second[0].finished and second[0].finish_reason == "length"
    assert len(engine.batch_queue) == 1  # step 3 is still in flight, but the blocks are already free
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.step() == []  # step 3 taken in: its token is dropped
    assert engine.scheduler.stats.num_generated_tokens == 2 and engine.scheduler.stats.num_steps == 3
    assert first[0].new_token_ids + second[0].new_token_ids == hf_greedy(tiny_models["qwen3"], PROMPTS[2:], 2)[0]
    assert_idle(engine)


def test_the_batch_queue_makes_no_blocking_copy_to_the_device(tiny_models, monkeypatch):
    """The batch queue's point: the host plans and launches step N+1 while N runs. A blocking copy to the device
    (torch.tensor(..., device=...) is one) would hold the host until N ends, and a GPU would sit idle while N+1
    launches. So every input of a step, the placeholders' rows included, goes through to_device (pinned,
    non-blocking on CUDA); tests/test_cuda.py checks the same on a GPU with CUDA's sync debug mode."""
    expected = hf_greedy(tiny_models["qwen3"], PROMPTS, 6)
    engine = LLM(tiny_models["qwen3"], **OPTIONS, async_scheduling=True).engine
    blocking, tensor = [], torch.tensor

    def recording_tensor(data, *args, device=None, **kwargs):
        blocking.extend([device] if device is not None else [])
        return tensor(data, *args, device=device, **kwargs)

    monkeypatch.setattr(torch, "tensor", recording_tensor)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, greedy(6))
    outputs = {}
    drain(engine, outputs)
    assert blocking == []
    # (the placeholders were filled: each decode computed the token sampled the step before)
    assert [sum((o.new_token_ids for o in outputs[str(i)]), []) for i in range(3)] == expected
    assert_idle(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_forward_fails_exactly_its_requests(tiny_models, monkeypatch, async_scheduling):
    """The default policy prefills a newcomer in a step of its own: when that forward raises, the newcomer
    gets the error and its blocks back; the two requests already decoding go on, token for token right."""
    engine = LLM(tiny_models["qwen2"], **OPTIONS, async_scheduling=async_scheduling).engine
    expected = hf_greedy(tiny_models["qwen2"], PROMPTS, 8)
    engine.add_request("a", PROMPTS[0], greedy(8, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], greedy(8))
    outputs: dict[str, list] = {}
    for _ in range(3):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    execute, calls = engine.executor.execute_model, []

    def fail_once(out, inputs):
        calls.append([seq.request_id for seq in out.seqs])
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return execute(out, inputs)

    monkeypatch.setattr(engine.executor, "execute_model", fail_once)
    engine.add_request("c", PROMPTS[2], greedy(8))
    drain(engine, outputs)
    assert calls[0] == ["c"]
    (failed,) = outputs["c"]
    assert failed.finished and isinstance(failed.error, RuntimeError) and "injected" in str(failed.error)
    for i, request_id in enumerate("ab"):
        assert all(o.error is None for o in outputs[request_id])
        assert sum((o.new_token_ids for o in outputs[request_id]), []) == expected[i]
    assert_idle(engine)
    engine.add_request("c", PROMPTS[2], greedy(8))  # served now
    outputs = {}
    drain(engine, outputs)
    assert sum((o.new_token_ids for o in outputs["c"]), []) == expected[2]
    assert_idle(engine)


def test_min_tokens_masks_eos_and_stop_tokens_like_transformers(tiny_models):
    """min_tokens keeps EOS (and the stop tokens) from being sampled before it, as transformers'
    min_new_tokens does; after it, they stop the request again."""
    path = tiny_models["qwen3"]
    llm = LLM(path, **OPTIONS)
    plain = llm.generate([PROMPTS[0]], greedy(8), use_tqdm=False)[0].outputs[0]
    assert plain.token_ids[-1] == EOS and len(plain.token_ids) < 4  # this prompt stops early
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[0]])

    def reference(stop_ids: list[int]) -> list[int]:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=6,
                             eos_token_id=stop_ids, do_sample=False)
        return out[0, ids.shape[1]:].tolist()

    out = llm.generate([PROMPTS[0]], greedy(12, min_tokens=6), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference([EOS]) and EOS not in out.token_ids[:6]
    stop = out.token_ids[2]  # make a token the model picks early a stop token: it is masked too
    out = llm.generate([PROMPTS[0]], greedy(12, min_tokens=6, stop_token_ids=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference([EOS, stop]) and stop not in out.token_ids[:6]
    assert out.stop_reason == (stop if out.token_ids[-1] == stop else None)


def test_plugged_in_features_hold_no_reference_back_to_the_engine(tiny_models):
    """The engine owns its chapters' objects. One of them holding the engine would make a reference
    cycle: `del llm` would then not free the engine, its KV cache and its worker processes at once, but only
    whenever the garbage collector runs."""
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    llm = LLM(tiny_models["qwen3"], trace=True, speculative_config=spec, num_kvcache_blocks=64,
              enable_beam_search=True)
    llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=3), use_tqdm=False)
    llm.generate([[5, 6, 7, 5, 6]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert llm.engine.step_recorder is not None
    engine = weakref.ref(llm.engine)
    gc.disable()
    try:
        del llm
        assert engine() is None
    finally:
        gc.enable()


def test_a_chapter_that_cannot_plug_in_shuts_the_engine_down(tiny_models, monkeypatch):
    """The swap pool too small for one block fails after the engine is built: build_engine ends its executor (a
    tensor-parallel engine's workers and process group) at once, instead of leaving that to the garbage collector."""
    from nanoserve.engine.model_runner import Executor

    shut = []
    monkeypatch.setattr(Executor, "shutdown", lambda self: shut.append(self))
    with pytest.raises(ValueError, match="swap_space .* too small for one KV block"):
        LLM(tiny_models["qwen3"], **OPTIONS, preemption_mode="swap", swap_space=1e-9)
    assert len(shut) == 1
