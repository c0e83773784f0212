"""AsyncLLM over the EngineCore busy loop: streaming output kinds, aborts (cancel, break, another thread),
many threads at once, a failing step, an idle engine, shutdown."""
import asyncio
import contextlib
import gc
import random
import threading
import time

import pytest

from conftest import hf_greedy, random_prompts
from nanoserve import LLM, AsyncLLM, RequestOutputKind, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 43))]
OPTIONS = dict(block_size=4, num_kvcache_blocks=64, max_model_len=64)
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_models):
    llm = AsyncLLM(tiny_models["llama"], **OPTIONS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_models):
    return hf_greedy(tiny_models["llama"], PROMPTS, 8)


async def wait_idle(llm: AsyncLLM) -> None:
    """Until the engine thread has dropped every request and every KV block is free again."""
    core, bm = llm.engine_core, llm.engine_core.block_manager
    for _ in range(500):
        if not core.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks:
            return
        await asyncio.sleep(0.01)
    pytest.fail("the engine did not free the request's blocks")


async def collect(llm: AsyncLLM, prompt, params: SamplingParams, **kwargs) -> list:
    return [out async for out in llm.generate(prompt, params, **kwargs)]


def test_the_three_output_kinds(engine, expected):
    def params(kind):
        return SamplingParams(temperature=0, max_tokens=8, output_kind=kind)

    async def main():
        return await asyncio.gather(
            collect(engine, PROMPTS[0], params(RequestOutputKind.CUMULATIVE)),
            collect(engine, {"prompt_token_ids": PROMPTS[1]}, params(RequestOutputKind.DELTA)),
            collect(engine, PROMPTS[2], params(RequestOutputKind.FINAL_ONLY), request_id="final"))

    cumulative, delta, final = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in cumulative] == [expected[0][:i] for i in range(1, len(expected[0]) + 1)]
    assert [o.outputs[0].token_ids for o in delta] == [[t] for t in expected[1]]
    assert [o.outputs[0].token_ids for o in final] == [expected[2]] and final[0].request_id == "final"
    for outputs in (cumulative, delta, final):
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        assert outputs[-1].outputs[0].finish_reason in ("stop", "length")
    assert delta[0].prompt_token_ids == PROMPTS[1]


def test_a_bad_request_raises_before_any_work(engine, expected):
    async def main():
        with pytest.raises(ValueError, match=r"vocab_size=512"):
            await collect(engine, [5, 512], SamplingParams())
        return await collect(engine, PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))

    assert asyncio.run(main())[-1].outputs[0].token_ids == expected[0]


@pytest.mark.parametrize("how", ["cancel", "break"])
def test_a_client_that_goes_away_aborts_its_request(engine, expected, how):
    async def consume(seen: list):
        async for out in engine.generate(PROMPTS[2], LONG):
            seen.append(out)
            if how == "break" and len(seen) == 3:
                break

    async def main():
        seen = []
        task = asyncio.create_task(consume(seen))
        while len(seen) < 3:
            await asyncio.sleep(0.005)
        if how == "cancel":
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert task.cancelled() == (how == "cancel")
        await wait_idle(engine)
        assert len(seen) < LONG.max_tokens
        return await collect(engine, PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))

    assert asyncio.run(main())[-1].outputs[0].token_ids == expected[0]


def test_abort_from_another_thread(engine):
    async def main():
        outputs = []
        async for out in engine.generate(PROMPTS[1], LONG, request_id="doomed"):
            outputs.append(out)
            if len(outputs) == 2:
                threading.Thread(target=engine.abort, args=("doomed",)).start()
        await wait_idle(engine)
        return outputs

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert 2 <= len(outputs[-1].outputs[0].token_ids) < LONG.max_tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_200_requests_from_8_threads_equal_one_offline_run(tiny_models, async_scheduling):
    """Each thread runs its own event loop and starts its 25 requests at random moments."""
    prompts = random_prompts(200, seed=3, low=2, high=24)
    rng = random.Random(0)
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 6)) for _ in prompts]
    delays = [rng.random() * 0.5 for _ in prompts]
    path = tiny_models["qwen3"]
    offline = LLM(path, **OPTIONS).generate(prompts, params, use_tqdm=False)
    llm = AsyncLLM(path, **OPTIONS, async_scheduling=async_scheduling)
    results: dict[int, list[int]] = {}

    async def one(i: int):
        await asyncio.sleep(delays[i])
        outputs = await collect(llm, prompts[i], params[i], request_id=f"req-{i}")
        results[i] = outputs[-1].outputs[0].token_ids

    async def client(thread: int):
        await asyncio.gather(*(one(i) for i in range(thread, len(prompts), 8)))

    threads = [threading.Thread(target=asyncio.run, args=(client(t),)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [results.get(i) for i in range(len(prompts))] == [o.outputs[0].token_ids for o in offline]
    asyncio.run(wait_idle(llm))
    llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failing_step_reaches_its_callers_and_the_engine_goes_on(tiny_models, monkeypatch, async_scheduling):
    llm = AsyncLLM(tiny_models["qwen2"], **OPTIONS, async_scheduling=async_scheduling)
    execute, calls = llm.engine_core.executor.execute_model, []

    def fail_once_both_run(out, inputs):
        if len(out.seqs) == 2 and not calls:
            calls.append(out)
            raise RuntimeError("injected failure")
        return execute(out, inputs)

    monkeypatch.setattr(llm.engine_core.executor, "execute_model", fail_once_both_run)

    async def main():
        results = await asyncio.gather(*(collect(llm, p, LONG) for p in PROMPTS[:2]), return_exceptions=True)
        assert all(isinstance(r, RuntimeError) and "injected" in str(r) for r in results), results
        await wait_idle(llm)
        return await collect(llm, PROMPTS[2], SamplingParams(temperature=0, max_tokens=8))

    assert asyncio.run(main())[-1].outputs[0].token_ids == hf_greedy(tiny_models["qwen2"], PROMPTS[2:], 8)[0]
    llm.shutdown()


def test_an_idle_engine_sleeps_and_shutdown_ends_waiting_requests(tiny_models):
    llm = AsyncLLM(tiny_models["qwen3"], **OPTIONS)

    def cpu_ticks() -> int:  # user + system time of the engine thread (Linux)
        with open(f"/proc/self/task/{llm.thread.native_id}/stat") as f:
            return sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13])

    before = cpu_ticks()
    time.sleep(0.5)
    assert cpu_ticks() == before
    # The busy loop froze the heap as it started, as LLM.generate does (vLLM, after its engine's start-up).
    assert gc.get_freeze_count() > 10_000

    async def main():
        outputs = []
        with pytest.raises(RuntimeError, match="shut down"):
            async for out in llm.generate(PROMPTS[0], LONG):
                outputs.append(out)
                if len(outputs) == 2:
                    llm.shutdown()
        assert not llm.thread.is_alive()

    asyncio.run(main())
    assert gc.get_freeze_count() == 0  # and unfroze it as it ended
