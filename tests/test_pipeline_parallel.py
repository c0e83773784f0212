"""Pipeline parallelism on CPU: 2 stages (and 2 stages x 2 tensor-parallel ranks) over gloo give the tokens of
one process and of transformers, each rank holding only its stage's layers."""
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from threading import Event, Lock, Thread

import pytest
import torch
import torch.distributed as dist

from conftest import ARCHS, assert_killed_worker_fails_fast, hf_greedy, make_model, random_prompts
from nanoserve import LLM, SamplingParams
from nanoserve.parallel.executor import MultiprocExecutor, parameter_shapes
from nanoserve.parallel.pipeline import stage_layers
from nanoserve.scheduling.async_scheduling import BatchQueueEngineCore

GREEDY = SamplingParams(temperature=0, max_tokens=24)
OPTIONS = dict(block_size=8, num_kvcache_blocks=20)  # 160 token slots: the 8 plain prompts cannot run together


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory) -> dict[str, str]:
    """The three tiny architectures, Qwen2 with 3 layers: stages of 1 and 2 layers."""
    path = tmp_path_factory.mktemp("pp") / "qwen2-3"
    return {**tiny_models, "qwen2": make_model(path, "qwen2", num_hidden_layers=3, layer_types=["full_attention"] * 3)}


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[list[int]]]:
    shared_prefix = random_prompts(1, seed=2, low=20, high=21)[0]
    return {"plain": random_prompts(8, seed=1),
            "shared": [shared_prefix + p for p in random_prompts(6, seed=3, low=1, high=30)]}


@pytest.fixture(scope="module")
def names(models) -> dict[str, set[str]]:
    """Every parameter of each model, a tied LM head included (one rank lists it once, as the embedding)."""
    return {arch: {n for n, _ in LLM(models[arch], **OPTIONS).engine.model_runner.model.named_parameters()}
            | {"lm_head.weight"} for arch in ARCHS}


@pytest.fixture(scope="module")
def expected(models, prompts) -> dict[str, dict[str, list[list[int]]]]:
    """transformers' greedy tokens, which one nanoserve rank gives too (checked once per model here)."""
    result = {}
    for arch in ARCHS:
        result[arch] = {kind: hf_greedy(models[arch], p, GREEDY.max_tokens) for kind, p in prompts.items()}
        one = LLM(models[arch], **OPTIONS)
        assert {kind: generate(one, p)[0] for kind, p in prompts.items()} == result[arch]
        del one
    return result


def generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], [o.num_cached_tokens for o in outputs]


def on_stage(name: str, num_layers: int, stage: int, num_stages: int) -> bool:
    """Whether a rank of `stage` holds parameter `name`: its layers, the embedding on the first, the final norm
    and the LM head (a tied one as a copy of the embedding) on the last."""
    start, end = stage_layers(num_layers, stage, num_stages)
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    if layer:
        return start <= int(layer[1]) < end
    return stage == 0 if name.startswith("model.embed_tokens.") else stage == num_stages - 1


# (arch, tensor_parallel_size, async_scheduling): one step at a time, or one batch in flight per stage.
CASES = [(arch, tp, False) for arch in ARCHS for tp in (1, 2)] + [(arch, 1, True) for arch in ARCHS] + \
    [("qwen3", 2, True)]


@pytest.mark.parametrize("arch, tp, in_flight", CASES)
def test_pipeline_stages_equal_one_process_and_transformers(models, prompts, expected, names, arch, tp, in_flight):
    llm = LLM(models[arch], pipeline_parallel_size=2, tensor_parallel_size=tp, async_scheduling=in_flight, **OPTIONS)
    assert generate(llm, prompts["plain"])[0] == expected[arch]["plain"]
    assert llm.stats.num_preemptions > 0
    assert generate(llm, prompts["shared"])[0] == expected[arch]["shared"]
    tokens, num_cached = generate(llm, prompts["shared"])  # the prompts again: now from the prefix cache
    assert tokens == expected[arch]["shared"] and all(n > 0 for n in num_cached)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks

    # Rank r is stage r // tp, and holds that stage's layers only (the KV cache too: one slot per own layer).
    num_layers = llm.engine.config.hf_config.num_hidden_layers
    shapes = llm.engine.executor.call("apply", parameter_shapes)
    assert len(shapes) == 2 * tp
    for rank, rank_shapes in enumerate(shapes):
        assert set(rank_shapes) == {n for n in names[arch] if on_stage(n, num_layers, rank // tp, 2)}, rank
    assert len(llm.engine.model_runner.attn_layers) == stage_layers(num_layers, 0, 2)[1]
    procs = llm.engine.executor.procs
    del llm
    assert not any(p.is_alive() for p in procs) and not multiprocessing.active_children()
    assert not dist.is_initialized()


def test_stage_layers_split_contiguously():
    assert [stage_layers(2, s, 2) for s in range(2)] == [(0, 1), (1, 2)]
    assert [stage_layers(3, s, 2) for s in range(2)] == [(0, 1), (1, 3)]
    assert [stage_layers(7, s, 3) for s in range(3)] == [(0, 2), (2, 4), (4, 7)]


def test_bad_pipeline_sizes_raise_before_any_process_starts(models, monkeypatch):
    for bad, message in [(0, "must be >= 1, got 0"), (-1, "must be >= 1, got -1"), (True, "must be an integer"),
                         (1.5, "must be an integer"), ("2", "must be an integer")]:
        with pytest.raises(ValueError, match=f"pipeline_parallel_size {message}"):
            LLM(models["qwen3"], pipeline_parallel_size=bad)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(3\) exceeds the model's 2 layers"):
        LLM(models["qwen3"], pipeline_parallel_size=3)
    with monkeypatch.context() as env:  # under torchrun: the ranks it started must be P x T
        for name, value in dict(RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
            env.setenv(name, value)
        with pytest.raises(ValueError, match=r"torchrun started WORLD_SIZE=3 processes, but pipeline_parallel_size x "
                                             r"tensor_parallel_size is 2 x 1"):
            LLM(models["qwen3"], pipeline_parallel_size=2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size x tensor_parallel_size \(2 x 2\) exceeds the 2 CUDA"):
        LLM(models["qwen3"], pipeline_parallel_size=2, tensor_parallel_size=2, device="cuda")
    assert not multiprocessing.active_children() and not dist.is_initialized()


@pytest.mark.parametrize("num_stages", [2, 3])
def test_one_batch_in_flight_per_stage_and_no_request_in_two(models, prompts, expected, num_stages, monkeypatch):
    """async_scheduling with P stages: the batch queue fills up to P steps, each with requests to work on (a step
    admits 1/P of them), and a request whose token is still in flight sits the next steps out, so the batches in
    flight never share a sequence."""
    seen, submit = [], BatchQueueEngineCore._submit

    def record(engine: BatchQueueEngineCore, out, inputs):  # what is in flight as each step starts
        seen.append([{s.seq_id for s in o.seqs} for o, _ in engine.batch_queue] + [{s.seq_id for s in out.seqs}])
        return submit(engine, out, inputs)

    monkeypatch.setattr(BatchQueueEngineCore, "_submit", record)
    llm = LLM(models["qwen2"], pipeline_parallel_size=num_stages, async_scheduling=True, **OPTIONS)
    assert generate(llm, prompts["plain"])[0] == expected["qwen2"]["plain"]
    assert max(sum(1 for batch in in_flight if batch) for in_flight in seen) == num_stages  # all busy at once
    for in_flight in seen:
        assert sum(map(len, in_flight)) == len(set().union(*in_flight)), in_flight
    del llm
    assert not multiprocessing.active_children() and not dist.is_initialized()


def test_sigterm_leaves_no_worker(models, tmp_path):
    """A script with a 2-stage LLM killed by SIGTERM (no finalizers run): its worker sees the pipe close, exits."""
    script = (f"import time\nfrom nanoserve import LLM\nllm = LLM({models['qwen3']!r}, pipeline_parallel_size=2, "
              "num_kvcache_blocks=64)\n"
              "print('worker', llm.engine.executor.procs[0].pid, flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        # (after what else it says: on a fresh cache, that it compiles the CPU kernels)
        worker = int(next(line for line in proc.stdout if line.startswith("worker ")).split()[1])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        proc.kill()
    deadline = time.monotonic() + 30  # (at once when idle: a bound only a hang breaks, not a busy machine)
    while time.monotonic() < deadline and os.path.exists(f"/proc/{worker}"):
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{worker}")


@pytest.mark.parametrize("in_flight", [False, True])
def test_a_killed_stage_raises_a_clear_error_at_once(models, in_flight):
    llm = LLM(models["qwen3"], pipeline_parallel_size=2, async_scheduling=in_flight, **OPTIONS)
    # The last stage has got the step when its worker dies: rank 0 waits for its logits.
    worker = assert_killed_worker_fails_fast(llm, random_prompts(4), GREEDY)
    assert not worker.is_alive()


def test_two_threads_that_see_one_dead_worker_both_read_its_exit_code(monkeypatch):
    """Pipeline stages: the launch thread and the logits thread may both find a killed worker. The one that reaps it
    holds MultiprocExecutor.reaping meanwhile, so the other reads the exit code instead of None (its waitpid would
    get ECHILD). The first reap is held open here while the second thread asks."""
    proc = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    proc.start()
    os.kill(proc.pid, signal.SIGKILL)
    executor = object.__new__(MultiprocExecutor)  # only what dead_workers reads: the workers and the lock
    executor.procs, executor.reaping = [proc], Lock()
    reaped, release, waitpid = Event(), Event(), os.waitpid

    def slow_waitpid(pid, options):  # the first reap pauses after the child is gone, before its code is kept
        result = waitpid(pid, options)
        if result[0] == pid and not reaped.is_set():
            reaped.set()
            release.wait(5)
        return result

    monkeypatch.setattr(os, "waitpid", slow_waitpid)
    said = []
    first = Thread(target=lambda: said.append(executor.dead_workers(timeout=5)))
    first.start()
    assert reaped.wait(5)
    second = Thread(target=lambda: said.append(executor.dead_workers(timeout=5)))
    second.start()
    second.join(0.5)  # without the lock it would be done by now, having read None
    release.set()
    for thread in (first, second):
        thread.join(5)
    assert said == [f"worker rank 1 (pid {proc.pid}) exited with code -9"] * 2
