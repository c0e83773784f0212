"""Disaggregated prefill over HTTP: a prefill server (kv_producer), a decode server (kv_consumer) and `nanoserve
proxy` in front, real processes on 127.0.0.1, driven by the `openai` client. Greedy output through the proxy equals
one offline engine's, for completions, chat and streams, with n > 1 and prefix hits; the decode instance computes
each prompt's last token only; errors from either instance reach the client in OpenAI's shape."""
import json

import httpx
import openai
import pytest

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


@pytest.fixture(scope="module")
def pair(converted, tmp_path_factory):
    """(proxy URL, prefill URL, decode URL, [prefill, decode, proxy processes]), stopped at the end."""
    logs = tmp_path_factory.mktemp("disaggregated")
    kv_port = free_port()
    processes = []
    try:
        # The prefill instance cuts prompts into chunks of 32 tokens (chunked prefill on the producer).
        prefill, p = start_server([str(converted[1]), *FLAGS, *kv_flag("kv_producer", kv_port), "--dashboard",
                                   "--enable-chunked-prefill", "--max-num-batched-tokens", "32"], logs / "prefill.log")
        processes.append(p)
        decode, p = start_server([str(converted[1]), *FLAGS, *kv_flag("kv_consumer", kv_port), "--dashboard"],
                                 logs / "decode.log")
        processes.append(p)
        proxy, p = start_server(["--prefill", prefill, "--decode", decode, "--uvicorn-log-level", "warning"],
                                logs / "proxy.log", module="nanoserve.serving.proxy")
        processes.append(p)
        yield proxy, prefill, decode, processes
    finally:
        for process in processes:
            process.terminate()
            process.wait(30)


@pytest.fixture(scope="module")
def client(pair) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{pair[0]}/v1", api_key="none", max_retries=0, timeout=120)


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
    answer = httpx.post(f"{pair[2]}/v1/completions", json={"prompt": "Hi", "kv_transfer_params":
                                                           {"do_remote_decode": True}})
    assert answer.status_code == 400 and "kv_role is kv_consumer" in answer.json()["error"]["message"]


def engine_state(url: str) -> dict:
    """The engine state the dashboard's first event carries."""
    with httpx.stream("GET", f"{url}/debug/steps", timeout=30) as response:
        event = next(line for line in response.iter_lines() if line.startswith("data:") and '"engine"' in line)
    return json.loads(event[5:])["engine"]


def test_the_dashboards_show_blocks_sent_and_received(client, pair):
    client.completions.create(model="smollm2", prompt=PROMPTS[0] * 5, max_tokens=2, temperature=0)
    prefill, decode = engine_state(pair[1]), engine_state(pair[2])
    assert prefill["kv_transfer"]["kv_role"] == "kv_producer" and prefill["kv_transfer"]["num_sent_blocks"] > 0
    assert prefill["stats"]["num_chunked_prefills"] > 0  # the long prompts were cut into chunks there
    received = decode["kv_transfer"]
    assert received["kv_role"] == "kv_consumer" and received["num_failed_transfers"] == 0
    # (The prefill instance's page reads its engine after each step: the pull of the last prompt came later.)
    assert 0 < prefill["kv_transfer"]["num_sent_blocks"] < received["num_received_blocks"]


def test_a_killed_prefill_instance(client, pair, llm):
    """(Last: it kills the prefill instance.) The proxy answers 502 in OpenAI's shape; the decode instance, asked
    directly, finds the pipe down, computes the prompt itself and answers as one engine, every block freed after."""
    proxy, prefill, decode, processes = pair
    processes[0].kill()
    processes[0].wait(30)
    with pytest.raises(openai.InternalServerError) as failed:
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=4)
    assert failed.value.status_code == 502 and "prefill instance" in failed.value.body["message"]
    expected = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0].text
    answer = httpx.post(f"{decode}/v1/completions", timeout=60, json={
        "prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0, "kv_transfer_params": {"do_remote_prefill": True}})
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed here
    state = engine_state(decode)
    assert state["kv_transfer"]["num_failed_transfers"] == 1 and state["kv_transfer"]["error"]
    assert all(ref_count == 0 for ref_count, _, _ in state["blocks"])  # no block leaked
