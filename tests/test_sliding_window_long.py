"""Sliding windows that pay (nanoserve/sliding_window/block_manager.py): a request is admitted by its window, not
its length; a prompt, or a context recomputed after a preemption, gets its blocks chunk by chunk; a request that
can never fit is refused when added, and the engine serves the others. Greedy output equals transformers
(float32) on tiny Mistrals whose requests are many times their pool."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from test_sliding_window import BLOCK_SIZE, NO_EOS, PROMPTS, completions, save_model
from transformers import MistralConfig

from conftest import hf_greedy, random_prompts
from nanoserve import LLM, SamplingParams
from nanoserve.sliding_window import NULL_BLOCK
from nanoserve.utils.math import cdiv


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[int, str]:
    """Window 24 (positions up to 1,024) and window 128 (up to 4,096), every layer windowed."""
    root = tmp_path_factory.mktemp("long_window")
    return {window: save_model(root / str(window), MistralConfig(
        **{**NO_EOS, "max_position_embeddings": max_len}, sliding_window=window, tie_word_embeddings=False))
        for window, max_len in ((24, 1024), (128, 4096))}


def record_peaks(llm: LLM) -> list[int]:
    """The most blocks one sequence holds right after each step is planned (its chunk's blocks taken, nothing
    freed yet), over the steps that come."""
    scheduler, peaks = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def planned():
        out = schedule()
        peaks.append(max((sum(b != NULL_BLOCK for b in seq.block_table) for seq in scheduler.running), default=0))
        return out

    scheduler.schedule = planned
    return peaks


@pytest.mark.parametrize("prompt_len, options", [(40, {}), (200, dict(async_scheduling=True))], ids=["sync", "async"])
def test_a_request_longer_than_the_pool_runs_by_its_window(models, prompt_len, options):
    """Window 24, blocks of 16, 8 blocks (7 and the null block): 40 prompt tokens + 600 would take 40 blocks
    whole, but with chunks of at most 64 tokens a sequence holds cdiv(23 + 64, 16) + 1 = 7 at most. Async: a
    200-token prompt in chunks, each planned while the one before runs (the blocks that one left behind the
    window count as free: else the sequence, alone in its pool, would preempt itself again and again)."""
    prompt = random_prompts(1, seed=5, low=prompt_len, high=prompt_len + 1)[0]
    llm = LLM(models[24], block_size=BLOCK_SIZE, num_kvcache_blocks=8, enable_chunked_prefill=True,
              max_num_batched_tokens=64, **options)
    peaks = record_peaks(llm)
    max_tokens = 640 - prompt_len
    outputs = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    assert completions(outputs) == hf_greedy(models[24], [prompt], max_tokens)
    assert max(peaks) <= 7 and llm.stats.num_preemptions == 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks == 7


def test_a_request_that_never_fits_is_refused_at_once(models):
    """The same request with the default budget (16,384 tokens: a recomputed context is prefilled whole) could
    need 41 blocks at once: a ValueError at add_request naming the window, the chunk and the pool; the engine
    serves the next requests as if it had never come."""
    llm = LLM(models[24], block_size=BLOCK_SIZE, num_kvcache_blocks=8)
    with pytest.raises(ValueError, match=r"sliding_window 24 and prefill chunks of up to 16384 tokens "
                                         r"\(max_num_batched_tokens\).* up to 41 KV blocks .*the pool has 7") as error:
        llm.engine.add_request("long", list(range(3, 43)), SamplingParams(max_tokens=600))
    bm = llm.engine.block_manager  # (its reason, for the dashboard)
    assert not llm.engine.requests and list(bm.refused) == [str(error.value)] and bm.num_refused == 1
    short = [p[:20] for p in PROMPTS[:3]]
    outputs = llm.generate(short, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert completions(outputs) == hf_greedy(models[24], short, 24)


def test_a_long_prompt_is_prefilled_chunk_by_chunk(models):
    """4,000 prompt tokens, window 128, 64 tokens a step: 63 chunks, each taking its blocks as those behind the
    window go, so never more than cdiv(127 + 64, 16) + 1 = 13 blocks (250 whole) in a pool of 16."""
    prompt = random_prompts(1, seed=6, low=4000, high=4001)[0]
    llm = LLM(models[128], block_size=BLOCK_SIZE, num_kvcache_blocks=16, enable_chunked_prefill=True,
              max_num_batched_tokens=64, max_model_len=4096)
    peaks = record_peaks(llm)
    outputs = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    assert completions(outputs) == hf_greedy(models[128], [prompt], 64)
    assert llm.stats.num_chunked_prefills == 62 and max(peaks) <= cdiv(127 + 64, 16) + 1 == 13
    assert llm.engine.block_manager.num_freed_behind_window >= 250 - 13


def test_a_preempted_long_sequence_comes_back_in_the_same_chunks(models):
    """Two prompts of 1,500 tokens in a pool of 20 blocks (19): they cannot both prefill, so the newer is preempted
    to recompute, and prefills again chunk by chunk under the same bound; both equal transformers."""
    prompts = random_prompts(2, seed=7, low=1500, high=1501)
    llm = LLM(models[128], block_size=BLOCK_SIZE, num_kvcache_blocks=20, enable_chunked_prefill=True,
              max_num_batched_tokens=64, max_model_len=4096)
    peaks = record_peaks(llm)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert completions(outputs) == hf_greedy(models[128], prompts, 32)
    assert llm.stats.num_preemptions > 0 and max(peaks) <= 13
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_the_long_context_benchmark_serves_what_full_attention_refuses(tmp_path, capsys):
    """benchmarks/sliding_window.py --long at a small size: every request served within the window's bound, in
    a pool the same weights without the window are refused by at once."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "sliding_window.py"
    spec = importlib.util.spec_from_file_location("sliding_window_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--long", "--long-requests", "3", "--min-len", "300", "--max-len", "600", "--long-max-tokens", "8",
            "--long-window", "32", "--budget", "64", "--concurrent", "1"]
    sys_argv, sys.argv = sys.argv, ["sliding_window.py", *argv]
    try:
        bench.main()
    finally:
        sys.argv = sys_argv
    out = capsys.readouterr().out
    results = json.loads(out[out.index("{"):])
    window, full = results["window"], results["full attention"]
    bound = cdiv(32 - 1 + 64, BLOCK_SIZE) + 1
    assert window["sequences_served"] == 3 and window["bound_per_seq"] == bound == window["pool_blocks"]
    assert window["peak_blocks_per_seq"] <= bound and window["peak_pool_blocks"] <= bound
    assert "needs 20 KV blocks but num_kvcache_blocks is 8" in full["refused"]
