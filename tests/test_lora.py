"""LoRA adapters (nanoserve/lora/): greedy float32 output equals transformers with the adapter applied by peft,
token for token, with three random adapters and base-model requests in one batch, on the three architectures,
through preemption (recompute, swap), chunked prefill, async scheduling, priority, tensor and pipeline
parallelism, speculative decoding and the Triton kernel; the max_loras cap; the prefix cache keyed by adapter;
bad adapters refused with a ValueError naming what is wrong."""
import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from conftest import ARCHS, ROOMY_POOL, make_model
from nanoserve import LLM, AsyncLLM, LoRARequest, SamplingParams
from nanoserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from nanoserve.lora.layers import LoRALinear, LoRARows

# Three adapters: different ranks, targets, scalings (one rsLoRA); B drawn nonzero, so each changes the output.
ADAPTERS = {
    1: dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    2: dict(r=4, lora_alpha=8, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            use_rslora=True),
    3: dict(r=16, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]),
    4: dict(r=2, lora_alpha=4, target_modules=["up_proj", "o_proj"]),
}
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28], [40, 41],
           [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69], [70, 71, 72, 73, 74],
           [80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90], [100, 101, 102, 103]]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def make_adapter(model: str, folder: Path, seed: int, **options) -> str:
    torch.manual_seed(seed)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                                LoraConfig(lora_dropout=0.0, **options))
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero (no change): draw it, so the adapter matters
            torch.nn.init.normal_(param, std=0.5)
    peft_model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory) -> dict[str, dict[int, LoRARequest]]:
    """arch -> lora_int_id -> its LoRARequest, for the four adapters above on that architecture's tiny model."""
    root = tmp_path_factory.mktemp("adapters")

    class ByArch(dict):  # each architecture's adapters are made when a test first asks for them
        def __missing__(self, arch):
            self[arch] = {i: LoRARequest(f"{arch}-{i}", i, make_adapter(tiny_models[arch], root / f"{arch}-{i}", i,
                                                                         **opts)) for i, opts in ADAPTERS.items()}
            return self[arch]
    return ByArch()


@functools.cache
def peft_greedy(model: str, adapter: str | None, prompt: tuple[int, ...]) -> tuple[list[int], list[float]]:
    """transformers + peft's greedy tokens for one prompt, and each token's logprob (float32)."""
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    reference = (base if adapter is None else PeftModel.from_pretrained(base, adapter)).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, min_new_tokens=0, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, logprobs


def mixed(adapters: dict[int, LoRARequest]) -> list[LoRARequest | None]:
    """Adapters 1-3 and the base model, in turn, one per prompt."""
    return [[adapters[1], None, adapters[2], adapters[3]][i % 4] for i in range(len(PROMPTS))]


def assert_equal_to_peft(model: str, outputs, loras, logprobs: bool = False) -> None:
    for prompt, output, lora in zip(PROMPTS, outputs, loras):
        tokens, lps = peft_greedy(model, None if lora is None else lora.lora_path, tuple(prompt))
        assert output.outputs[0].token_ids == tokens, (lora, prompt)
        if logprobs:
            got = [d[t].logprob for d, t in zip(output.outputs[0].logprobs, tokens)]
            assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-4


SCHEDULES = {
    "default": dict(**ROOMY_POOL),
    "recompute": dict(num_kvcache_blocks=12, block_size=4, max_num_seqs=8),
    "swap": dict(num_kvcache_blocks=12, block_size=4, preemption_mode="swap", swap_space=0.01),
    "chunked": dict(**ROOMY_POOL, enable_chunked_prefill=True, max_num_batched_tokens=16, block_size=4),
    "async": dict(**ROOMY_POOL, async_scheduling=True),
    "priority": dict(num_kvcache_blocks=12, block_size=4, scheduling_policy="priority"),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_mixed_batch_equals_peft(tiny_models, adapters, arch, schedule):
    llm = LLM(tiny_models[arch], enable_lora=True, max_loras=3, **SCHEDULES[schedule])
    loras = mixed(adapters[arch])
    priority = [len(PROMPTS) - i for i in range(len(PROMPTS))] if schedule == "priority" else None  # last first
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=priority, lora_request=loras)
    assert_equal_to_peft(tiny_models[arch], outputs, loras)
    stats = llm.stats  # the schedule did what it is named for
    assert {"recompute": stats.num_preemptions, "swap": stats.num_swapped_out, "chunked": stats.num_chunked_prefills,
            "priority": stats.num_preemptions}.get(schedule, 1) > 0


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2),
                                      dict(pipeline_parallel_size=2, async_scheduling=True)],
                         ids=["tensor", "pipeline-async"])
def test_parallel_equals_peft(tiny_models, adapters, parallel):
    """Two gloo processes: with tensor parallelism each rank holds its share of every slot, with pipeline stages
    (and two batches in flight) its stage's layers' slots. max_loras=2 with three adapters in flight: the slots
    are reloaded between steps, on both ranks."""
    llm = LLM(tiny_models["qwen3"], enable_lora=True, max_loras=2, **parallel, **ROOMY_POOL)
    loras = mixed(adapters["qwen3"])
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
    assert_equal_to_peft(tiny_models["qwen3"], outputs, loras)
    worker = llm.engine.executor.procs[0]
    del llm  # no reference cycle through the LoRA manager: the worker stops at once
    assert not worker.is_alive()


def test_speculative_decoding_with_a_draft_model_equals_peft(tiny_models, adapters):
    """The draft model proposes without adapters (its layers are not LoRA's); the target verifies each row's
    drafts under the row's own adapter, so the tokens are the adapter's."""
    model = tiny_models["qwen3"]
    llm = LLM(model, enable_lora=True, max_loras=3, speculative_config={"model": model, "num_speculative_tokens": 2},
              **ROOMY_POOL)
    loras = mixed(adapters["qwen3"])
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
    assert_equal_to_peft(model, outputs, loras)
    assert llm.stats.spec_decoding.num_accepted_tokens > 0


def test_each_rank_holds_its_share_of_a_slot():
    """Two tensor-parallel ranks in one process (each layer told its rank; base weights zero, so a layer's output
    is its LoRA product): a column-parallel rank's output is its rows of the whole layer's, a lone KV head, which
    the ranks outnumber, whole on both; the partial products of a row-parallel layer's ranks sum to the whole's."""
    gen = torch.Generator().manual_seed(0)
    hidden, q, kv, r = 64, 64, 16, 4  # 4 query heads and 1 KV head of 16
    rows = LoRARows(5, 1, torch.device("cpu"), torch.float32)
    rows.slot_scaling[0] = 0.5
    rows.set(torch.zeros(5, dtype=torch.int64), "torch")  # 5 rows of the one slot

    def layer(base: torch.nn.Linear, rank: int, size: int, weights) -> LoRALinear:
        base.weight.data.zero_()
        base.tp_rank, base.tp_size = rank, size
        wrapped = LoRALinear(base, 1, r, rows)
        for part, (a, b) in enumerate(weights):
            wrapped.set_slot(0, part, a, b)
        return wrapped

    x = torch.randn(5, hidden, generator=gen)
    qkv = [(torch.randn(r, hidden, generator=gen), torch.randn(size, r, generator=gen)) for size in (q, kv)]
    whole = layer(MergedColumnParallelLinear(hidden, [q, kv]), 0, 1, qkv)(x)
    for rank in range(2):
        share = layer(MergedColumnParallelLinear(hidden, [q // 2, kv]), rank, 2, qkv)(x)
        torch.testing.assert_close(share, torch.cat([whole[:, rank * q // 2 : (rank + 1) * q // 2], whole[:, q:]], 1))
    o = [(torch.randn(r, q, generator=gen), torch.randn(hidden, r, generator=gen))]
    x = torch.randn(5, q, generator=gen)
    whole = layer(RowParallelLinear(q, hidden), 0, 1, o)(x)
    # (tp_size 1: no process group to all-reduce in; the sum below is the all-reduce)
    shares = [layer(RowParallelLinear(q // 2, hidden), rank, 1, o)(x[:, rank * q // 2 : (rank + 1) * q // 2])
              for rank in range(2)]
    torch.testing.assert_close(shares[0] + shares[1], whole)


def test_the_triton_kernel_in_the_engine_equals_peft(tiny_models, adapters, monkeypatch):
    """The Triton path (nanoserve/lora/triton_lora.py, CUDA's), here through Triton's interpreter: prefills with
    the rows grouped by slot, decode steps with the per-row kernel, adapters 1-3 and the base model in one batch.
    On a GPU natively, the decode steps replayed from CUDA graphs captured with LoRA on. The weights stay plain, as
    on a GPU (not reordered for oneDNN): A is stacked under them, and the base matmul computes h."""
    pytest.importorskip("triton")
    monkeypatch.setattr("nanoserve.layers.onednn.reorders_for_onednn", lambda dtype: False)
    llm = LLM(tiny_models["qwen2"], enable_lora=True, max_loras=3, dtype="float32", **ROOMY_POOL)
    llm.engine.model_runner.lora_slots.grouped = True  # (what LoRASlots picks on CUDA)
    graphs, replays = llm.engine.model_runner.cuda_graphs, []
    if graphs is not None:  # on a GPU
        replay = graphs.replay
        graphs.replay = lambda *args: replays.append(len(args[0])) or replay(*args)
    loras = mixed(adapters["qwen2"])[:4]
    outputs = llm.generate(PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False,
                           lora_request=loras)  # (4 tokens: the interpreter runs each program in Python)
    for prompt, output, lora in zip(PROMPTS, outputs, loras):
        tokens = peft_greedy(tiny_models["qwen2"], None if lora is None else lora.lora_path, tuple(prompt))[0]
        assert output.outputs[0].token_ids == tokens[:4], (lora, prompt)
    assert bool(replays) == torch.cuda.is_available()


def test_logprobs_and_a_single_adapter_for_all_prompts(tiny_models, adapters):
    llm = LLM(tiny_models["qwen3"], enable_lora=True, max_logprobs=1, **ROOMY_POOL)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1)
    lora = adapters["qwen3"][2]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lora)
    assert_equal_to_peft(tiny_models["qwen3"], outputs, [lora] * len(PROMPTS), logprobs=True)


def test_max_loras_slots(tiny_models, adapters):
    """max_loras=2 and four adapters in flight: every request finishes equal to peft, no step (nor the running
    batch) holds more than two adapters, the slots are reloaded between steps, and no block leaks."""
    llm = LLM(tiny_models["llama"], enable_lora=True, max_loras=2, max_cpu_loras=3, **ROOMY_POOL)
    engine = llm.engine
    manager, schedule, per_step = engine.lora_manager, engine.scheduler.schedule, []

    def adapter_ids(seqs) -> set[int]:
        return {lora.lora_int_id for s in seqs if (lora := manager.lora_request(s)) is not None}

    def recorded_schedule():  # each step's adapters, and the running batch's
        out = schedule()
        per_step.append((adapter_ids(out.seqs), adapter_ids(engine.scheduler.running)))
        return out
    engine.scheduler.schedule = recorded_schedule
    loras = [adapters["llama"][1 + i % 4] for i in range(len(PROMPTS))]
    loras[3] = None
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
    assert_equal_to_peft(tiny_models["llama"], outputs, loras)
    assert max(len(step) for step, _ in per_step) == 2 and max(len(running) for _, running in per_step) <= 2
    assert set().union(*(step for step, _ in per_step)) == {1, 2, 3, 4}
    assert len(manager.host) <= 3  # max_cpu_loras: least recently used read again when needed
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_an_adapter_that_does_not_fit_waits_without_blocking_the_base_model(tiny_models, adapters):
    """max_loras=1: the second adapter's request is skipped while the first runs and keeps its place; the
    base-model request behind it runs in the first step."""
    llm = LLM(tiny_models["qwen2"], enable_lora=True, max_loras=1, trace=True, **ROOMY_POOL)
    loras = [adapters["qwen2"][1], adapters["qwen2"][2], None]
    outputs = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False, lora_request=loras)
    steps = [[row.lora_name for row in record.scheduled] for record in llm.trace]  # the trace names each row's
    assert steps[0] == ["qwen2-1", None]
    assert "qwen2-2" in steps[-1] and all("qwen2-1" not in step for step in steps if "qwen2-2" in step)
    assert_equal_to_peft(tiny_models["qwen2"], outputs, loras)


def test_prefix_cache_hits_within_an_adapter_and_misses_across(tiny_models, adapters):
    llm = LLM(tiny_models["qwen3"], enable_lora=True, max_loras=2, block_size=4, **{"num_kvcache_blocks": 256})
    prompt = PROMPTS[4]  # 20 tokens: 4 full blocks can be cached
    params = SamplingParams(temperature=0.0, max_tokens=4)

    def cached(lora):
        return llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    one, two = adapters["qwen3"][1], adapters["qwen3"][2]
    assert cached(one) == 0
    assert cached(one) == 16  # the same adapter: its blocks hit
    assert cached(two) == 0 and cached(None) == 0  # another adapter, the base model: a miss
    assert cached(two) == 16 and cached(None) == 16
    out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=one)  # a hit gives the same tokens
    assert out[0].num_cached_tokens == 16
    assert out[0].outputs[0].token_ids == peft_greedy(tiny_models["qwen3"], one.lora_path, tuple(prompt))[0]


def test_async_llm_generate_with_an_adapter(tiny_models, adapters):
    import asyncio

    llm = AsyncLLM(tiny_models["qwen3"], enable_lora=True, max_loras=2, **ROOMY_POOL)
    lora = adapters["qwen3"][3]

    async def run():
        final = None
        async for output in llm.generate(PROMPTS[0], GREEDY, lora_request=lora):
            final = output
        return final

    try:
        output = asyncio.run(run())
    finally:
        llm.shutdown()
    assert output.outputs[0].token_ids == peft_greedy(tiny_models["qwen3"], lora.lora_path, tuple(PROMPTS[0]))[0]


def test_bad_adapters_are_refused_naming_what_is_wrong(tiny_models, adapters, tmp_path):
    model, good = tiny_models["qwen3"], adapters["qwen3"][1]
    llm = LLM(model, enable_lora=True, max_lora_rank=8, **ROOMY_POOL)

    def refused(lora: LoRARequest, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=[None, lora])

    def broken(name: str, edit) -> str:
        folder = tmp_path / name
        shutil.copytree(good.lora_path, folder)
        edit(folder)
        return str(folder)

    refused(LoRARequest("x", 10, str(tmp_path / "nowhere")), "lora_path: .*nowhere/adapter_config.json does not")
    refused(LoRARequest("x", 11, broken("nofile", lambda f: (f / "adapter_model.safetensors").unlink())),
            "adapter_model.safetensors does not exist")
    refused(adapters["qwen3"][3], r"r \(16\) exceeds max_lora_rank \(8\)")

    def rename_target(folder):
        weights = load_file(folder / "adapter_model.safetensors")
        save_file({k.replace("q_proj", "qq_proj"): v for k, v in weights.items()}, folder / "adapter_model.safetensors")
    refused(LoRARequest("x", 12, broken("target", rename_target)), "qq_proj.lora_A.weight is not a LoRA weight")

    def reshape(folder):
        weights = load_file(folder / "adapter_model.safetensors")
        save_file({k: v[:, :-1].contiguous() if "lora_A" in k else v for k, v in weights.items()},
                  folder / "adapter_model.safetensors")
    refused(LoRARequest("x", 13, broken("shape", reshape)), r"lora_A must be \(8, 64\) .* got \(8, 63\)")

    def dora(folder):
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    refused(LoRARequest("x", 14, broken("dora", dora)), "use_dora=True is not supported")
    # Nothing was queued, and the engine goes on serving: base and adapter requests.
    assert not llm.engine.has_unfinished_requests()
    outputs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=[None, good])
    assert_equal_to_peft(model, outputs, [None, good])
    refused(LoRARequest("x", 1, adapters["qwen3"][2].lora_path), "lora_int_id 1 is already the adapter at")
    with pytest.raises(ValueError, match="lora_request: got 1 for 2 prompts"):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=[good])


def test_lora_options_are_checked(tiny_models, adapters):
    model = tiny_models["qwen3"]
    with pytest.raises(ValueError, match="lora_request: .*no feature plugged in for it; pass enable_lora=True"):
        LLM(model, **ROOMY_POOL).generate(PROMPTS[:1], GREEDY, lora_request=adapters["qwen3"][1])
    for options, match in ((dict(max_loras=0), "max_loras must be >= 1"),
                           (dict(max_loras=3, max_cpu_loras=2), r"max_cpu_loras \(2\) must be >= max_loras \(3\)"),
                           (dict(max_lora_rank=1.5), "max_lora_rank must be an integer")):
        with pytest.raises(ValueError, match=match):
            LLM(model, enable_lora=True, **ROOMY_POOL, **options)
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, "/tmp")


def test_a_model_of_other_shapes_is_refused(tiny_models, adapters, tmp_path):
    """An adapter trained on a model with a wider MLP does not fit this one's down_proj."""
    other = make_model(tmp_path / "wide", "qwen3", intermediate_size=96)
    lora = LoRARequest("wide", 5, make_adapter(other, tmp_path / "wide-lora", 5, r=4, lora_alpha=4,
                                                target_modules=["down_proj"]))
    llm = LLM(tiny_models["qwen3"], enable_lora=True, **ROOMY_POOL)
    with pytest.raises(ValueError, match=r"down_proj.lora_A must be \(4, 128\) for this base model"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=lora)
