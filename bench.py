"""Throughput and latency of nanoserve against Hugging Face transformers, side by side in one run.

The workload follows nano-vllm's bench.py: prompts of random token ids with random input and output
lengths, ignore_eos (every request produces exactly its output length), one warm-up per engine.
Both engines get identical prompts and output lengths, greedy decoding, the same dtype and device.

    python bench.py                       # 64 prompts, input 32-512, output 32-256 tokens
    python bench.py --nano-vllm           # nano-vllm's workload: 256 prompts, 100-1024 in and out
    python bench.py --shared-prefix       # prefix caching on vs off, on prompts sharing a long prefix
    python bench.py --json results.json   # also write the figures for scripts

Timing lives here, not in the engine: bench.py drives `llm.engine` step by step (as LLM.generate
does) to timestamp each request's tokens, and wraps `model_runner.run_model` to time the forward.
"""
import argparse
import gc
import json
import os
import platform
import random
import runpy
import sys
import tempfile
from time import perf_counter

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

from nanoserve import LLM, SamplingParams
from nanoserve.config import Config
from nanoserve.utils.default_model import resolve_model

# Scenario defaults: (prompts, (min, max) input tokens, (min, max) output tokens). CPU-sized, except
# nano-vllm's own. For --shared-prefix the input range is the part after the shared prefix.
WORKLOADS = {
    "default": (64, (32, 512), (32, 256)),
    "nano-vllm": (256, (100, 1024), (100, 1024)),
    "shared-prefix": (64, (16, 64), (16, 64)),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="model folder or hub id (default: the embedded SmolLM2-135M)")
    p.add_argument("--random-weights", action="store_true",
                   help="the model folder holds only a config.json: benchmark seeded random weights")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--num-prompts", type=int, help="number of requests")
    p.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"), help="prompt length range")
    p.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"), help="output length range")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nano-vllm", action="store_true", help="nano-vllm's workload: 256 x 100-1024 x 100-1024")
    p.add_argument("--shared-prefix", action="store_true",
                   help="prompts share a common prefix; nanoserve with vs without prefix caching")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared prefix length (--shared-prefix)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="transformers: prompts per generate() call")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers peer")
    p.add_argument("--block-size", type=int, help="nanoserve KV block size (default: the engine's)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's, one per core)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = p.parse_args(argv)
    args.scenario = "shared-prefix" if args.shared_prefix else "nano-vllm" if args.nano_vllm else "default"
    num_prompts, input_len, output_len = WORKLOADS[args.scenario]
    args.num_prompts = args.num_prompts or num_prompts
    args.input_len = args.input_len or input_len
    args.output_len = args.output_len or output_len
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


def percentiles(values: list[float]) -> tuple[float, float]:
    return (float(np.percentile(values, 50)), float(np.percentile(values, 90))) if values else (0.0, 0.0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---- nanoserve --------------------------------------------------------------------------------
def time_forward(runner) -> list[float]:
    """Wrap runner.run_model (model forward + logits) so each call appends its duration to the list."""
    durations: list[float] = []
    run_model = runner.run_model

    def timed_run_model(*args, **kwargs):
        sync(runner.device)
        t = perf_counter()
        out = run_model(*args, **kwargs)
        sync(runner.device)
        durations.append(perf_counter() - t)
        return out

    runner.run_model = timed_run_model  # an instance attribute shadows the method
    return durations


def run_nanoserve(llm: LLM, prompts: list[list[int]], output_lens: list[int], warmup: list[int]) -> dict:
    """Drive the engine like LLM.generate does, timestamping each request's first and last token."""
    engine = llm.engine
    llm.generate([warmup], SamplingParams(max_tokens=8), use_tqdm=False)
    forward_times = time_forward(engine.model_runner)
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=n) for n in output_lens]
    start = perf_counter()
    for i, (ids, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), ids, sp)
    first_token, finish, lengths, cached = {}, {}, [0] * len(prompts), [0] * len(prompts)
    while engine.has_unfinished_requests():
        outputs = engine.step_fn()
        now = perf_counter()
        for out in outputs:
            i = int(out.request_id)
            first_token.setdefault(i, now)
            lengths[i] += len(out.new_token_ids)
            if out.finished:
                finish[i], cached[i] = now, out.num_cached_tokens
    wall = perf_counter() - start
    assert lengths == output_lens
    num_tokens = sum(output_lens)
    ttft = [first_token[i] - start for i in range(len(prompts))]
    tpot = [(finish[i] - first_token[i]) / (n - 1) for i, n in enumerate(output_lens) if n > 1]
    forward = sum(forward_times)
    return dict(
        output_tokens=num_tokens, wall_s=wall, tokens_per_s=num_tokens / wall,
        ttft_p50_s=percentiles(ttft)[0], ttft_p90_s=percentiles(ttft)[1],
        tpot_p50_ms=percentiles(tpot)[0] * 1e3, tpot_p90_ms=percentiles(tpot)[1] * 1e3,
        forward_s=forward, overhead_share=(wall - forward) / wall,
        steps=len(forward_times), cached_prompt_tokens=sum(cached),
    )


def bench_nanoserve(path: str, args, prompts, output_lens, **options) -> dict:
    if args.block_size:
        options["block_size"] = args.block_size
    llm = LLM(path, dtype=args.dtype, **options)
    # The warm-up request is the shared prefix, if any: like a system prompt a running server has seen.
    # (Otherwise the prompts of the first prefill step would all miss: blocks are cached once computed.)
    warmup = prompts[0][: args.prefix_len] if args.shared_prefix else list(range(1, 33))
    result = run_nanoserve(llm, prompts, output_lens, warmup)
    config = llm.engine.config
    result.update(dtype=config.dtype, device=config.device, block_size=config.block_size)
    del llm
    gc.collect()  # give back the KV cache before the next engine allocates its own
    return result


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
    def generate(batch: list[list[int]], lens: list[int]) -> None:
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
        # eos_token_id=None: like ignore_eos, no row stops before its length and the batch never ends early.
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens), do_sample=False,
                       eos_token_id=None, pad_token_id=pad_id,
                       stopping_criteria=StoppingCriteriaList([StopAtOwnLength(width, lens)]))

    generate([list(range(1, 33))], [8])  # warm-up
    sync(model.device)
    start = perf_counter()
    for i in range(0, len(prompts), batch_size):
        generate(prompts[i : i + batch_size], output_lens[i : i + batch_size])
    sync(model.device)
    wall = perf_counter() - start
    num_tokens = sum(output_lens)  # only each row's own tokens count, not those past its length
    return dict(output_tokens=num_tokens, wall_s=wall, tokens_per_s=num_tokens / wall, batch_size=batch_size)


def bench_transformers(path: str, args, prompts, output_lens) -> dict:
    config = Config(path, dtype=args.dtype)  # the dtype and device nanoserve picks for "auto"
    dtype, device = config.dtype, config.device
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    with torch.inference_mode():
        result = run_transformers(model, prompts, output_lens, args.hf_batch_size, pad_id=0)
    result.update(dtype=dtype, device=device)
    del model
    gc.collect()
    return result


# ---- report -----------------------------------------------------------------------------------
def machine() -> dict:
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return dict(cpu=cpu, cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(), gpu=gpu,
                torch=torch.__version__, transformers=transformers.__version__,
                load_avg_1min=os.getloadavg()[0])  # other work on the machine skews CPU timings


def print_table(results: dict, ratio_name: str, ratio: float | None) -> None:
    head = f"{'engine':<28}{'tok/s':>9}{'wall s':>9}{'TTFT p50/p90 s':>17}{'TPOT p50/p90 ms':>18}{'overhead':>10}"
    print(head + "\n" + "-" * len(head))
    for name, r in results.items():
        line = f"{name:<28}{r['tokens_per_s']:>9.1f}{r['wall_s']:>9.2f}"
        if "ttft_p50_s" in r:
            line += f"{r['ttft_p50_s']:>8.2f} / {r['ttft_p90_s']:<6.2f}"
            line += f"{r['tpot_p50_ms']:>9.1f} / {r['tpot_p90_ms']:<6.1f}{r['overhead_share']:>9.1%}"
        print(line)
    if ratio is not None:
        print(f"{ratio_name}: {ratio:.2f}x output tokens/s")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    machine_info = machine()  # before the run: its load average shows other work on the machine
    with tempfile.TemporaryDirectory(prefix="nanoserve-bench-") as tmp:
        path = resolve_model(args.model)
        if args.random_weights:  # e.g. benchmarks/qwen3-0.6b: no checkpoint needed to measure speed
            torch.manual_seed(args.seed)
            AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).save_pretrained(tmp)
            path = tmp
        prompts, output_lens = make_workload(args, AutoConfig.from_pretrained(path).vocab_size)
        print(f"{args.scenario}: {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, "
              f"{sum(output_lens)} output tokens, model {args.model}")
        results: dict[str, dict] = {}
        if args.shared_prefix:
            results["nanoserve (prefix cache)"] = bench_nanoserve(path, args, prompts, output_lens)
            results["nanoserve (no prefix cache)"] = bench_nanoserve(path, args, prompts, output_lens,
                                                                     enable_prefix_caching=False)
            ratio_name, (on, off) = "prefix cache on / off", results.values()
        else:
            # transformers first: nanoserve's start-up tunes the process's allocator (keep_freed_memory),
            # which transformers as a user runs it does not get.
            hf = None if args.no_transformers else bench_transformers(path, args, prompts, output_lens)
            results["nanoserve"] = nano = bench_nanoserve(path, args, prompts, output_lens)
            if hf:
                results["transformers"] = hf
            ratio_name, (on, off) = "nanoserve / transformers", (nano, hf)
    ratio = on["tokens_per_s"] / off["tokens_per_s"] if off else None
    print_table(results, ratio_name, ratio)
    report = dict(scenario=args.scenario, machine=machine_info, model=args.model,
                  workload=dict(num_prompts=len(prompts), input_len=args.input_len, output_len=args.output_len,
                                prefix_len=args.prefix_len if args.shared_prefix else 0, seed=args.seed,
                                prompt_tokens=sum(map(len, prompts)), output_tokens=sum(output_lens)),
                  results=results, ratio_name=ratio_name, ratio=ratio)
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
