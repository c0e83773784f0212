"""`use_beam_search: true` at the server (nanoserve/serving/beam.py): the answers equal `LLM.beam_search` on the
same model, through the official `openai` client (extra_body) and plain HTTP; every bad field is a 400 naming it.

One server for the module on the demo model (conftest's `converted`), with --max-num-seqs 8.
"""
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import Server, start_server
from nanoserve import LLM, BeamSearchParams
from nanoserve.serving.beam import beam_search_streams
from nanoserve.serving.protocol import APIError, CompletionRequest

MODEL = "smollm2"
MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 8
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(converted, tmp_path_factory):
    log = tmp_path_factory.mktemp("beam_server") / "server.log"
    flags = ["--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs",
             str(MAX_NUM_SEQS), "--cpu-kvcache-space", "0.25", "--uvicorn-log-level", "warning"]
    url, process = start_server([str(converted[1]), *flags], log)
    yield Server(url, process, log)
    process.terminate()
    process.wait(30)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(converted) -> LLM:
    return LLM(str(converted[1]), max_model_len=MAX_MODEL_LEN, cpu_kvcache_space=0.25, enable_beam_search=True)


def kv_in_use(server: Server) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return float(next(line for line in text.splitlines() if line.startswith("nanoserve:kv_cache_usage_perc"))
                 .split()[-1])


def wait_until_free(server: Server, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while kv_in_use(server) != 0:
        assert time.monotonic() < deadline, "KV blocks still in use"
        time.sleep(0.05)


def test_completions_equal_llm_beam_search(client, llm, server):
    """Two prompts, n=3: choice i * n + j is sequence j (best first) of prompt i's search."""
    expected = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=12), use_tqdm=False)
    response = client.completions.create(model=MODEL, prompt=PROMPTS, n=3, max_tokens=12,
                                         extra_body={"use_beam_search": True})
    want = [seq for out in expected for seq in out.outputs]
    assert [c.index for c in response.choices] == list(range(6))
    assert [c.text for c in response.choices] == [seq.text for seq in want]
    assert [c.finish_reason for c in response.choices] == [seq.finish_reason for seq in want]
    assert len({c.text for c in response.choices[:3]}) == 3  # three different beams, not one answer thrice
    num_prompt = sum(len(out.prompt_token_ids) for out in expected)
    num_completion = sum(len(seq.token_ids) for seq in want)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == \
        (num_prompt, num_completion, num_prompt + num_completion)
    wait_until_free(server)


def test_best_of_length_penalty_early_stopping_ignore_eos(client, llm):
    """best_of is the width and n the number returned; the search's own fields reach BeamSearchParams."""
    params = BeamSearchParams(beam_width=4, max_tokens=10, length_penalty=0.5, early_stopping=True)
    expected = llm.beam_search(PROMPTS[0], params, use_tqdm=False)[0].outputs[:2]
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], n=2, best_of=4, max_tokens=10,
                                         extra_body={"use_beam_search": True, "length_penalty": 0.5,
                                                     "early_stopping": True})
    assert [c.text for c in response.choices] == [seq.text for seq in expected]

    params = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True, temperature=0.7,
                              early_stopping="never")
    expected = llm.beam_search(PROMPTS[1], params, use_tqdm=False)[0].outputs
    response = client.completions.create(model=MODEL, prompt=PROMPTS[1], n=2, max_tokens=6, temperature=0.7,
                                         extra_body={"use_beam_search": True, "ignore_eos": True,
                                                     "early_stopping": "never"})
    assert [c.text for c in response.choices] == [seq.text for seq in expected]
    assert [c.finish_reason for c in response.choices] == ["length", "length"]


def test_chat_equals_llm_beam_search(client, llm, server):
    text = llm.tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    prompt = llm.tokenizer.encode(text, add_special_tokens=False)  # as the server and LLM.chat encode it
    expected = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=16), use_tqdm=False)[0]
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, n=2, max_completion_tokens=16,
                                              extra_body={"use_beam_search": True})
    assert [c.message.content for c in response.choices] == [seq.text for seq in expected.outputs]
    assert [c.message.role for c in response.choices] == ["assistant"] * 2
    assert [c.finish_reason for c in response.choices] == [seq.finish_reason for seq in expected.outputs]
    assert response.usage.prompt_tokens == len(prompt)
    assert response.usage.completion_tokens == sum(len(seq.token_ids) for seq in expected.outputs)
    wait_until_free(server)


def test_client_that_leaves_aborts_the_search(server):
    """A client that stops waiting aborts the search: its beams' blocks all come back."""
    body = {"prompt": PROMPTS[0], "use_beam_search": True, "n": 4, "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
    wait_until_free(server)
    response = httpx.post(f"{server.url}/v1/completions", timeout=60,  # the engine goes on serving
                          json={"prompt": PROMPTS[0], "use_beam_search": True, "n": 2, "max_tokens": 3})
    assert response.status_code == 200 and len(response.json()["choices"]) == 2


def test_metrics_time_the_search_but_count_no_time_per_token(server):
    """A search answers whole: its latency and time to first token are observed, a time per token is not."""
    def counts() -> dict[str, float]:
        text = httpx.get(f"{server.url}/metrics").text
        return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
                if s.name.endswith("_count")}

    before = counts()
    response = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={"prompt": PROMPTS, "use_beam_search": True, "n": 2, "max_tokens": 4})
    assert response.status_code == 200
    after = counts()
    for name, added in (("e2e_request_latency_seconds", 2), ("time_to_first_token_seconds", 2),
                        ("time_per_output_token_seconds", 0)):
        key = f"nanoserve:{name}_count"
        assert after[key] - before[key] == added, name


BEAM = {"use_beam_search": True, "max_tokens": 4}
BAD_REQUESTS = [  # (route, body, param)
    ("completions", {"prompt": "Hi", **BEAM, "n": 2, "stream": True}, "stream"),
    ("chat/completions", {"messages": QUESTION, **BEAM, "stream": True}, "stream"),
    ("completions", {"prompt": "Hi", **BEAM, "n": 0}, "n"),
    ("completions", {"prompt": "Hi", **BEAM, "n": -2}, "n"),
    ("completions", {"prompt": "Hi", **BEAM, "n": MAX_NUM_SEQS + 1}, "n"),
    ("chat/completions", {"messages": QUESTION, **BEAM, "n": MAX_NUM_SEQS + 1}, "n"),
    ("completions", {"prompt": "Hi", **BEAM, "n": "2"}, "n"),  # wrong types: strict, not read as 2 or 1
    ("completions", {"prompt": "Hi", **BEAM, "n": True}, "n"),
    ("completions", {"prompt": "Hi", **BEAM, "n": 2.5}, "n"),
    ("completions", {"prompt": "Hi", **BEAM, "n": 3, "best_of": 2}, "best_of"),  # fewer beams than returned
    ("completions", {"prompt": "Hi", **BEAM, "best_of": MAX_NUM_SEQS + 1}, "best_of"),
    ("completions", {"prompt": "Hi", **BEAM, "best_of": True}, "best_of"),
    ("completions", {"prompt": "Hi", **BEAM, "best_of": 0}, "best_of"),
    ("completions", {"prompt": "Hi", **BEAM, "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "Hi", **BEAM, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("completions", {"prompt": "Hi", **BEAM, "temperature": -1}, "temperature"),
    ("completions", {"prompt": "Hi", **BEAM, "length_penalty": "long"}, "length_penalty"),
    ("completions", b'{"prompt": "Hi", "use_beam_search": true, "length_penalty": NaN}', "length_penalty"),
    ("completions", {"prompt": "Hi", **BEAM, "early_stopping": "sometimes"}, "early_stopping"),
    ("completions", {"prompt": "Hi", **BEAM, "early_stopping": 1}, "early_stopping"),
    # what only sampling reads is refused, not ignored
    *[("completions", {"prompt": "Hi", **BEAM, name: value}, name)
      for name, value in [("top_p", 0.5), ("top_k", 5), ("min_p", 0.1), ("presence_penalty", 1.0),
                          ("frequency_penalty", 1.0), ("repetition_penalty", 1.2), ("min_tokens", 2),
                          ("stop", "."), ("stop_token_ids", [5]), ("include_stop_str_in_output", True),
                          ("logprobs", 2), ("echo", True), ("structured_outputs", {"regex": "a+"})]],
    ("chat/completions", {"messages": QUESTION, **BEAM, "logprobs": True}, "logprobs"),
    ("chat/completions", {"messages": QUESTION, **BEAM, "response_format": {"type": "json_object"}},
     "response_format"),
    ("chat/completions", {"messages": QUESTION, **BEAM, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    # and the beam search's fields without it
    ("completions", {"prompt": "Hi", "length_penalty": 2.0}, "length_penalty"),
    ("completions", {"prompt": "Hi", "early_stopping": True}, "early_stopping"),
    ("completions", {"prompt": "Hi", "best_of": 3}, "best_of"),
]


@pytest.mark.parametrize("route, body, param", BAD_REQUESTS)
def test_bad_beam_requests_name_the_field(server, route, body, param):
    kwargs = dict(content=body, headers={"Content-Type": "application/json"}) if isinstance(body, bytes) \
        else dict(json=body)
    response = httpx.post(f"{server.url}/v1/{route}", timeout=30, **kwargs)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error


def test_best_of_equal_to_n_is_plain_sampling(client):
    """OpenAI's legacy completions default best_of to n: without use_beam_search that is sampling as usual."""
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], n=1, best_of=1, max_tokens=3, temperature=0)
    assert len(response.choices) == 1


def test_the_engines_refusals_name_the_clients_field():
    """The engine's own refusals of a beam search name the client's field: n or best_of for a width (more
    candidates than the vocabulary holds), use_beam_search for the server's options; others pass through."""
    def refuse(ids, params):
        raise ValueError(message)

    engine = SimpleNamespace(engine_core=SimpleNamespace(config=SimpleNamespace(max_model_len=64, max_num_seqs=8)),
                             check_beam_request=refuse)
    for fields, message, param in (
            ({"n": 4}, "beam_width (4): each step ranks 8 candidates, more than 6 tokens", "n"),
            ({"n": 2, "best_of": 4}, "beam_width (4): each step ranks 8 candidates, more than 6 tokens", "best_of"),
            ({"n": 2}, "beam search: not with async_scheduling=True", "use_beam_search")):
        request = CompletionRequest(prompt="Hi", use_beam_search=True, max_tokens=4, **fields)
        with pytest.raises(APIError) as error:
            beam_search_streams(engine, request, [[5, 6]], 4, "r")
        assert error.value.param == param and error.value.message == f"{param}: {message}"
    message = "prompt + max_tokens needs 9 KV blocks"
    with pytest.raises(ValueError, match="^prompt"):  # the route's as_api_error names the prompt
        beam_search_streams(engine, request, [[5, 6]], 4, "r")
