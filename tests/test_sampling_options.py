"""logprobs, prompt_logprobs and the penalties against transformers on the same weights (float32)."""
import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import random_prompts
from nanoserve import LLM, SamplingParams
from nanoserve.logprobs import LogprobsEngineCore

EOS = 2
OPTIONS = dict(block_size=4, num_kvcache_blocks=128, max_model_len=96)


@pytest.fixture(scope="module")
def hf(tiny_models):
    return AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()


def hf_log_softmax(hf, token_ids: list[int]) -> torch.Tensor:
    """Row p: transformers' log_softmax of its logits at position p, which score token p + 1."""
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].log_softmax(dim=-1)


def assert_logprobs(logprobs, token_ids, rows, k) -> None:
    """vLLM's format: per position the token there and the k most likely, each with logprob and rank."""
    assert len(logprobs) == len(token_ids) == len(rows)
    for d, token_id, row in zip(logprobs, token_ids, rows):
        top = row.topk(k)
        assert set(d) == set(top.indices.tolist()) | {token_id}
        assert all(abs(d[i].logprob - row[i].item()) < 1e-4 for i in d)
        assert d[token_id].rank == (row > row[token_id]).sum().item() + 1
        assert [d[i].rank for i in top.indices.tolist() if i != token_id] == [
            r + 1 for r, i in enumerate(top.indices.tolist()) if i != token_id]


@pytest.mark.parametrize("options", [{}, dict(async_scheduling=True, min_tokens=3),
                                     dict(enable_chunked_prefill=True, max_num_batched_tokens=16)])
def test_logprobs_and_prompt_logprobs_equal_transformers(tiny_models, hf, options):
    # With chunked prefill, a prompt's logprobs come from several steps. min_tokens masks EOS: not in logprobs.
    min_tokens = options.pop("min_tokens", 0)
    llm = LLM(tiny_models["llama"], **OPTIONS, **options, max_logprobs=3)
    prompts = random_prompts(3, seed=1, low=10, high=40)
    # Sampled at temperature 2 with penalties: the logprobs still are the raw model's (vLLM's default).
    params = SamplingParams(temperature=2.0, seed=1, max_tokens=6, logprobs=3, prompt_logprobs=2,
                            presence_penalty=1.0, repetition_penalty=1.5, min_tokens=min_tokens)
    outputs = llm.generate(prompts + prompts[:1], params, use_tqdm=False)
    for prompt, out in zip(prompts + prompts[:1], outputs):
        completion = out.outputs[0].token_ids
        rows = hf_log_softmax(hf, prompt + completion)
        assert out.prompt_logprobs[0] is None  # the first token has nothing before it
        assert_logprobs(out.prompt_logprobs[1:], prompt[1:], rows[: len(prompt) - 1], 2)
        assert_logprobs(out.outputs[0].logprobs, completion, rows[len(prompt) - 1 : -1], 3)
        assert out.num_cached_tokens == 0  # the repeated prompt skipped the prefix cache: it needs the logits


def test_logprobs_off_and_0(tiny_models):
    llm = LLM(tiny_models["llama"], **OPTIONS, max_logprobs=1)
    params = [SamplingParams(max_tokens=3), SamplingParams(max_tokens=3, logprobs=0)]
    plain, zero = llm.generate([[5, 6, 7]] * 2, params, use_tqdm=False)
    assert plain.outputs[0].logprobs is None and plain.prompt_logprobs is None
    assert [list(d) for d in zero.outputs[0].logprobs] == [[t] for t in zero.outputs[0].token_ids]  # just the token
    with pytest.raises(ValueError, match="logprobs: got 513, the vocabulary has 512 tokens"):
        llm.generate([[5, 6]], SamplingParams(logprobs=513), use_tqdm=False)


def test_logprobs_are_a_chapter_switched_on_by_max_logprobs(tiny_models):
    """nanoserve/logprobs.py runs no line for a plain request; without max_logprobs (0) the engine has no
    logprobs and refuses a request that asks, naming the option, before anything is queued; with it the
    chapter is plugged in at build and a request may ask for up to max_logprobs (vLLM's rule). The core's
    LLM, with no feature plugged in, refuses both options too."""
    from test_reading_guide import files_run

    from nanoserve import llm as core_llm

    llm = LLM(tiny_models["llama"], **OPTIONS)
    plain = files_run(lambda: llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False))
    assert "nanoserve/logprobs.py" not in plain and not isinstance(llm.engine, LogprobsEngineCore)
    for name, k in itertools.product(("logprobs", "prompt_logprobs"), (5, 0)):
        with pytest.raises(ValueError, match=rf"^{name}: this engine has no feature plugged in for it; "
                           r"nanoserve.LLM plugs it in, with max_logprobs > 0"):
            llm.generate([[5, 6]], SamplingParams(**{name: k}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm = LLM(tiny_models["llama"], **OPTIONS, max_logprobs=2)
    assert llm.engine.max_logprobs == 2  # at build, not with a request
    asked = files_run(lambda: llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=2), use_tqdm=False))
    assert "nanoserve/logprobs.py" in asked
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"^{name}: 3 exceeds max_logprobs \(2\); pass LLM\(\.\.\., "
                           r"max_logprobs=3\) or more"):
            llm.generate([[5, 6], [5, 6]], [SamplingParams(max_tokens=2), SamplingParams(**{name: 3})],
                         use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # the valid first prompt was not queued either
    core = core_llm.LLM(tiny_models["llama"], **OPTIONS)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"^{name}: this engine has no feature plugged in for it; nanoserve.LLM"):
            core.generate([[5, 6]], SamplingParams(**{name: 1}), use_tqdm=False)
    assert not core.engine.has_unfinished_requests()


def reference_greedy(hf, prompt, max_tokens, presence=0.0, frequency=0.0, repetition=1.0) -> list[int]:
    """Greedy decoding with the penalties applied from their definitions to transformers' logits."""
    token_ids, output = list(prompt), []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([token_ids])).logits[0, -1]
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=logits.shape[0]).float()
        seen = (counts > 0) | (torch.bincount(torch.tensor(prompt), minlength=logits.shape[0]) > 0)
        logits = torch.where(seen & (logits > 0), logits / repetition, torch.where(seen, logits * repetition, logits))
        token_id = int((logits - frequency * counts - presence * (counts > 0)).argmax())
        output.append(token_id)
        token_ids.append(token_id)
        if token_id == EOS:
            break
    return output


PENALTIES = [dict(presence=1.5), dict(frequency=0.8), dict(presence=-0.5, frequency=1.2, repetition=1.3), {}]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_equal_their_definitions(tiny_models, hf, async_scheduling):
    """One batch, a different penalty mix per row (the sampler applies them as batched tensor ops). With async
    scheduling the newest output token is still being sampled when the next step is planned."""
    llm = LLM(tiny_models["llama"], **OPTIONS, async_scheduling=async_scheduling)
    prompts = random_prompts(len(PENALTIES), seed=2, low=4, high=12)
    params = [SamplingParams(temperature=0, max_tokens=16, presence_penalty=p.get("presence", 0.0),
                             frequency_penalty=p.get("frequency", 0.0), repetition_penalty=p.get("repetition", 1.0))
              for p in PENALTIES]
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs == [reference_greedy(hf, prompt, 16, **p) for prompt, p in zip(prompts, PENALTIES)]
    plain = llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert all(o != p.outputs[0].token_ids for o, p in zip(outputs, plain))  # every penalty changed the output


def test_greedy_repetition_penalty_equals_transformers_generate(tiny_models, hf):
    llm = LLM(tiny_models["llama"], **OPTIONS)
    prompts = random_prompts(3, seed=3, low=4, high=20)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.8),
                           use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                              repetition_penalty=1.8, min_new_tokens=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert [o.outputs for o in outputs] != [o.outputs for o in plain]  # the penalty mattered
