"""Tensor parallelism on CPU: 2 processes over gloo give the tokens of one process and of transformers.

One tensor-parallel LLM per model (each start spawns a worker): heads that split evenly for the three
architectures, and 4 heads sharing 1 KV head, which every rank must replicate.
"""
import gc
import math
import multiprocessing
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from conftest import ARCHS, assert_killed_worker_fails_fast, hf_greedy, make_model, random_prompts
from nanoserve import LLM, SamplingParams
from nanoserve.parallel.executor import parameter_shapes

N = 2
GREEDY = SamplingParams(temperature=0, max_tokens=24)
OPTIONS = dict(block_size=8, num_kvcache_blocks=20)  # 160 token slots: the 8 plain prompts cannot run together
CASES = [*ARCHS, "llama-1kv"]


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory) -> dict[str, str]:
    path = tmp_path_factory.mktemp("tp") / "llama-1kv"
    return {**tiny_models, "llama-1kv": make_model(path, "llama", num_key_value_heads=1)}


def generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], [o.num_cached_tokens for o in outputs]


def no_process_left(procs: list) -> bool:
    return not any(p.is_alive() for p in procs) and not multiprocessing.active_children() and not dist.is_initialized()


def frozen_objects(runner) -> list[int] | None:
    """Every rank's count of objects the garbage collector leaves frozen, gathered on rank 0 (run on each rank)."""
    counts = [0] * N if runner.rank == 0 else None
    dist.gather_object(gc.get_freeze_count(), counts, dst=0)
    return counts


@pytest.mark.parametrize("case", CASES)
def test_tensor_parallel_equals_one_process_and_transformers(models, case):
    path = models[case]
    plain = random_prompts(8, seed=1)
    shared = [random_prompts(1, seed=2, low=20, high=21)[0] + p for p in random_prompts(6, seed=3, low=1, high=30)]
    one = LLM(path, **OPTIONS)
    expected = [generate(one, plain)[0], generate(one, shared)[0]]
    full_shapes = {name: tuple(p.shape) for name, p in one.engine.model_runner.model.named_parameters()}
    del one

    num_threads = torch.get_num_threads()
    llm = LLM(path, tensor_parallel_size=N, **OPTIONS)
    assert generate(llm, plain)[0] == expected[0] == hf_greedy(path, plain, GREEDY.max_tokens)
    assert llm.stats.num_preemptions > 0
    assert generate(llm, shared)[0] == expected[1] == hf_greedy(path, shared, GREEDY.max_tokens)
    tokens, num_cached = generate(llm, shared)  # the prompts again: now from the prefix cache
    assert tokens == expected[1] and all(n > 0 for n in num_cached)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks

    # Each rank holds 1/N of every split weight (the worker reports its own); q/k/v splits by heads,
    # with a lone KV head whole on every rank.
    config = llm.engine.config.hf_config
    q_heads, kv_heads = config.num_attention_heads // N, max(1, config.num_key_value_heads // N)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shapes = llm.engine.executor.call("apply", parameter_shapes)
    assert len(shapes) == N
    # A worker froze its heap once its part of the model was built (it lives until the process ends, as vLLM's)
    assert llm.engine.executor.call("apply", frozen_objects)[1] > 10_000
    for rank_shapes in shapes:
        assert rank_shapes.keys() == full_shapes.keys()
        for name, full in full_shapes.items():
            shape = rank_shapes[name]
            if "norm" in name:
                assert shape == full, name
            elif "qkv_proj" in name:
                assert shape == ((q_heads + 2 * kv_heads) * head_dim, *full[1:]), name
            else:
                assert math.prod(shape) * N == math.prod(full) and len(shape) == len(full), name

    with pytest.raises(ValueError, match="max_tokens"):  # a bad request: refused, the engine stays usable
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=0), use_tqdm=False)
    assert generate(llm, plain[:2])[0] == expected[0][:2]
    procs = llm.engine.executor.procs
    del llm
    assert no_process_left(procs) and torch.get_num_threads() == num_threads


@pytest.mark.parametrize("arch, vocab_size", [("qwen2", 513), ("llama", 511)])  # its own LM head, a tied one
def test_a_vocabulary_that_does_not_split_evenly_is_padded(tmp_path, arch, vocab_size):
    """Each rank holds ceil(V / N) rows, the last rank's extra row padding: never looked up, sampled or scored."""
    path = make_model(tmp_path / arch, arch, vocab_size=vocab_size)
    prompts = random_prompts(4, seed=4, vocab=vocab_size)
    prompts[0].append(vocab_size - 1)  # the last token: the last real row of the last rank
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    one = LLM(path, **OPTIONS)
    assert generate(one, prompts)[0] == expected
    del one

    llm = LLM(path, tensor_parallel_size=N, max_logprobs=vocab_size, **OPTIONS)
    assert generate(llm, prompts)[0] == expected
    shapes = llm.engine.executor.call("apply", parameter_shapes)
    assert [rank["lm_head.weight"][0] for rank in shapes] == [(vocab_size + 1) // 2] * N
    # Logprobs of every token: the distribution is over the real vocabulary, no padding id in it.
    params = SamplingParams(temperature=1.0, max_tokens=4, logprobs=vocab_size, seed=0)
    output = llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0]
    for logprobs in output.logprobs:
        assert sorted(logprobs) == list(range(vocab_size))
        assert math.isclose(sum(math.exp(lp.logprob) for lp in logprobs.values()), 1, rel_tol=1e-4)
    procs = llm.engine.executor.procs
    del llm
    assert no_process_left(procs)


def test_swap_preemption_then_a_killed_worker_raises_a_clear_error_at_once(models):
    llm = LLM(models["qwen3"], tensor_parallel_size=N, preemption_mode="swap", **OPTIONS)
    prompts = random_prompts(8, seed=1)
    assert generate(llm, prompts)[0] == hf_greedy(models["qwen3"], prompts, GREEDY.max_tokens)
    assert llm.stats.num_swapped_out > 0  # every rank copied its own slice of the blocks out and back

    # The worker has got the step when it dies, and rank 0 waits in the forward's first collective.
    worker = assert_killed_worker_fails_fast(llm, random_prompts(4), GREEDY)
    assert no_process_left([worker])


def test_failed_start_and_interpreter_exit_leave_no_process(models, tmp_path):
    with pytest.raises(ValueError, match="KV cache is too small"):  # raised on every rank, after the spawn
        LLM(models["qwen3"], tensor_parallel_size=N, cpu_kvcache_space=1e-9)
    assert no_process_left([])
    # A script that dies of an exception with a live tensor-parallel LLM: its worker exits with it.
    script = (f"from nanoserve import LLM\nllm = LLM({models['qwen3']!r}, tensor_parallel_size={N}, "
              "num_kvcache_blocks=64)\n"
              "print(llm.engine.executor.procs[0].pid, flush=True)\nraise SystemExit('boom')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 1 and "boom" in done.stderr
    pid = int(done.stdout.split()[-1])
    deadline = time.perf_counter() + 30  # (at once when idle: a bound only a hang breaks, not a busy machine)
    while time.perf_counter() < deadline and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}")



def test_a_start_that_fails_after_init_process_group_leaves_the_process_to_the_next_llm(models, monkeypatch):
    """A failure once the group is up (here injected where a config error or a gloo timeout would strike) ends the
    worker and leaves the process group at once, not when the garbage collector gets to the half-built engine: the
    exception's traceback keeps it alive (a notebook, pytest), and the next LLM used to fail with "torch.distributed
    is already initialized"."""
    from nanoserve.parallel import executor

    def fail(*args):
        raise RuntimeError("injected after init_process_group")

    monkeypatch.setattr(executor, "init_stage_groups", fail)  # rank 0's only: the worker is another process
    with pytest.raises(RuntimeError, match="injected after init_process_group") as failed:
        LLM(models["qwen3"], tensor_parallel_size=N, **OPTIONS)
    monkeypatch.undo()
    assert failed.traceback and no_process_left([])  # (the traceback, and the executor in it, still alive)
    prompts = random_prompts(3, seed=5)
    llm = LLM(models["qwen3"], **OPTIONS)
    assert generate(llm, prompts)[0] == hf_greedy(models["qwen3"], prompts, GREEDY.max_tokens)


def test_a_failed_step_ends_the_workers_and_the_group_and_the_next_llm_works(models):
    """An exception inside generate on rank 0 (the worker then waits in a collective that never completes): the
    engine ends its worker and leaves the group, says so on the next call, and a new LLM works beside it."""
    llm = LLM(models["qwen3"], tensor_parallel_size=N, **OPTIONS)
    runner, procs = llm.engine.model_runner, llm.engine.executor.procs
    run_model, calls = runner.run_model, []

    def fail_on_the_second_step(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected in a step")
        return run_model(*args)

    runner.run_model = fail_on_the_second_step
    with pytest.raises(RuntimeError, match="injected in a step"):
        llm.generate(random_prompts(2), GREEDY, use_tqdm=False)
    assert no_process_left(procs)
    with pytest.raises(RuntimeError, match=r"a step failed \(RuntimeError: injected in a step\): this LLM cannot"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    prompts = random_prompts(3, seed=6)
    one = LLM(models["llama"], **OPTIONS)  # while the failed one lives on
    assert generate(one, prompts)[0] == hf_greedy(models["llama"], prompts, GREEDY.max_tokens)


def test_bad_sizes_raise_before_any_process_starts(models, monkeypatch):
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) must divide num_attention_heads \(4\)"):
        LLM(models["qwen3"], tensor_parallel_size=3)
    path = make_model(models["qwen3"] + "-3kv", "qwen3", num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"\(2\) and num_key_value_heads \(3\) must divide one another"):
        LLM(path, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(models["qwen3"], tensor_parallel_size=0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) exceeds the 1 CUDA devices"):
        LLM(models["qwen3"], tensor_parallel_size=2, device="cuda")
    assert not multiprocessing.active_children()
