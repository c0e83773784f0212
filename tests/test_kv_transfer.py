"""Disaggregated prefill (nanoserve/kv_transfer/): a producer engine computes each prompt, a consumer engine receives
its KV blocks over a torch.distributed group of two and decodes. The output must equal one engine's token for
token, the consumer must compute only each prompt's last token, blocks it holds must not be sent again, and a
failed or slow transfer must cost only the consumer's recomputing that prompt, with no block leaked."""
import dataclasses
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import ROOMY_POOL, free_port, hf_greedy, random_prompts
from nanoserve import LLM, KVTransferConfig, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
ROOT = Path(__file__).resolve().parent.parent


def config(role: str, port: int, **options) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="P2pConnector", kv_role=role, kv_port=port, **options)


def make_pair(path: str, producer_options: dict | None = None, consumer_options: dict | None = None,
              **transfer_options) -> tuple[LLM, LLM]:
    port = free_port()
    producer = LLM(path, **(producer_options or ROOMY_POOL),
                   kv_transfer_config=config("kv_producer", port, **transfer_options))
    consumer = LLM(path, **(consumer_options or ROOMY_POOL),
                   kv_transfer_config=config("kv_consumer", port, **transfer_options))
    return producer, consumer


def disaggregated(producer: LLM, consumer: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    """What the proxy does: the prompt on the producer (max_tokens=1), then the request on the consumer."""
    prefill = dataclasses.replace(params, max_tokens=1, n=1, kv_transfer_params={"do_remote_decode": True})
    producer.generate([{"prompt_token_ids": p} for p in prompts], prefill, use_tqdm=False)
    decode = dataclasses.replace(params, kv_transfer_params={"do_remote_prefill": True})
    return consumer.generate([{"prompt_token_ids": p} for p in prompts], decode, use_tqdm=False)


def connector(llm: LLM):
    return llm.engine.kv_connector


def assert_nothing_leaked(*llms: LLM) -> None:
    for llm in llms:
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
        assert not connector(llm).pulls and not connector(llm).received


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_equals_one_engine_and_transformers(tiny_models, arch):
    path = tiny_models[arch]
    producer, consumer = make_pair(path)
    prompts = random_prompts(6, seed=1) + [[5] * 16, [6] * 17, [7] * 32]  # block edges: 16 tokens a block
    outputs = disaggregated(producer, consumer, prompts)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert tokens == hf_greedy(path, prompts, 8)
    plain = LLM(path, **ROOMY_POOL).generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert tokens == [o.outputs[0].token_ids for o in plain]
    # The consumer computed each prompt's last token only: the rest came from the producer.
    assert [o.num_cached_tokens for o in outputs] == [len(p) - 1 for p in prompts]
    stats = consumer.stats
    assert stats.num_prompt_tokens - stats.num_cached_tokens == len(prompts)
    assert connector(consumer).stats.num_received_tokens == sum(len(p) - 1 for p in prompts)
    assert connector(consumer).stats.num_failed_transfers == 0
    assert not dist.is_initialized()  # the pair's group is its own: the default group is left to parallelism
    assert_nothing_leaked(producer, consumer)


def test_blocks_cached_on_the_consumer_are_not_sent_again(tiny_models):
    path = tiny_models["qwen3"]
    producer, consumer = make_pair(path)
    system = random_prompts(1, seed=2, low=48, high=49)[0]  # 3 full blocks every prompt shares
    first = [system + [10, 11, 12]]
    disaggregated(producer, consumer, first)
    sent = connector(producer).pipe.num_sent_blocks
    assert sent == 4  # 51 tokens, the last one computed by the consumer: blocks 0-3 hold the 50 others
    prompts = [system + tail for tail in ([20] * 20, [30] * 5, [40, 41])]
    outputs = disaggregated(producer, consumer, prompts)
    # Only the blocks after the shared 48 tokens came over: tokens 48-66, 48-51 and 48 (the last one is computed here).
    assert connector(producer).pipe.num_sent_blocks - sent == 2 + 1 + 1
    assert [o.num_cached_tokens for o in outputs] == [len(p) - 1 for p in prompts]
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(path, prompts, 8)
    assert_nothing_leaked(producer, consumer)


def test_chunked_prefill_on_the_producer_and_async_consumer(tiny_models):
    path = tiny_models["qwen3"]
    producer, consumer = make_pair(path, dict(ROOMY_POOL, enable_chunked_prefill=True, max_num_batched_tokens=16),
                                   dict(ROOMY_POOL, async_scheduling=True))
    prompts = random_prompts(5, seed=3, low=30, high=70)
    outputs = disaggregated(producer, consumer, prompts)
    assert producer.stats.num_chunked_prefills > 0
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(path, prompts, 8)
    assert [o.num_cached_tokens for o in outputs] == [len(p) - 1 for p in prompts]
    assert_nothing_leaked(producer, consumer)


def test_parallel_sampling_on_the_consumer(tiny_models):
    path = tiny_models["qwen3"]
    producer, consumer = make_pair(path)
    prompts = random_prompts(3, seed=4)
    params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=6)
    outputs = disaggregated(producer, consumer, prompts, params)
    plain = LLM(path, **ROOMY_POOL).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[c.token_ids for c in o.outputs] for o in plain]
    assert_nothing_leaked(producer, consumer)


def test_a_block_aligned_prompt_sent_again_computes_its_last_block(tiny_models):
    """As in vLLM V1: the consumer's own cache hit stops at len(prompt) - 1, in whole blocks, so a prompt of
    exactly two blocks, sent a second time, computes its last block there (16 tokens); nothing is pulled again."""
    path = tiny_models["qwen3"]
    producer, consumer = make_pair(path)
    prompt = random_prompts(1, seed=13, low=32, high=33)
    assert disaggregated(producer, consumer, prompt)[0].num_cached_tokens == 31  # all but the last token came
    received = connector(consumer).stats.num_received_blocks
    again = disaggregated(producer, consumer, prompt)[0]
    assert again.num_cached_tokens == 16 and connector(consumer).stats.num_received_blocks == received
    assert again.outputs[0].token_ids == hf_greedy(path, prompt, 8)[0]
    assert_nothing_leaked(producer, consumer)


def test_a_consumer_pool_too_small(tiny_models):
    """A request whose blocks could never fit fails alone, before anything; requests that fit only a few at a time
    wait in the queue for blocks, their received KV with them, and still equal one engine."""
    path = tiny_models["qwen3"]
    producer, consumer = make_pair(path, consumer_options=dict(num_kvcache_blocks=8))
    big = random_prompts(1, seed=5, low=120, high=121)
    disaggregated(producer, consumer, big, SamplingParams(temperature=0.0, max_tokens=1))  # (8 blocks fit it)
    with pytest.raises(ValueError, match="KV blocks but num_kvcache_blocks is 8"):
        disaggregated(producer, consumer, big, SamplingParams(temperature=0.0, max_tokens=20))
    prompts = random_prompts(4, seed=6, low=30, high=45)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    outputs = disaggregated(producer, consumer, prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(path, prompts, 16)
    assert consumer.stats.num_prefill_steps >= 3  # the big one, then two at a time
    assert_nothing_leaked(producer, consumer)


def test_a_producer_buffer_too_small_means_recompute(tiny_models):
    path = tiny_models["qwen3"]
    producer, consumer = make_pair(path, kv_buffer_size=0)  # the producer keeps nothing for the consumer
    prompts = random_prompts(3, seed=7)
    outputs = disaggregated(producer, consumer, prompts)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(path, prompts, 8)
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 0]
    assert connector(producer).pipe.num_sent_blocks == 0
    assert_nothing_leaked(producer, consumer)


@pytest.mark.parametrize("options, message", [
    (dict(kv_connector="NixlConnector", kv_role="kv_producer"), "kv_transfer_config.kv_connector"),
    (dict(kv_connector="P2pConnector", kv_role="kv_both"), "kv_transfer_config.kv_role"),
    (dict(kv_connector="P2pConnector", kv_role="kv_consumer", kv_rank=0), "kv_transfer_config.kv_rank"),
    (dict(kv_connector="P2pConnector", kv_role="kv_consumer", kv_port=70000), "kv_transfer_config.kv_port"),
    (dict(kv_connector="P2pConnector", kv_role="kv_consumer", kv_buffer_size=-1), "kv_buffer_size"),
    (dict(kv_connector="P2pConnector", kv_role="kv_consumer", kv_connector_extra_config={"transfer_timeout": 0}),
     "transfer_timeout"),
    (dict(kv_connector="P2pConnector", kv_role="kv_consumer", kv_host="x"), "unknown key"),
    ("P2pConnector", "kv_transfer_config must be a dict"),
])
def test_bad_config(tiny_models, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_models["qwen3"], kv_transfer_config=options)


def test_tensor_parallel_is_refused(tiny_models):
    """Each rank would have to send its own share of the KV: refused before any rank starts."""
    with pytest.raises(ValueError, match="kv_transfer_config: needs tensor_parallel_size = "):
        LLM(tiny_models["qwen3"], tensor_parallel_size=2, kv_transfer_config=config("kv_producer", free_port()))


def test_bad_params(tiny_models):
    path = tiny_models["qwen3"]
    producer, consumer = make_pair(path)
    with pytest.raises(ValueError, match="kv_transfer_params: this engine has no feature"):
        LLM(path, **ROOMY_POOL).generate([1, 2, 3], SamplingParams(kv_transfer_params={"do_remote_decode": True}))
    with pytest.raises(ValueError, match="kv_transfer_params.do_remote_prefill: this engine's kv_role is kv_producer"):
        producer.generate([1, 2, 3], SamplingParams(kv_transfer_params={"do_remote_prefill": True}))
    with pytest.raises(ValueError, match="kv_transfer_params.remote_port"):
        consumer.generate([1, 2, 3], SamplingParams(kv_transfer_params={"do_remote_prefill": True,
                                                                          "remote_port": 1}))
    with pytest.raises(ValueError, match="kv_transfer_params: must be a dict"):
        consumer.generate([1, 2, 3], SamplingParams(kv_transfer_params={"remote_block_ids": [1]}))
    assert consumer.generate([1, 2, 3], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still serving
    assert_nothing_leaked(producer, consumer)


# A producer that joins the pair, takes the consumer's first pull (after its heartbeats), and then dies or hangs
# (mid-transfer); or a consumer that joins and dies.
FAKE_PEER = """
import os, sys, time, torch
from nanoserve.kv_transfer.pipe import connect, join, take_number
from nanoserve.kv_transfer_config import KVTransferConfig
config = KVTransferConfig(kv_connector="P2pConnector", kv_role=sys.argv[2], kv_port=int(sys.argv[1]))
store = connect(config)
group = join(store, config, torch.device("cpu"), take_number(store, config))
if config.is_producer:
    count = torch.zeros(1, dtype=torch.int64)
    while not count:
        group.recv([count], 1, 0).wait()
    group.recv([torch.empty(int(count), dtype=torch.int64)], 1, 0).wait()
print("pulled" if config.is_producer else "joined", flush=True)
if sys.argv[3] == "die":
    os._exit(1)
time.sleep(600)
"""


def fake_peer(port: int, role: str, fault: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", FAKE_PEER, str(port), role, fault], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize("fault", ["die", "hang"])
def test_a_producer_that_dies_or_hangs_mid_transfer(tiny_models, fault):
    """The consumer computes the prompt itself (after transfer_timeout when the producer hangs), no block is
    leaked, and the requests after it are served, computed here too."""
    path = tiny_models["qwen3"]
    port = free_port()
    fake = fake_peer(port, "kv_producer", fault)
    try:
        consumer = LLM(path, **ROOMY_POOL, kv_transfer_config=config(
            "kv_consumer", port, kv_connector_extra_config={"transfer_timeout": 2.0}))
        prompts = random_prompts(3, seed=8, low=20, high=40)
        params = dataclasses.replace(GREEDY, kv_transfer_params={"do_remote_prefill": True})
        start = time.monotonic()
        outputs = consumer.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert fake.stdout.readline() == "pulled\n"
        assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(path, prompts, 8)
        assert [o.num_cached_tokens for o in outputs] == [0, 0, 0]
        assert connector(consumer).stats.num_failed_transfers == 3
        if fault == "hang":
            assert time.monotonic() - start >= 2.0  # each waited out its own deadline, all at once
            # A request aborted while it waits for its blocks leaves nothing behind.
            consumer.engine.add_request("waits", prompts[0], params)
            consumer.engine.step()
            assert "waits" in connector(consumer).pulls and consumer.engine.abort_request("waits")
            consumer.engine.step()
        else:
            fake.wait(timeout=10)
            assert connector(consumer).pipe.error is not None
            later = consumer.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # fails fast
            assert later[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids
        assert_nothing_leaked(consumer)
    finally:
        fake.kill()
        fake.wait()


def rejoined(llm: LLM, num_joins: int, timeout: float = 120.0) -> None:
    """Wait until llm's end of the pair has joined num_joins pairs (its peer came back)."""
    deadline = time.monotonic() + timeout
    while connector(llm).pipe.num_joins < num_joins:
        assert time.monotonic() < deadline, f"the pair was not joined again: {connector(llm).pipe.error}"
        time.sleep(0.1)


def test_a_killed_producer_fails_transfers_at_once_and_its_restart_is_joined(tiny_models):
    """kill -9 of the producer while the consumer's first pull waits for its answer, two more queued behind it:
    all three fail at once (not after transfer_timeout) and are computed on the consumer, as is a new request sent
    straight to it. A producer started again on the same port is joined with no restart of the consumer, and the
    next prompts' blocks come over again."""
    path = tiny_models["qwen3"]
    port = free_port()
    fake = fake_peer(port, "kv_producer", "hang")
    killed = []

    def kill_mid_transfer() -> None:
        if fake.stdout.readline() == "pulled\n":
            fake.kill()
            killed.append(time.monotonic())

    killer = threading.Thread(target=kill_mid_transfer)
    killer.start()
    try:
        consumer = LLM(path, **ROOMY_POOL, kv_transfer_config=config(
            "kv_consumer", port, kv_connector_extra_config={"transfer_timeout": 60.0}))
        prompts = random_prompts(3, seed=9, low=20, high=40)
        params = dataclasses.replace(GREEDY, kv_transfer_params={"do_remote_prefill": True})
        outputs = consumer.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert killed and time.monotonic() - killed[0] < 2.0  # (transfer_timeout is 60 s)
        assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(path, prompts, 8)
        assert [o.num_cached_tokens for o in outputs] == [0, 0, 0]
        new = random_prompts(1, seed=10, low=20, high=40)
        start = time.monotonic()
        later = consumer.generate([{"prompt_token_ids": new[0]}], params, use_tqdm=False)
        assert time.monotonic() - start < 2.0 and connector(consumer).pipe.error is not None
        assert later[0].outputs[0].token_ids == hf_greedy(path, new, 8)[0] and later[0].num_cached_tokens == 0
        assert connector(consumer).stats.num_failed_transfers == 4
        assert_nothing_leaked(consumer)
    finally:
        fake.kill()
        fake.wait()
        killer.join()
    producer = LLM(path, **ROOMY_POOL, kv_transfer_config=config("kv_producer", port))  # back, on the same port
    rejoined(consumer, 2)
    prompts = random_prompts(3, seed=11, low=20, high=40)
    outputs = disaggregated(producer, consumer, prompts)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(path, prompts, 8)
    assert [o.num_cached_tokens for o in outputs] == [len(p) - 1 for p in prompts]  # the blocks came over
    assert connector(consumer).stats.num_failed_transfers == 4 and connector(consumer).pipe.error is None
    assert_nothing_leaked(producer, consumer)


def test_a_consumer_that_comes_back_is_joined(tiny_models):
    """A consumer that dies (one that joins and exits) breaks the producer's pair; the next consumer on its port
    is joined with no restart of the producer, and gets its blocks."""
    path = tiny_models["qwen3"]
    port = free_port()
    producer = LLM(path, **ROOMY_POOL, kv_transfer_config=config("kv_producer", port))
    fake = fake_peer(port, "kv_consumer", "die")
    try:
        assert fake.stdout.readline() == "joined\n" and fake.wait(timeout=60) == 1
    finally:
        fake.kill()
        fake.wait()
    consumer = LLM(path, **ROOMY_POOL, kv_transfer_config=config("kv_consumer", port))
    prompts = random_prompts(3, seed=12, low=20, high=40)
    outputs = disaggregated(producer, consumer, prompts)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(path, prompts, 8)
    assert [o.num_cached_tokens for o in outputs] == [len(p) - 1 for p in prompts]
    assert connector(producer).pipe.num_joins == 2
    assert_nothing_leaked(producer, consumer)


def test_the_proxy_command(capsys):
    from nanoserve.serving import cli
    from nanoserve.serving.proxy import prefill_body

    with pytest.raises(SystemExit) as done:
        cli.main(["proxy", "--help"])
    assert done.value.code == 0 and "--prefill URL" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:  # checked at start: a non-zero exit with one line
        cli.main(["proxy", "--prefill", "not-a-url", "--decode", "http://127.0.0.1:8200"])
    assert str(refused.value.code).startswith("nanoserve proxy: --prefill 'not-a-url' is not an http://")
    assert "\n" not in refused.value.code
    # The prefill instance computes the prompt and one token, not streamed, whatever the client asked for.
    body = {"prompt": "Hi", "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}, "n": 2,
            "max_completion_tokens": 64, "min_tokens": 4, "temperature": 0.5}
    assert prefill_body(body) == {"prompt": "Hi", "max_tokens": 1, "temperature": 0.5,
                                  "kv_transfer_params": {"do_remote_decode": True}}


@pytest.mark.parametrize("seed, producer_options, consumer_options", [
    (0, dict(num_kvcache_blocks=64), dict(num_kvcache_blocks=24)),
    (1, dict(num_kvcache_blocks=64, enable_chunked_prefill=True, max_num_batched_tokens=24),
     dict(num_kvcache_blocks=24, async_scheduling=True)),
    (2, dict(num_kvcache_blocks=16), dict(num_kvcache_blocks=20, enable_chunked_prefill=True,
                                          max_num_batched_tokens=32)),
])
def test_random_rounds_equal_one_engine(tiny_models, seed, producer_options, consumer_options):
    """Rounds of random prompts, many sharing prefixes, random n and lengths, through a pair whose pools are small
    (the consumer preempts; the producer's prefix cache evicts): every output equals one engine's with the same
    seeds, and no block is leaked."""
    path = tiny_models["qwen3"]
    producer, consumer = make_pair(path, producer_options, consumer_options)
    plain = LLM(path, **ROOMY_POOL)
    rng = random.Random(seed)
    prefixes = random_prompts(3, seed=seed, low=10, high=40)
    for _ in range(3):
        tail = lambda: [rng.randrange(3, 512) for _ in range(rng.randint(1, 20))]  # noqa: E731
        prompts = [rng.choice(prefixes)[: rng.randint(1, 40)] + tail() for _ in range(rng.randint(2, 5))]
        params = SamplingParams(n=rng.choice([1, 1, 2]), temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(100),
                                max_tokens=rng.randint(1, 12))
        outputs = disaggregated(producer, consumer, prompts, params)
        expected = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outputs] == [[c.token_ids for c in o.outputs]
                                                                       for o in expected]
        # (Fewer: a request preempted on the consumer recomputes, as any other; one whose own cached prefix was
        # evicted between asking for the rest and getting its blocks computes from there.)
        assert all(o.num_cached_tokens <= len(p) - 1 for o, p in zip(outputs, prompts))
        assert_nothing_leaked(producer, consumer)
    assert connector(consumer).stats.num_failed_transfers == 0 and connector(consumer).stats.num_received_tokens
