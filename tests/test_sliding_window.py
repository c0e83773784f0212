"""Sliding-window attention (nanoserve/sliding_window/, the windows in models/qwen3.py and layers/): greedy output
equals transformers on a tiny Mistral (every layer windowed) and windowed Qwen2s (every layer, and one layer of
two) with prompts and outputs longer than the window, in blocks of 16, on every CPU backend and under every
scheduler option; the blocks behind the window go back to the pool; the bad windows."""
import json
import shutil

import pytest
import torch
from test_beam_search import hf_beam_search
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

from conftest import COMMON, Listener, hf_greedy, random_prompts
from nanoserve import LLM, BeamSearchParams, SamplingParams
from nanoserve.config import sliding_windows
from nanoserve.sliding_window import NULL_BLOCK, SlidingWindowBlockManager

BLOCK_SIZE = 16
MAX_TOKENS = 48
NO_EOS = {**COMMON, "eos_token_id": None}  # every output runs to max_tokens, in transformers too
CONFIGS = {  # windows of 20 (ends mid-block), 32 (on a block's edge) and 24
    "mistral": lambda: MistralConfig(**NO_EOS, sliding_window=20, tie_word_embeddings=False),
    "qwen2": lambda: Qwen2Config(**NO_EOS, use_sliding_window=True, sliding_window=32, max_window_layers=0),
    "qwen2_hybrid": lambda: Qwen2Config(**NO_EOS, use_sliding_window=True, sliding_window=24, max_window_layers=1),
}
PROMPTS = random_prompts(8, seed=11, low=10, high=60)  # 11 to 57 tokens: from shorter than the window to 3 windows
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def save_model(path, config) -> str:
    torch.manual_seed(0)
    config.initializer_range = 0.2  # sharp logits, as conftest.make_model's
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sliding_window")
    return {name: save_model(root / name, config()) for name, config in CONFIGS.items()}


@pytest.fixture(scope="module")
def expected(models) -> dict[str, list[list[int]]]:
    return {name: hf_greedy(path, PROMPTS, MAX_TOKENS) for name, path in models.items()}


def completions(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_the_window_changes_transformers_output(models, expected, tmp_path):
    """Without its window, the same weights answer otherwise: the equality tests below can fail."""
    full = shutil.copytree(models["mistral"], tmp_path / "full")
    config = json.loads((full / "config.json").read_text())
    (full / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    assert hf_greedy(str(full), PROMPTS, MAX_TOKENS) != expected["mistral"]


def test_each_layer_reads_its_window(models):
    """transformers 5's layer_types: Mistral windows every layer; Qwen2 those from max_window_layers on."""
    windows = {name: sliding_windows(AutoModelForCausalLM.from_pretrained(path).config)
               for name, path in models.items()}
    assert windows == {"mistral": [20, 20], "qwen2": [32, 32], "qwen2_hybrid": [0, 24]}
    for name, path in models.items():
        llm = LLM(path, block_size=BLOCK_SIZE, num_kvcache_blocks=64)
        assert [layer.sliding_window for layer in llm.engine.model_runner.attn_layers] == windows[name]
        # Blocks are freed only where no layer reads the whole context (the hybrid keeps the core's manager).
        assert isinstance(llm.engine.block_manager, SlidingWindowBlockManager) == (name != "qwen2_hybrid")


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_equals_transformers(models, expected, name, backend):
    num = 2 if backend == "triton" else len(PROMPTS)  # (Triton's interpreter is slow: the two longest prompts)
    prompts = sorted(PROMPTS, key=len)[-num:] if backend == "triton" else PROMPTS
    llm = LLM(models[name], block_size=BLOCK_SIZE, num_kvcache_blocks=128, attention_backend=backend)
    want = [expected[name][PROMPTS.index(p)] for p in prompts]
    assert completions(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    if name != "qwen2_hybrid":
        assert bm.num_freed_behind_window > 0


# Each scheduler option, in a pool small enough for some to preempt. Chunks of 24 tokens cross the window's edge.
SETTINGS = {
    "chunked": dict(enable_chunked_prefill=True, max_num_batched_tokens=24),
    "recompute": dict(num_kvcache_blocks=8),
    "swap": dict(num_kvcache_blocks=8, preemption_mode="swap"),
    "chunked_swap": dict(num_kvcache_blocks=8, enable_chunked_prefill=True, max_num_batched_tokens=24,
                         preemption_mode="swap"),
    "async": dict(async_scheduling=True),
    "async_recompute": dict(async_scheduling=True, num_kvcache_blocks=8),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_scheduler_options_equal_transformers(models, expected, name, setting):
    options = {"num_kvcache_blocks": 64, **SETTINGS[setting]}
    llm = LLM(models[name], block_size=BLOCK_SIZE, **options)
    assert completions(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected[name]
    if "num_kvcache_blocks" in SETTINGS[setting]:
        assert llm.stats.num_preemptions > 0
    if setting.endswith("swap"):
        assert llm.stats.num_swapped_out > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_prefix_hits_follow_the_window(models, name):
    """A second run of prompts that share a 60-token prefix: hits, and the same tokens as transformers."""
    shared = random_prompts(1, seed=12, low=60, high=61)[0]
    prompts = [shared + p for p in random_prompts(3, seed=13, low=5, high=30)]
    want = hf_greedy(models[name], prompts, MAX_TOKENS)
    llm = LLM(models[name], block_size=BLOCK_SIZE, num_kvcache_blocks=64)
    for _ in range(2):
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert completions(outputs) == want
    assert all(o.num_cached_tokens >= 48 for o in outputs)


@pytest.mark.parametrize("name", ["mistral", "qwen2_hybrid"])
def test_n_beams_and_ngram_speculation_equal_transformers(models, expected, name):
    llm = LLM(models[name], block_size=BLOCK_SIZE, num_kvcache_blocks=64, enable_beam_search=True)
    outputs = llm.generate(PROMPTS[:3], SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[e, e] for e in expected[name][:3]]
    hf = AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.float32).eval()
    params = BeamSearchParams(beam_width=3, max_tokens=30, ignore_eos=True)
    for prompt, output in zip(PROMPTS[:2], llm.beam_search(PROMPTS[:2], params, use_tqdm=False)):
        assert [c.token_ids for c in output.outputs] == hf_beam_search(hf, prompt, params, [])[0]
    spec = LLM(models[name], block_size=BLOCK_SIZE, num_kvcache_blocks=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    assert completions(spec.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected[name]
    assert spec.engine.scheduler.stats.spec_decoding.num_draft_tokens > 0
    for engine in (llm.engine, spec.engine):
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_long_sequence_holds_at_most_its_window(tmp_path):
    """2,000 tokens, a window of 128, blocks of 16: never more than ceil(128 / 16) + 1 = 9 blocks once the prompt
    is computed (125 without the window), the rest freed behind it; the null block in their place."""
    path = save_model(tmp_path / "m", MistralConfig(**{**NO_EOS, "max_position_embeddings": 2048}, sliding_window=128,
                                                    tie_word_embeddings=False))
    # (A request must still fit the pool whole: preempted to recompute, it prefills its whole context again.)
    llm = LLM(path, block_size=BLOCK_SIZE, num_kvcache_blocks=130, max_model_len=2048, step_records=True)
    held = []

    def observe(record):  # after each step
        for seq in llm.engine.scheduler.running:
            held.append((len(seq), sum(b != NULL_BLOCK for b in seq.block_table), list(seq.block_table)))

    llm.engine.step_recorder.listeners.append(Listener(observe))
    llm.generate([list(range(3, 40))], SamplingParams(temperature=0, max_tokens=2000 - 37, ignore_eos=True),
                 use_tqdm=False)
    assert held[-1][0] == 1999 and max(n for _, n, _ in held) == 9
    assert held[-1][2][:110] == [NULL_BLOCK] * 110  # 125 blocks in its table, 9 of them held at most
    bm = llm.engine.block_manager
    assert bm.num_freed_behind_window >= 125 - 9 and bm.num_free_blocks == bm.num_blocks == 129


def test_disable_sliding_window_caps_the_context(models, expected):
    """vLLM's flag: full attention, and no sequence longer than the window (where full attention is the same)."""
    llm = LLM(models["qwen2"], block_size=BLOCK_SIZE, num_kvcache_blocks=64, disable_sliding_window=True)
    assert llm.engine.config.max_model_len == 32
    assert [layer.sliding_window for layer in llm.engine.model_runner.attn_layers] == [0, 0]
    assert type(llm.engine.block_manager) is not SlidingWindowBlockManager
    short = [p[:20] for p in PROMPTS]
    assert completions(llm.generate(short, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                    use_tqdm=False)) == hf_greedy(models["qwen2"], short, 12)
    with pytest.raises(ValueError, match=r"exceeds max_model_len \(32\)"):
        llm.generate([list(range(3, 33))], SamplingParams(max_tokens=3), use_tqdm=False)


@pytest.mark.parametrize("window", [0, -4])
def test_a_bad_window_is_refused(models, tmp_path, window):
    path = shutil.copytree(models["mistral"], tmp_path / "bad")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "sliding_window": window}))
    with pytest.raises(ValueError, match=r"sliding_window .*must be an integer >= 1"):
        LLM(str(path), num_kvcache_blocks=16)


def test_the_host_tier_is_refused_with_a_window(models):
    with pytest.raises(ValueError, match="kv_offloading_size"):
        LLM(models["mistral"], num_kvcache_blocks=16, kv_offloading_size=0.01)


def test_the_trace_shows_the_blocks_freed_behind_the_window(models):
    from nanoserve.tools.step_table import format_trace

    llm = LLM(models["mistral"], block_size=BLOCK_SIZE, num_kvcache_blocks=64, trace=True)
    llm.generate([max(PROMPTS, key=len)], GREEDY, use_tqdm=False)
    totals = [0] + [rec.num_freed_behind_window for rec in llm.trace]
    assert totals[-1] == llm.engine.block_manager.num_freed_behind_window > 0
    steps = [after - before for before, after in zip(totals, totals[1:]) if after > before]
    lines = [line for line in format_trace(llm.trace).splitlines() if "freed behind window" in line]
    assert [int(line.split(" freed behind window")[0].split()[-1]) for line in lines] == steps


def test_disaggregated_prefill_is_refused_with_a_window(models):
    with pytest.raises(ValueError, match="kv_transfer_config"):
        LLM(models["mistral"], num_kvcache_blocks=16,
            kv_transfer_config={"kv_connector": "P2pConnector", "kv_role": "kv_producer"})


def test_prompt_logprobs_compute_the_whole_prompt_with_a_window(models):
    """The logprobs chapter's rule joins the window's block manager (nanoserve/chapters.py's
    ChaptersWindowBlockManager): a prompt_logprobs request takes no prefix hit, and every prompt
    token after the first is scored."""
    from nanoserve.logprobs import LogprobsBlockManager

    llm = LLM(models["mistral"], block_size=BLOCK_SIZE, num_kvcache_blocks=64, max_logprobs=1)
    block_manager = llm.engine.block_manager
    assert isinstance(block_manager, SlidingWindowBlockManager)
    assert isinstance(block_manager, LogprobsBlockManager)
    prompt = random_prompts(1, seed=12, low=60, high=61)[0]
    (cached,) = [llm.generate([prompt], GREEDY, use_tqdm=False) for _ in range(2)][1]
    assert cached.num_cached_tokens >= 48  # the prompt's blocks are in the cache
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert out.num_cached_tokens == 0 and out.prompt_logprobs[0] is None
    assert all(t in d for d, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True))
