"""`nanoserve serve`: a real server process on 127.0.0.1, driven by the official `openai` client and by httpx.

One server for the module (conftest's demo model, started through `python -m nanoserve.serving` with an API
key), stopped by SIGTERM in the last test. Greedy answers are compared with the offline `LLM` on the same model.
"""
import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM

from conftest import Server, start_server
from nanoserve import LLM, SamplingParams
from nanoserve.engine.core import EngineCore

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "sk-test-nanoserve"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "smollm2"
MAX_MODEL_LEN = 512
SERVER_FLAGS = ["--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--cpu-kvcache-space", "0.25",
                "--shutdown-timeout", "1", "--uvicorn-log-level", "warning",
                "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(converted, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "NANOSERVE_API_KEY": API_KEY}  # the key through the environment; --api-key is the same
    url, process = start_server([str(converted[1]), *SERVER_FLAGS], log, env)
    yield Server(url, process, log)
    if process.poll() is None:  # the SIGTERM test did not run (-k): stop it anyway
        process.terminate()
        process.wait(30)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(converted) -> LLM:
    return LLM(str(converted[1]), max_model_len=MAX_MODEL_LEN, cpu_kvcache_space=0.25, max_logprobs=3)


GREEDY = SamplingParams(temperature=0, max_tokens=24)


def scrape(server: Server) -> dict[str, float]:
    """/metrics parsed: sample name -> value (histogram buckets left out)."""
    text = httpx.get(f"{server.url}/metrics").text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if "le" not in s.labels and not s.name.endswith("_created")}


def wait_until_idle(server: Server, timeout: float = 60) -> float:
    """Seconds until the engine has nothing running or waiting and every KV block is free."""
    start = time.monotonic()
    while True:
        m = scrape(server)
        if (m["nanoserve:num_requests_running"], m["nanoserve:num_requests_waiting"],
                m["nanoserve:kv_cache_usage_perc"]) == (0, 0, 0):
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, f"not idle after {timeout} s (a loaded machine?): {m}"
        time.sleep(0.02)


def test_cli_flags(tiny_models, capsys):
    """`nanoserve serve`: one flag per engine option in vLLM's spelling; a bad value exits 2 naming the field."""
    from nanoserve.serving.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--max-num-seqs", "--enable-chunked-prefill", "--no-enable-prefix-caching", "--scheduling-policy",
                 "--async-scheduling", "--served-model-name", "--api-key", "--port"):
        assert flag in help_text
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", tiny_models["llama"], "--max-num-seqs", "0"])
    assert exit_info.value.code == 2 and "max_num_seqs must be >= 1" in capsys.readouterr().err


def test_async_scheduling_flag_is_on_off_or_the_engines_default(tiny_models):
    """`--async-scheduling` / `--no-async-scheduling`, and neither: None, which Config turns on with CUDA
    only (off here, on CPU)."""
    import argparse

    from nanoserve.config import make_config
    from nanoserve.serving.cli import add_engine_flags

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    parsed = [parser.parse_args(flags).async_scheduling
              for flags in ([], ["--async-scheduling"], ["--no-async-scheduling"])]
    assert parsed == [None, True, False]
    config = make_config(tiny_models["qwen3"], {"device": "cpu"})
    assert config.scheduler_config.async_scheduling is False


def test_health_and_models(server, client):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completions_equal_offline_llm(client, llm):
    expected = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    response = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=24, temperature=0)
    assert [c.index for c in response.choices] == [0, 1]
    assert [c.text for c in response.choices] == [e.text for e in expected]
    assert [c.finish_reason for c in response.choices] == [e.finish_reason for e in expected]
    num_prompt = sum(len(llm.tokenizer.encode(p)) for p in PROMPTS)
    num_completion = sum(len(e.token_ids) for e in expected)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == \
        (num_prompt, num_completion, num_prompt + num_completion)

    # token ids as the prompt, streamed: the pieces join to the same text
    ids = llm.tokenizer.encode(PROMPTS[1])
    stream = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected[1].text
    assert len(chunks) > 2 and chunks[-1].choices[0].finish_reason == expected[1].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_equals_offline_llm(client, llm):
    expected = llm.chat(QUESTION, GREEDY, use_tqdm=False)[0]
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)

    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_completion_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.outputs[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert chunks[-2].choices[0].finish_reason == expected.outputs[0].finish_reason


def test_n_with_seed_equals_offline_llm(client, llm):
    """n=2: choice prompt_i * n + j is the offline LLM's sequence j of prompt i (same seed, same penalties)."""
    knobs = dict(temperature=0.8, seed=7, max_tokens=8, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3,
                 repetition_penalty=1.2)
    expected = [c for r in llm.generate(PROMPTS, SamplingParams(n=2, **knobs), use_tqdm=False) for c in r.outputs]
    extra = {k: knobs.pop(k) for k in ("min_p", "repetition_penalty")}  # vLLM's extensions
    response = client.completions.create(model=MODEL, prompt=PROMPTS, n=2, extra_body=extra, **knobs)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.text for c in response.choices] == [e.text for e in expected]
    assert len({e.text for e in expected}) > 2  # the two sequences of a prompt differ
    assert response.usage.completion_tokens == sum(len(e.token_ids) for e in expected)

    stream = client.completions.create(model=MODEL, prompt=PROMPTS, n=2, stream=True, extra_body=extra,
                                       stream_options={"include_usage": True}, **knobs)
    texts, finishes, chunks = [""] * 4, [None] * 4, list(stream)
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        finishes[choice.index] = finishes[choice.index] or choice.finish_reason
    assert texts == [e.text for e in expected] and finishes == [e.finish_reason for e in expected]
    assert chunks[-1].usage.completion_tokens == response.usage.completion_tokens

    expected = llm.chat(QUESTION, SamplingParams(n=2, **knobs, **extra), use_tqdm=False)[0].outputs
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, n=2, extra_body=extra, **knobs)
    assert [c.message.content for c in response.choices] == [e.text for e in expected]
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, n=2, stream=True, extra_body=extra,
                                            **knobs)
    chunks = list(stream)
    assert [(c.index, c.delta.role) for c in chunks[0].choices] == [(0, "assistant"), (1, "assistant")]
    texts = [""] * 2
    for chunk in chunks[1:]:
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert texts == [e.text for e in expected]


def test_logprobs_equal_offline_llm(client, llm):
    """Greedy with logprobs: the legacy completions shape and the chat shape, both the offline LLM's numbers."""
    (out,) = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, logprobs=3), use_tqdm=False)
    c = out.outputs[0]
    spell = [llm.tokenizer.decode([t]) for t in c.token_ids]
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3)
    lp = response.choices[0].logprobs
    assert lp.tokens == spell and response.choices[0].text == c.text
    assert lp.token_logprobs == pytest.approx([d[t].logprob for t, d in zip(c.token_ids, c.logprobs)], abs=1e-5)
    for top, d in zip(lp.top_logprobs, c.logprobs):
        expected_top = {llm.tokenizer.decode([i]): x.logprob for i, x in d.items() if x.rank <= 3}
        assert len(top) == 3 and top == pytest.approx(expected_top, abs=1e-5)
    assert lp.text_offset == [sum(map(len, spell[:i])) for i in range(len(spell))]
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3,
                                       stream=True)
    pieces = [chunk.choices[0].logprobs for chunk in stream if chunk.choices[0].logprobs]
    assert [t for p in pieces for t in p.text_offset] == lp.text_offset
    assert [x for p in pieces for x in p.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-5)

    (out,) = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=8, logprobs=2), use_tqdm=False)
    c = out.outputs[0]
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0,
                                              logprobs=True, top_logprobs=2)
    content = response.choices[0].logprobs.content
    assert [e.token for e in content] == [llm.tokenizer.decode([t]) for t in c.token_ids]
    assert [e.bytes for e in content] == [list(e.token.encode()) for e in content]
    assert [e.logprob for e in content] == pytest.approx([d[t].logprob for t, d in zip(c.token_ids, c.logprobs)],
                                                         abs=1e-5)
    for e, d in zip(content, c.logprobs):  # greedy: the top one is the token itself
        assert [x.logprob for x in e.top_logprobs] == pytest.approx(
            sorted((x.logprob for x in d.values() if x.rank <= 2), reverse=True), abs=1e-5)
        assert e.top_logprobs[0].token == e.token
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True)
    streamed = [e for chunk in stream if chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)


def test_echo_starts_with_the_prompt(client, llm):
    """echo: each choice's text is its prompt (token ids decoded) and then the same greedy text as without it;
    usage counts only the generated tokens."""
    expected = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    for prompt in (PROMPTS, [llm.tokenizer.encode(p) for p in PROMPTS]):
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, echo=True)
        assert [c.text for c in response.choices] == [p + e.text for p, e in zip(PROMPTS, expected)]
        assert response.usage.completion_tokens == sum(len(e.token_ids) for e in expected)
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0.8, seed=3, n=2,
                                         echo=True)
    assert [c.text[:len(PROMPTS[0])] for c in response.choices] == [PROMPTS[0]] * 2
    assert response.choices[0].text != response.choices[1].text


def reference_prompt_logprobs(path: Path, ids: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers in float32 on the same weights: each prompt token's logprob after the ones before it, and the
    k best logprobs there."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    return logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0], logprobs.topk(k, dim=-1).values


def test_echo_logprobs_equal_transformers(client, llm, converted):
    """echo + logprobs: the prompt's tokens first (the first with null logprobs), each scored as transformers
    scores it; then the generated tokens as without echo. max_tokens=0 scores the prompt alone."""
    prompt, k = "The quick brown fox jumps over the lazy dog. The capital of France is", 3
    ids = llm.tokenizer.encode(prompt)
    expected, expected_top = reference_prompt_logprobs(converted[1], ids, k)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=k)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=k,
                                         echo=True)
    (choice,) = response.choices
    lp, p = choice.logprobs, len(ids)
    assert choice.text == prompt + plain.choices[0].text
    assert lp.tokens == [llm.tokenizer.decode([t]) for t in ids] + plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:p] == pytest.approx(expected.tolist(), abs=1e-4)
    for top, best in zip(lp.top_logprobs[1:p], expected_top):
        assert sorted(top.values(), reverse=True) == pytest.approx(best.tolist(), abs=1e-4)
    assert lp.token_logprobs[p:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert response.usage.completion_tokens == plain.usage.completion_tokens

    # max_tokens=0: the prompt scored, nothing generated
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, logprobs=k, echo=True)
    (choice,) = response.choices
    assert (choice.text, choice.finish_reason, response.usage.completion_tokens) == (prompt, "length", 0)
    assert choice.logprobs.tokens == lp.tokens[:p] and choice.logprobs.text_offset == lp.text_offset[:p]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected.tolist(), abs=1e-4)
    response = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=0, echo=True)
    assert [c.text for c in response.choices] == PROMPTS and all(c.logprobs is None for c in response.choices)


def test_echo_streamed(client):
    """Streamed echo: the first chunk of each choice starts with its prompt; the chunks join to the answer of the
    same request unstreamed, logprobs and text offsets included. max_tokens=0: one chunk, the prompt."""
    kwargs = dict(model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0, logprobs=2, echo=True)
    whole = client.completions.create(**kwargs).choices
    texts, offsets, logprobs, firsts = ["", ""], [[], []], [[], []], {}
    for chunk in client.completions.create(**kwargs, stream=True):
        (c,) = chunk.choices
        firsts.setdefault(c.index, c.text)
        texts[c.index] += c.text
        if c.logprobs:
            offsets[c.index] += c.logprobs.text_offset
            logprobs[c.index] += c.logprobs.token_logprobs
    assert [firsts[i].startswith(p) for i, p in enumerate(PROMPTS)] == [True, True]
    assert texts == [c.text for c in whole] and offsets == [c.logprobs.text_offset for c in whole]
    for streamed, c in zip(logprobs, whole):
        assert streamed[0] is None and streamed[1:] == pytest.approx(c.logprobs.token_logprobs[1:], abs=1e-5)

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=0, echo=True, stream=True,
                                            stream_options={"include_usage": True}))
    assert [(c.choices[0].text, c.choices[0].finish_reason) for c in chunks[:-1]] == [(PROMPTS[0], "length")]
    assert chunks[-1].usage.completion_tokens == 0


LM_EVAL_TASKS = ["nanoserve_mc", "nanoserve_gen", "nanoserve_ppl"]  # tests/lm_eval_tasks/*.yaml: a local jsonl


def test_lm_eval_scores_through_the_server_equal_hf(server, converted, tmp_path, monkeypatch):
    """lm-evaluation-harness's `local-completions` model (echo + logprobs for loglikelihoods, stop strings for
    generations) scores three small tasks through the server exactly as its `hf` model does on the same weights:
    every metric, every sample's loglikelihood and is-greedy flag, every generated answer."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install 'lm_eval[api]')")
    import datasets.config
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(ROOT)  # the task files name their data file from the repository root, as lm_eval's CLI would
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path))  # not ~/.cache
    path = str(converted[1])
    models = {"hf": HFLM(pretrained=path, dtype="float32", device="cpu", batch_size=1, max_length=MAX_MODEL_LEN),
              "nanoserve": LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model=MODEL, tokenizer=path,
                                               tokenizer_backend="huggingface", max_length=MAX_MODEL_LEN,
                                               header=AUTH)}
    tasks = TaskManager(include_path=str(ROOT / "tests" / "lm_eval_tasks"))
    hf, served = (simple_evaluate(model=m, tasks=LM_EVAL_TASKS, task_manager=tasks, bootstrap_iters=0)
                  for m in models.values())
    for task in LM_EVAL_TASKS:
        scores = {k: v for k, v in hf["results"][task].items() if isinstance(v, float)}
        assert scores and {k: served["results"][task][k] for k in scores} == pytest.approx(scores, rel=1e-4)
        for a, b in zip(hf["samples"][task], served["samples"][task], strict=True):
            if task == "nanoserve_gen":
                assert b["resps"] == a["resps"]  # the greedy answers, word for word
            else:  # one [(loglikelihood, is_greedy)] per choice, or [loglikelihood] for a rolling text
                expected, got = ([r if isinstance(r, tuple) else (r, None) for (r,) in x["resps"]] for x in (a, b))
                assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in expected], abs=1e-3)
                assert [greedy for _, greedy in got] == [greedy for _, greedy in expected]
    assert 0 < hf["results"]["nanoserve_mc"]["acc,none"] < 1  # neither all right nor all wrong: the scores tell


def test_usage_counts_prefix_cache_hits(client, llm):
    prompt = "A prefix long enough to fill a few KV blocks of sixteen tokens: " + "red green blue yellow " * 12
    num_prompt = len(llm.tokenizer.encode(prompt))
    first, second = (client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
                     for _ in range(2))
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == num_prompt
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # every full block but the one holding the last prompt token (which must be computed for its logits)
    assert second.usage.prompt_tokens_details.cached_tokens == (num_prompt - 1) // 16 * 16 > 0
    assert second.choices[0].text == first.choices[0].text


def test_stop_strings_and_lengths(client):
    response = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0,
                                         stop=[" 7"])
    choice = response.choices[0]
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", " 7")
    assert " 7" not in choice.text and "6" in choice.text
    response = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True, "min_tokens": 5})
    assert (response.choices[0].finish_reason, response.usage.completion_tokens) == ("length", 5)


def test_64_concurrent_streams(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, str]:
        stream = await client.completions.create(model=MODEL, prompt=f"Request {i}: count from {i} to", max_tokens=8,
                                                 temperature=0.8, seed=i, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens, finish

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(64)),
                                                         return_exceptions=True), timeout=120)

    results = asyncio.run(run_all())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors == []
    assert all(text and num_tokens == 8 and finish == "length" for text, num_tokens, finish in results)
    wait_until_idle(server)
    m = scrape(server)
    assert m["nanoserve:num_requests_running"] == 0 and m["nanoserve:kv_cache_usage_perc"] == 0


def test_metrics_move(server, client, llm):
    before = scrape(server)
    prompt = "Metrics should move when a request runs:"
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True})
    after = scrape(server)
    num_prompt = len(llm.tokenizer.encode(prompt))

    def delta(name: str) -> float:
        return after[f"nanoserve:{name}"] - before[f"nanoserve:{name}"]

    assert response.usage.completion_tokens == 6
    assert delta("prompt_tokens_total") == num_prompt and delta("generation_tokens_total") == 6
    assert delta("prefix_cache_queries_total") == num_prompt
    assert delta("prefix_cache_hits_total") == response.usage.prompt_tokens_details.cached_tokens
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"{histogram}_count") == 1 and delta(f"{histogram}_sum") > 0
    assert after["nanoserve:e2e_request_latency_seconds_sum"] >= after["nanoserve:time_to_first_token_seconds_sum"]
    assert "nanoserve:num_preemptions_total" in after and "nanoserve:num_requests_swapped" in after


def long_stream(server: Server):
    """A streamed request that would run for a long time (400 tokens) unless stopped."""
    body = dict(model=MODEL, prompt="Tell me a very long story.", max_tokens=400, stream=True, ignore_eos=True)
    return httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60)


def test_client_disconnect_aborts_the_request(server):
    with long_stream(server) as response:
        lines = response.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(3)) if line.startswith("data: ")) >= 1
        busy = scrape(server)
        assert busy["nanoserve:num_requests_running"] == 1 and busy["nanoserve:kv_cache_usage_perc"] > 0
    # leaving the block closed the connection: the request is aborted and its blocks freed after a step or two
    wait_until_idle(server)
    num_generated = scrape(server)["nanoserve:generation_tokens_total"] - busy["nanoserve:generation_tokens_total"]
    assert num_generated <= 3  # the engine's own count: the step that ran while we scraped, and one more

    # a non-streamed request whose client gives up (a timeout) is aborted too
    body = dict(model=MODEL, prompt="Another long story.", max_tokens=400, ignore_eos=True)
    before = scrape(server)["nanoserve:generation_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=1.0)
    wait_until_idle(server)
    assert scrape(server)["nanoserve:generation_tokens_total"] - before < 400


BAD_REQUESTS = [  # (route, body, status, param): every kind of input the server must refuse
    ("completions", b'{"model": "smollm2", "prompt": "Hi",', 400, None),  # malformed JSON
    ("completions", b'[1, 2, 3]', 400, None),  # not an object
    ("completions", {"model": MODEL}, 400, "prompt"),
    ("completions", {"prompt": "Hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("completions", {"prompt": {"text": "Hi"}}, 400, "prompt"),
    ("completions", {"prompt": "Hi", "stop": 7}, 400, "stop"),
    ("completions", {"prompt": "Hi", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "Hi", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": "Hi", "top_k": 0}, 400, "top_k"),
    ("completions", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": [5] * MAX_MODEL_LEN, "max_tokens": 8}, 400, "prompt"),  # over max_model_len
    ("completions", {"prompt": [1, 2, 10 ** 9]}, 400, "prompt"),  # not a token of this vocabulary
    ("completions", {"prompt": [[-1]], "echo": True}, 400, "prompt"),  # (echo decoded it first: a 500)
    ("completions", {"prompt": "Hi", "priority": 3}, 400, "priority"),  # needs --scheduling-policy priority
    ("completions", {"prompt": "Hi", "n": 0}, 400, "n"),
    ("completions", {"prompt": "Hi", "n": 1000}, 400, "n"),  # over max_num_seqs (256)
    ("completions", {"prompt": "Hi", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": "Hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("completions", {"prompt": "Hi", "max_tokens": -1, "echo": True}, 400, "max_tokens"),
    ("completions", {"prompt": "Hi", "max_tokens": 0, "echo": True, "min_tokens": 1}, 400, "min_tokens"),
    ("completions", {"prompt": "Hi", "echo": True, "logprobs": 21}, 400, "logprobs"),
    ("completions", {"model": "gpt-4", "prompt": "Hi"}, 404, "model"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"content": "Hi"}]}, 400, "messages"),
    ("chat/completions", {"messages": QUESTION, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat/completions", {"messages": QUESTION, "top_logprobs": 2}, 400, "top_logprobs"),  # without logprobs
    ("chat/completions", {"messages": QUESTION, "n": -1}, 400, "n"),
    ("chat/completions", {"messages": QUESTION, "max_completion_tokens": -3}, 400, "max_tokens"),
    ("chat/completions", {"messages": QUESTION, "stream": "yes please"}, 400, "stream"),
    ("completions", {"prompt": "Hi", "use_beam_search": True, "n": 2, "stream": True}, 400, "stream"),  # more in
    ("chat/completions", {"messages": QUESTION, "n": True}, 400, "n"),  # tests/test_beam_serving.py
    ("embeddings", {"input": "Hi"}, 404, None),
    # Python's JSON reader takes NaN and Infinity: every float field refuses them, naming itself
    *[("completions", b'{"prompt": "Hi", "%s": %s}' % (name.encode(), value), 400, name)
      for name, value in [("temperature", b"NaN"), ("top_p", b"Infinity"), ("min_p", b"NaN"),
                          ("presence_penalty", b"-Infinity"), ("frequency_penalty", b"NaN"),
                          ("repetition_penalty", b"1e999")]],  # 1e999 is read as infinity
    ("completions", b'{"prompt": "Hi", "max_tokens": Infinity}', 400, "max_tokens"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}', 400,
     "temperature"),
    # prompt + max_tokens over max_model_len: max_tokens is the field to change, unless the prompt leaves no room
    ("completions", {"prompt": "Hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("completions", {"prompt": [[5, 6], [5] * 500], "max_tokens": 20}, 400, "max_tokens"),  # the second prompt
    ("chat/completions", {"messages": QUESTION, "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("chat/completions", {"messages": QUESTION, "max_completion_tokens": 10 ** 6}, 400, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hello " * MAX_MODEL_LEN}]}, 400, "messages"),
]


@pytest.mark.parametrize("route, body, status, param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(server, route, body, status, param):
    kwargs = dict(content=body, headers={**AUTH, "Content-Type": "application/json"}) if isinstance(body, bytes) \
        else dict(json=body, headers=AUTH)
    response = httpx.post(f"{server.url}/v1/{route}", **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error


def test_a_server_without_the_request_chapters_refuses_them_by_name(converted):
    """`nanoserve serve` turns logprobs, structured outputs and beam search on (cli.SERVE_DEFAULTS: the OpenAI API
    serves them as vLLM's does, while LLM(...) leaves them out); turned off by flags, a request that asks is a
    400 in OpenAI's shape naming its field and the option, before any work."""
    import argparse
    import importlib.util

    from fastapi.testclient import TestClient

    from nanoserve import AsyncLLM
    from nanoserve.serving.cli import add_serve_flags, app_from_args, engine_options

    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    defaults = engine_options(parser.parse_args([]))
    assert (defaults["max_logprobs"], defaults["enable_beam_search"]) == (20, True)
    assert defaults["enable_structured_outputs"] == (importlib.util.find_spec("xgrammar") is not None)
    args = parser.parse_args([str(converted[1]), "--served-model-name", MODEL, "--max-model-len", "128",
                              "--cpu-kvcache-space", "0.25", "--max-logprobs", "0", "--no-enable-structured-outputs",
                              "--no-enable-beam-search"])
    engine = AsyncLLM(args.model, **engine_options(args))
    try:
        assert type(engine.engine_core) is EngineCore  # the core alone
        client = TestClient(app_from_args(engine, args))
        for route, body, param, option in (
                # (the core's refusal: a plain engine has no logprobs chapter to say how many)
                ("completions", {"prompt": "Hi", "logprobs": 2}, "logprobs", "max_logprobs > 0"),
                ("completions", {"prompt": "Hi", "logprobs": 0, "echo": True}, "logprobs", "max_logprobs > 0"),
                ("chat/completions", {"messages": QUESTION, "logprobs": True, "top_logprobs": 1}, "logprobs",
                 "max_logprobs > 0"),
                ("completions", {"prompt": "Hi", "structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs",
                 "enable_structured_outputs=True"),
                ("chat/completions", {"messages": QUESTION, "response_format": {"type": "json_object"}},
                 "structured_outputs", "enable_structured_outputs=True"),
                ("completions", {"prompt": "Hi", "use_beam_search": True, "n": 2}, "use_beam_search",
                 "enable_beam_search=True")):
            response = client.post(f"/v1/{route}", json={"model": MODEL, "max_tokens": 4, **body})
            assert response.status_code == 400, (body, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["param"] == param and option in error["message"], (body, error)
        assert not engine.engine_core.requests
        response = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] > 0
    finally:
        engine.shutdown()


def test_too_long_max_tokens_says_how_many_fit(server):
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": [5] * 500, "max_tokens": 20}, headers=AUTH)
    error = response.json()["error"]
    assert error["param"] == "max_tokens" and "at most 12" in error["message"], error


def test_startup_line_is_info(server):
    assert f"INFO nanoserve.serving: serving {MODEL} on {server.url}" in server.log.read_text()


def test_bad_requests_leave_the_server_serving(server, client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="Hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="Hi")
    response = client.completions.create(model=MODEL, prompt="Still there?", max_tokens=3, temperature=0)
    assert response.usage.completion_tokens > 0
    wait_until_idle(server)


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi"}, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 401
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200  # health and metrics stay open
    assert httpx.get(f"{server.url}/metrics").status_code == 200


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}}}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_tool_calls(choice, names: set[str]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tool_choice_required_and_named(client):
    pytest.importorskip("xgrammar")
    response = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER, TIME],
                                              tool_choice="required", max_tokens=120, temperature=0)
    check_tool_calls(response.choices[0], {"get_weather", "get_time"})
    response = client.chat.completions.create(
        model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER, TIME], max_tokens=60, temperature=0.8, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    check_tool_calls(response.choices[0], {"get_weather"})


def test_tool_choice_auto_gives_text_or_a_tool_call(client):
    response = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER],
                                              max_tokens=40, temperature=0)
    choice = response.choices[0]
    if choice.message.tool_calls:
        check_tool_calls(choice, {"get_weather"})
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content


def streamed_calls(client, **body) -> tuple[str | None, list[tuple[str, str, str]], str]:
    """A streamed chat reassembled as the openai client's users do: (content, [(id, name, arguments)],
    finish_reason), each call named by its first delta and its arguments concatenated."""
    content, calls, finish_reason = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, stream=True, **body):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:  # the call's first delta: id, type and name
                assert call.index == len(calls) and call.type == "function" and call.function.name
                calls[call.index] = (call.id, call.function.name, "")
            call_id, name, arguments = calls[call.index]
            calls[call.index] = (call_id, name, arguments + (call.function.arguments or ""))
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    return content or None, [calls[i] for i in sorted(calls)], finish_reason


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}},
                                         "auto"])
def test_streamed_tool_calls_equal_the_whole_answer(client, tool_choice):
    """Greedy: the streamed deltas reassemble into the non-streamed answer (content, each call's name and
    arguments); arguments parse and match their tool's schema."""
    pytest.importorskip("xgrammar")
    body = dict(tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=120, temperature=0)
    whole = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, **body).choices[0]
    content, calls, finish_reason = streamed_calls(client, **body)
    assert finish_reason == whole.finish_reason
    assert [(name, json.loads(arguments)) for _, name, arguments in calls] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls or []]
    assert (content or "").strip() == (whole.message.content or "").strip()
    if tool_choice != "auto":
        check_tool_calls(whole, {"get_weather", "get_time"})
        assert calls and content is None and finish_reason == "tool_calls"
        assert all(call_id.startswith("call_") for call_id, _, _ in calls)


def test_streamed_auto_tool_call_from_a_prompted_model(client):
    """"auto" when the model does write a call: the prompt starts the call for it (an assistant prefix the
    template leaves open is not what OpenAI's API has, so the user turn asks for it and a regex keeps it on
    the format): the text before the tag streams as content, the call as tool_calls deltas."""
    pytest.importorskip("xgrammar")
    regex = r'Calling\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,8}", '\
            r'"unit": "C"\}\}\n</tool_call>'
    body = dict(tools=[WEATHER], max_tokens=100, temperature=0, extra_body={"structured_outputs": {"regex": regex}})
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):  # not with tool_choice "required"
        client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tool_choice="required", **body)
    whole = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, **body).choices[0]
    content, calls, finish_reason = streamed_calls(client, **body)
    assert (content, finish_reason) == (whole.message.content, whole.finish_reason) == ("Calling.", "tool_calls")
    (call,) = whole.message.tool_calls
    assert [(name, json.loads(arguments)) for _, name, arguments in calls] == \
        [("get_weather", json.loads(call.function.arguments))]


def test_tool_messages_in_the_history(client, llm):
    """An assistant message with tool_calls (content null) and the tool's result: the demo model's template
    knows neither, so they reach it written in the hermes convention; the answer equals the offline LLM's on
    that conversation."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "C"}'}}
    history = [*WEATHER_QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]
    hermes = [*WEATHER_QUESTION, {"role": "assistant", "content":
                                  '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
                                  "\n</tool_call>"},
              {"role": "user", "content": "<tool_response>\n21 degrees, sunny\n</tool_response>"}]
    expected = llm.chat(hermes, GREEDY, use_tqdm=False)[0].outputs[0].text
    response = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                              max_tokens=24, temperature=0)
    assert response.choices[0].message.content == expected


def test_hermes_parser():
    from nanoserve.serving.structured import parse_hermes

    text = 'Sure. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><tool_call>{"name": "g"}</tool_call>'
    assert parse_hermes(text) == ([("f", {"x": 1}), ("g", {})], "Sure.")
    assert parse_hermes("no calls") == ([], "no calls")
    assert parse_hermes("<tool_call>{broken</tool_call>") == ([], "<tool_call>{broken</tool_call>")


def test_response_format_and_structured_outputs(client):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    schema = WEATHER["function"]["parameters"]
    response = client.chat.completions.create(
        model=MODEL, messages=WEATHER_QUESTION, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}})
    assert response.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)
    response = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, max_tokens=60, temperature=0,
                                              response_format={"type": "json_object"})
    assert isinstance(json.loads(response.choices[0].message.content), dict)
    response = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=10, temperature=0,
                                         extra_body={"structured_outputs": {"choice": ["Paris", "Rome"]}})
    assert response.choices[0].text in ("Paris", "Rome")


@pytest.mark.parametrize("body, param, message", [
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "structured_outputs.regex: "),
    ({"structured_outputs": {"nothing": 1}}, "structured_outputs", "structured_outputs: "),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}}, "response_format",
     "response_format.json_schema.schema: "),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format: type must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "tool_choice: no tool named 'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice: needs tools"),
    ({"messages": [{"role": "tool", "content": "20", "tool_call_id": "call_1"}]}, "messages",
     "messages[0].tool_call_id: 'call_1' is not a call"),
    ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "[1]"}}]}]}, "messages", "messages[1].tool_calls[0].function.arguments: must be"),
    ({"messages": [*QUESTION, {"role": "assistant", "content": None}]}, "messages", "messages[1].content: "),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "c"}]}, "messages", "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
     "messages", "messages.0.tool_calls.0.function.arguments: Field required"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format",
     "response_format: cannot be combined"),
])
def test_structured_output_errors_name_the_field(server, body, param, message):
    pytest.importorskip("xgrammar")
    reply = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, timeout=30,
                       json={"model": MODEL, "messages": QUESTION, "max_tokens": 4, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"].startswith(message), error


def test_sigterm_stops_the_server_with_exit_0(server):
    """The last test: SIGTERM while a stream runs. The server lets it run for --shutdown-timeout (1 s), then
    aborts it: the stream ends with an error event and [DONE]; the process frees everything and exits 0."""
    with long_stream(server) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        server.process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert "shutting down" in rest[-2] and rest[-1] == "data: [DONE]"
    assert server.process.wait(30) == 0, server.log.read_text()
    assert "Traceback" not in server.log.read_text()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")
