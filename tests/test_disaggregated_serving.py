"""Disaggregated prefill over HTTP: a prefill server (kv_producer), a decode server (kv_consumer) and `nanoserve
proxy` in front, real processes on 127.0.0.1, driven by the `openai` client. Greedy output through the proxy equals
one offline engine's, for completions, chat and streams, with n > 1 and prefix hits; the decode instance computes
each prompt's last token only; errors from either instance, and bodies the proxy refuses itself, reach the client
in OpenAI's shape, and a fuzzer finds no 5xx; a killed prefill instance costs a request no wait, and once started
again it is joined and used with no restart of the others."""
import json
import time
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_responses import bodies

from conftest import free_port, start_server
from nanoserve import LLM, SamplingParams

MAX_MODEL_LEN = 512
FLAGS = ["--max-model-len", str(MAX_MODEL_LEN), "--cpu-kvcache-space", "0.25", "--shutdown-timeout", "1",
         "--uvicorn-log-level", "warning", "--served-model-name", "smollm2"]
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = SamplingParams(temperature=0, max_tokens=16)


def kv_flag(role: str, port: int) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "P2pConnector", "kv_role": role, "kv_port": port})]


@dataclass
class Pair:
    """The three processes (prefill, decode, proxy: stopped at the end), their URLs, and how the prefill instance
    was started (to start it again)."""

    proxy: str
    prefill: str
    decode: str
    processes: list[Popen]
    prefill_args: list[str]
    logs: Path


@pytest.fixture(scope="module")
def pair(converted, tmp_path_factory):
    logs = tmp_path_factory.mktemp("disaggregated")
    kv_port = free_port()
    processes = []
    try:
        # The prefill instance cuts prompts into chunks of 32 tokens (chunked prefill on the producer).
        prefill_args = [str(converted[1]), *FLAGS, *kv_flag("kv_producer", kv_port), "--dashboard",
                        "--enable-chunked-prefill", "--max-num-batched-tokens", "32"]
        prefill, p = start_server(prefill_args, logs / "prefill.log")
        processes.append(p)
        decode, p = start_server([str(converted[1]), *FLAGS, *kv_flag("kv_consumer", kv_port), "--dashboard"],
                                 logs / "decode.log")
        processes.append(p)
        proxy, p = start_server(["--prefill", prefill, "--decode", decode, "--uvicorn-log-level", "warning"],
                                logs / "proxy.log", module="nanoserve.serving.proxy")
        processes.append(p)
        yield Pair(proxy, prefill, decode, processes, prefill_args, logs)
    finally:
        for process in processes:
            process.terminate()
            process.wait(30)


@pytest.fixture(scope="module")
def client(pair) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{pair.proxy}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(converted) -> LLM:
    return LLM(str(converted[1]), max_model_len=MAX_MODEL_LEN, cpu_kvcache_space=0.25)


def test_completions_and_streams_equal_one_engine(client, llm):
    expected = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    response = client.completions.create(model="smollm2", prompt=PROMPTS, max_tokens=16, temperature=0)
    assert [c.text for c in response.choices] == [e.text for e in expected]
    assert [c.finish_reason for c in response.choices] == [e.finish_reason for e in expected]
    # The decode instance computed each prompt's last token only: the rest was the prefill instance's KV.
    num_prompt = sum(len(llm.tokenizer.encode(p)) for p in PROMPTS)
    assert response.usage.prompt_tokens_details.cached_tokens == num_prompt - len(PROMPTS)
    stream = client.completions.create(model="smollm2", prompt=PROMPTS[1], max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == expected[1].text


def test_chat_and_its_stream_equal_one_engine(client, llm):
    expected = llm.chat(QUESTION, GREEDY, use_tqdm=False)[0].outputs[0].text
    response = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=16, temperature=0)
    assert response.choices[0].message.content == expected
    stream = client.chat.completions.create(model="smollm2", messages=QUESTION, max_completion_tokens=16,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_prefix_hits_and_n_equal_one_engine(client, llm):
    """Prompts sharing a long prefix (the decode instance holds its blocks after the first), and n=2 with a seed."""
    prefix = "Here is a long story about a cat who lived in a library and read every book on every shelf. " * 3
    prompts = [prefix + "The cat's name was", prefix + "One day the cat found"]
    for prompt in prompts:
        response = client.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0)
        assert response.choices[0].text == llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].text
        assert response.usage.prompt_tokens_details.cached_tokens == response.usage.prompt_tokens - 1
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=8)
    expected = [c.text for c in llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs]
    response = client.completions.create(model="smollm2", prompt=PROMPTS[0], n=2, temperature=0.8, seed=7,
                                         max_tokens=8)
    assert [c.text for c in response.choices] == expected


def test_errors_pass_through(client, pair):
    with pytest.raises(openai.BadRequestError) as refused:  # refused by the prefill instance
        client.completions.create(model="smollm2", prompt="Hi", temperature=-1)
    assert refused.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as refused:  # the prefill instance takes 1 token; the decode refuses
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=MAX_MODEL_LEN)
    assert refused.value.body["param"] == "max_tokens"
    # The decode instance refuses kv_transfer_params meant for a prefill instance; a plain one has no connector.
    answer = httpx.post(f"{pair.decode}/v1/completions", json={"prompt": "Hi", "kv_transfer_params":
                                                           {"do_remote_decode": True}})
    assert answer.status_code == 400 and "kv_role is kv_consumer" in answer.json()["error"]["message"]


def engine_state(url: str) -> dict:
    """The engine state the dashboard's first event carries."""
    with httpx.stream("GET", f"{url}/debug/steps", timeout=30) as response:
        event = next(line for line in response.iter_lines() if line.startswith("data:") and '"engine"' in line)
    return json.loads(event[5:])["engine"]


def test_the_dashboards_show_blocks_sent_and_received(client, pair):
    client.completions.create(model="smollm2", prompt=PROMPTS[0] * 5, max_tokens=2, temperature=0)
    prefill, decode = engine_state(pair.prefill), engine_state(pair.decode)
    assert prefill["kv_transfer"]["kv_role"] == "kv_producer" and prefill["kv_transfer"]["num_sent_blocks"] > 0
    assert prefill["stats"]["num_chunked_prefills"] > 0  # the long prompts were cut into chunks there
    received = decode["kv_transfer"]
    assert received["kv_role"] == "kv_consumer" and received["num_failed_transfers"] == 0
    # (The prefill instance's page reads its engine after each step: the pull of the last prompt came later.)
    assert 0 < prefill["kv_transfer"]["num_sent_blocks"] < received["num_received_blocks"]


@pytest.mark.parametrize("body", [b'{"model": "smollm2", "prompt": "Hi",', b"[1, 2]", b'"Hi"'])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_the_proxy_refuses_bodies_in_openai_shape(pair, route, body):
    """Malformed JSON, a list, a string: a 400 before either instance sees them; /v1/responses, which the pair
    does not serve, a 404 naming the routes the proxy has."""
    answer = httpx.post(f"{pair.proxy}{route}", content=body, headers={"content-type": "application/json"},
                        timeout=30)
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    if route == "/v1/responses":
        assert answer.status_code == 404 and "POST /v1/completions" in error["message"]
    else:
        assert answer.status_code == 400 and error["message"].startswith("body: "), error


def test_models_health_and_metrics(client, pair):
    """/v1/models is the decode instance's; /health checks both; /metrics has both instances' series, each
    labelled with its kv_role."""
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    assert httpx.get(f"{pair.proxy}/health", timeout=30).status_code == 200
    client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=2, temperature=0)
    text = httpx.get(f"{pair.proxy}/metrics", timeout=30).text
    for kv_role in ("kv_producer", "kv_consumer"):
        line = next(line for line in text.splitlines() if line.startswith("nanoserve:prompt_tokens_total{")
                    and f'kv_role="{kv_role}"' in line)
        assert float(line.split()[-1]) > 0, line
    hits = next(line for line in text.splitlines() if line.startswith("nanoserve:prefix_cache_hits_total{")
                and 'kv_role="kv_consumer"' in line)
    assert float(hits.split()[-1]) > 0  # the decode instance's received blocks count as cache hits


def test_openapi_fuzzer_through_the_proxy_finds_no_5xx(client, pair, llm):
    """The plain server's fuzzer (tests/test_responses.py) through the proxy: bodies generated from the decode
    instance's OpenAPI schema for the routes the proxy serves, fitting or broken in one place. Every answer is
    below 500, and both instances still serve after: a request still has its blocks sent."""
    jsonschema = pytest.importorskip("jsonschema")
    document = httpx.get(f"{pair.decode}/openapi.json").json()
    components = document["components"]["schemas"]
    routes = ("/v1/completions", "/v1/chat/completions")
    schemas = {path: document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
               for path in routes}
    answers = {path: {**document["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]["schema"],
                      "components": components} for path in routes}
    http = httpx.Client(base_url=pair.proxy, timeout=60)
    statuses = []

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(data=st.data())
    def fuzz(path, data):
        body = data.draw(bodies(schemas[path], components))
        response = http.post(path, json=body)
        statuses.append(response.status_code)
        assert response.status_code < 500, (path, body, response.text)
        if isinstance(body, dict) and body.get("stream") is True and response.status_code == 200:
            assert '"server_error"' not in response.text, (path, body, response.text)
        elif response.status_code == 200:
            jsonschema.validate(response.json(), answers[path])

    for path in routes:
        fuzz(path)
    print(f"the proxy's fuzzer: {len(statuses)} requests, {statuses.count(200)} answered 200, "
          f"{sum(s >= 500 for s in statuses)} 5xx")
    assert statuses.count(200) > 0
    response = client.completions.create(model="smollm2", prompt=PROMPTS[1], max_tokens=16, temperature=0)
    assert response.choices[0].text == llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0].text
    assert response.usage.prompt_tokens_details.cached_tokens == response.usage.prompt_tokens - 1
    assert httpx.get(f"{pair.proxy}/health", timeout=30).status_code == 200


def test_a_killed_prefill_instance_started_again(client, pair, llm):
    """(Last: it kills the prefill instance.) The proxy answers 502 in OpenAI's shape and /health names the
    prefill instance; the decode instance, asked directly, finds the pipe down at once (not after
    transfer_timeout, 10 s), computes the prompt itself and answers as one engine, every block freed after. The
    prefill instance started again on its port is joined by the decode instance with no restart, and the next
    request through the proxy has its blocks sent again."""
    prefill = pair.processes[0]
    prefill.kill()
    prefill.wait(30)
    with pytest.raises(openai.InternalServerError) as failed:
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=4)
    assert failed.value.status_code == 502 and "prefill instance" in failed.value.body["message"]
    health = httpx.get(f"{pair.proxy}/health", timeout=30)
    assert health.status_code == 503 and "the prefill instance" in health.json()["error"]["message"]
    assert "decode instance" not in health.json()["error"]["message"]
    expected = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    start = time.monotonic()
    answer = httpx.post(f"{pair.decode}/v1/completions", timeout=60, json={
        "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0, "kv_transfer_params": {"do_remote_prefill": True}})
    elapsed = time.monotonic() - start
    print(f"a request straight to the decode instance after kill -9 of the prefill instance: {elapsed:.2f} s")
    assert elapsed < 10.0 and "no KV after" not in (pair.logs / "decode.log").read_text()  # (transfer_timeout)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected[0].outputs[0].text
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed here
    state = engine_state(pair.decode)
    assert state["kv_transfer"]["num_failed_transfers"] == 1 and state["kv_transfer"]["error"]
    assert all(ref_count == 0 for ref_count, _, _ in state["blocks"])  # no block leaked
    received = state["kv_transfer"]["num_received_blocks"]

    port = int(pair.prefill.rsplit(":", 1)[1])
    _, pair.processes[0] = start_server(pair.prefill_args, pair.logs / "prefill-again.log", port=port)
    deadline = time.monotonic() + 120
    while True:  # the decode instance joins it (its dashboard reads the engine after a step: a plain request)
        httpx.post(f"{pair.decode}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60)
        if engine_state(pair.decode)["kv_transfer"]["error"] is None:
            break
        assert time.monotonic() < deadline, "the decode instance did not join the prefill instance again"
        time.sleep(0.5)
    prompt = "A new prompt, never seen by the decode instance, about the sea"
    response = client.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0)
    assert response.choices[0].text == llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].text
    assert response.usage.prompt_tokens_details.cached_tokens == response.usage.prompt_tokens - 1
    state = engine_state(pair.decode)["kv_transfer"]
    assert state["num_received_blocks"] > received and state["num_failed_transfers"] == 1
    assert httpx.get(f"{pair.proxy}/health", timeout=30).status_code == 200
