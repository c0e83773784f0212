"""What freeing the blocks behind a sliding window buys: long generations on a tiny random-weight Mistral (every
layer windowed, nanoserve/tools/sliding_window_picture.py's model) in a fixed KV pool.

Three engines on the same weights and requests: the window (sliding_window/ frees the blocks behind it); the same
weights with the window taken out of config.json (full attention: each sequence keeps all its blocks, and its
output differs); and LLM(..., disable_sliding_window=True), vLLM's flag, which caps the context at the window, so
it refuses these requests. For each: the most blocks a decoding sequence held, the sequences running after a step
(mean over the steps), preemptions, steps, wall time and tokens/s (a tiny model: the engine's own time dominates).

    python benchmarks/sliding_window.py [--requests 16] [--prompt 64] [--max-tokens 448] [--window 64] [--blocks 128]
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

BLOCK_SIZE = 16


def run(path: str, args: argparse.Namespace, **options) -> dict:
    llm = LLM(path, block_size=BLOCK_SIZE, num_kvcache_blocks=args.blocks, max_num_seqs=args.requests,
              max_model_len=args.prompt + args.max_tokens, **options)
    most_held, running_per_step = 0, []

    def observe(plan, seqs):
        nonlocal most_held
        running = llm.engine.scheduler.running
        running_per_step.append(len(running))
        for seq in running:
            if seq.num_computed_tokens >= len(seq) - 1:  # decoding
                most_held = max(most_held, sum(b != NULL_BLOCK for b in seq.block_table))

    llm.engine.seams.observers.append(observe)
    prompts = [[3 + (7 * i + j) % 500 for j in range(args.prompt)] for i in range(args.requests)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True),
                           use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return dict(most_blocks_per_seq=most_held, mean_running=round(sum(running_per_step) / len(running_per_step), 1),
                preemptions=llm.stats.num_preemptions,
                steps=llm.stats.num_steps, seconds=round(seconds, 1), tok_per_s=round(tokens / seconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=448)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=128, help="num_kvcache_blocks (one is the null block)")
    args = parser.parse_args()
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
