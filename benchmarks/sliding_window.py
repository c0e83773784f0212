"""What freeing the blocks behind a sliding window buys: long generations on a tiny random-weight Mistral (every
layer windowed, nanoserve/tools/sliding_window_picture.py's model) in a fixed KV pool.

Three engines on the same weights and requests: the window (sliding_window/ frees the blocks behind it); the same
weights with the window taken out of config.json (full attention: each sequence keeps all its blocks, and its
output differs); and LLM(..., disable_sliding_window=True), vLLM's flag, which caps the context at the window, so
it refuses these requests. For each: the most blocks a decoding sequence held, the sequences running after a step
(mean over the steps), preemptions, steps, wall time and tokens/s (a tiny model: the engine's own time dominates).

    python benchmarks/sliding_window.py [--requests 16] [--prompt 64] [--max-tokens 448] [--window 64] [--blocks 128]

--long: long contexts in a pool that full attention could not fit. Prompts of --min-len to --max-len tokens
(default 4 of 4,000 to 8,000; the issue's sizes: --long-requests 16 --max-len 16000) and --long-max-tokens
generated, window 256, prefilled in chunks of --budget tokens, on a random-weight Mistral (every layer
windowed; --hidden-size and --layers for a larger shape, on a GPU) in a pool sized for --concurrent
sequences' windows and chunks. Reports the sequences served, the peak blocks (the pool's, one sequence's)
right after each step is planned, and tokens/s; full attention is refused at once, its count named.

    python benchmarks/sliding_window.py --long [--long-requests 4] [--min-len 4000] [--max-len 8000]
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, like bench.py

import nanoserve  # noqa: E402,F401  first: its thread defaults precede torch's OpenMP

# isort: split
from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.sliding_window import NULL_BLOCK  # noqa: E402
from nanoserve.tools.sliding_window_picture import tiny_windowed_model  # noqa: E402
from nanoserve.utils.math import cdiv  # noqa: E402

BLOCK_SIZE = 16


def run(path: str, args: argparse.Namespace, **options) -> dict:
    llm = LLM(path, block_size=BLOCK_SIZE, num_kvcache_blocks=args.blocks, max_num_seqs=args.requests,
              max_model_len=args.prompt + args.max_tokens, **options)
    most_held, running_per_step = 0, []
    step = llm.engine.step

    def observed_step():  # after each step
        nonlocal most_held
        outputs = step()
        running = llm.engine.scheduler.running
        running_per_step.append(len(running))
        for seq in running:
            if seq.num_computed_tokens >= len(seq) - 1:  # decoding
                most_held = max(most_held, sum(b != NULL_BLOCK for b in seq.block_table))
        return outputs

    llm.engine.step = observed_step
    prompts = [[3 + (7 * i + j) % 500 for j in range(args.prompt)] for i in range(args.requests)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True),
                           use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return dict(most_blocks_per_seq=most_held, mean_running=round(sum(running_per_step) / len(running_per_step), 1),
                preemptions=llm.stats.num_preemptions,
                steps=llm.stats.num_steps, seconds=round(seconds, 1), tok_per_s=round(tokens / seconds))


def run_long(path: str, args: argparse.Namespace) -> dict:
    """The long-context scenario on one model: every request at once, peaks read after each planning."""
    peak = cdiv(args.long_window - 1 + args.budget, BLOCK_SIZE) + 1  # one sequence's most blocks at once
    llm = LLM(path, block_size=BLOCK_SIZE, num_kvcache_blocks=args.concurrent * peak + 1, dtype=args.dtype,
              max_model_len=args.max_len + args.long_max_tokens, enable_chunked_prefill=True,
              max_num_batched_tokens=args.budget)
    scheduler, bm = llm.engine.scheduler, llm.engine.block_manager
    peaks = {"pool": 0, "sequence": 0}
    schedule = scheduler.schedule

    def planned():
        out = schedule()
        peaks["pool"] = max(peaks["pool"], bm.num_blocks - bm.num_free_blocks)
        held = [sum(b != NULL_BLOCK for b in seq.block_table) for seq in scheduler.running]
        peaks["sequence"] = max([peaks["sequence"], *held])
        return out

    scheduler.schedule = planned
    step = (args.max_len - args.min_len) // max(args.long_requests - 1, 1)
    prompts = [[3 + (7 * i + j) % 500 for j in range(args.min_len + i * step)] for i in range(args.long_requests)]
    params = SamplingParams(temperature=0, max_tokens=args.long_max_tokens, ignore_eos=True)
    start = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    except ValueError as error:
        return {"refused": str(error)}
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return dict(sequences_served=len(outputs), pool_blocks=bm.num_blocks, peak_pool_blocks=peaks["pool"],
                peak_blocks_per_seq=peaks["sequence"], bound_per_seq=peak,
                full_attention_blocks_longest=cdiv(len(prompts[-1]) + args.long_max_tokens, BLOCK_SIZE),
                preemptions=llm.stats.num_preemptions, seconds=round(seconds, 1),
                generated_tok_per_s=round(generated / seconds, 1),
                prompt_and_generated_tok_per_s=round((sum(map(len, prompts)) + generated) / seconds))


def long_contexts(args: argparse.Namespace) -> None:
    heads = max(args.hidden_size // 128, 4)  # Mistral 7B's proportions: heads of 128, 4 per KV head
    shape = dict(hidden_size=args.hidden_size, intermediate_size=7 * args.hidden_size // 2,
                 num_attention_heads=heads, num_key_value_heads=heads // 4)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        max_len = args.max_len + args.long_max_tokens
        windowed = tiny_windowed_model(folder + "/windowed", args.long_window, max_len, args.layers, **shape)
        full = tiny_windowed_model(folder + "/full", None, max_len, args.layers, **shape)
        results["window"] = run_long(windowed, args)
        results["full attention"] = run_long(full, args)
    print(f"{args.long_requests} requests of {args.min_len} to {args.max_len} prompt tokens + "
          f"{args.long_max_tokens}, window {args.long_window}, chunks of {args.budget}, blocks of {BLOCK_SIZE}, "
          f"a pool for {args.concurrent} sequences' windows and chunks")
    print(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=448)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=128, help="num_kvcache_blocks (one is the null block)")
    parser.add_argument("--long", action="store_true", help="the long-context scenario instead (below)")
    parser.add_argument("--long-requests", type=int, default=4)
    parser.add_argument("--min-len", type=int, default=4000, help="the shortest prompt (--long)")
    parser.add_argument("--max-len", type=int, default=8000, help="the longest prompt (--long)")
    parser.add_argument("--long-max-tokens", type=int, default=32)
    parser.add_argument("--long-window", type=int, default=256)
    parser.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens: the chunk (--long)")
    parser.add_argument("--concurrent", type=int, default=2,
                        help="the pool holds this many sequences' windows and chunks (--long)")
    parser.add_argument("--hidden-size", type=int, default=64, help="the model's shape (--long)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    if args.long:
        return long_contexts(args)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        path = tiny_windowed_model(folder + "/windowed", args.window)
        full = tiny_windowed_model(folder + "/full", None)  # the same weights (seed 0), no window
        results["window"] = run(path, args)
        results["full attention"] = run(full, args)
        try:
            results["disable_sliding_window"] = run(path, args, disable_sliding_window=True)
        except ValueError as error:
            results["disable_sliding_window"] = {"refused": str(error)}
    length = args.prompt + args.max_tokens
    print(f"{args.requests} requests of {args.prompt} + {args.max_tokens} tokens, window {args.window}, "
          f"blocks of {BLOCK_SIZE}, a pool of {args.blocks} blocks; a sequence of {length} tokens fills "
          f"{-(-length // BLOCK_SIZE)} blocks, its window {-(-args.window // BLOCK_SIZE) + 1} at most")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
