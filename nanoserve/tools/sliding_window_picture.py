"""One long request's KV blocks, step by step, under sliding-window attention
(docs/images/sliding_window_blocks.png).

    python -m nanoserve.tools.sliding_window_picture [--out PATH]

A tiny random-weight Mistral (every layer windowed, window 64, blocks of 16) in a pool of 16 blocks:
a 640-token prompt, prefilled in chunks of 32 (enable_chunked_prefill, max_num_batched_tokens=32),
then 80 generated tokens. Top: each logical block of the sequence over the steps: not yet needed,
held, or handed back to the pool behind the window (the null block in its place). Bottom: the blocks
it holds after each step, against what it would hold without the window (the whole prompt at once,
then one per 16 tokens), and the bounds: ceil((64 - 1 + 32) / 16) + 1 = 7 while a chunk is computed,
ceil(64 / 16) + 1 = 5 after.
"""
import argparse
import tempfile

import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from transformers import AutoModelForCausalLM, MistralConfig

from nanoserve import LLM, SamplingParams
from nanoserve.sliding_window import NULL_BLOCK
from nanoserve.utils.math import cdiv

COLOURS = {"not yet needed": "#eeeeee", "held": "#4c72b0", "freed behind the window": "#dd8452"}
BLOCK_SIZE = 16


def tiny_windowed_model(path: str, window: int | None, max_len: int = 4096, num_layers: int = 2,
                        **shape) -> str:
    """A random-weight Mistral with every layer windowed, small enough for any CPU (no download);
    shape overrides its sizes (hidden_size, intermediate_size, heads)."""
    torch.manual_seed(0)
    sizes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2)
    config = MistralConfig(vocab_size=512, num_hidden_layers=num_layers,
                           max_position_embeddings=max_len, sliding_window=window,
                           eos_token_id=None, bos_token_id=None, **{**sizes, **shape})
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def block_states(window: int = 64, prompt_len: int = 640, chunk: int = 32,
                 max_tokens: int = 80) -> tuple[np.ndarray, list[int]]:
    """[logical block, step]: 0 not yet needed, 1 held, 2 freed; and the tokens computed after each
    step."""
    with tempfile.TemporaryDirectory() as folder:
        llm = LLM(tiny_windowed_model(folder, window), trace=True, block_size=BLOCK_SIZE,
                  num_kvcache_blocks=16, enable_chunked_prefill=True, max_num_batched_tokens=chunk)
        llm.generate([[3 + i % 500 for i in range(prompt_len)]],
                     SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                     use_tqdm=False)
    steps = [rec for rec in llm.trace if rec.block_tables]  # (none once it finished)
    tables = [table for rec in steps for table in rec.block_tables.values()]
    states = np.zeros((max(map(len, tables)), len(tables)), np.int8)
    for step, table in enumerate(tables):
        states[: len(table), step] = [2 if b == NULL_BLOCK else 1 for b in table]
    computed = [r.start + r.num_tokens for rec in steps for r in rec.scheduled]
    return states, computed


def draw(states: np.ndarray, computed: list[int], path: str, window: int = 64,
         prompt_len: int = 640, chunk: int = 32) -> None:
    fig = Figure(figsize=(9, 6.5))
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    top.imshow(states, aspect="auto", origin="lower", interpolation="nearest",
               cmap=ListedColormap(list(COLOURS.values())), vmin=0, vmax=2)
    top.set_ylabel("logical block of the sequence")
    top.set_title(f"A {prompt_len}-token prompt in chunks of {chunk}, then decoding, under a "
                  f"sliding window of {window} (blocks of {BLOCK_SIZE})")
    top.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper left")
    steps = np.arange(states.shape[1])
    prefill_steps = cdiv(prompt_len, chunk)
    for ax in (top, bottom):
        ax.axvline(prefill_steps - 0.5, color="black", lw=0.8, ls="--")
    bottom.plot(steps, (states == 1).sum(axis=0), label="held with the window")
    bottom.plot(steps, [cdiv(max(n, prompt_len), BLOCK_SIZE) for n in computed], "--",
                label="held without it (the prompt's all at once)")
    bottom.text(prefill_steps / 2, 20, "prefill\nin chunks", ha="center", va="center")
    bottom.text(prefill_steps + 2, 20, "decode", ha="left", va="center")
    bounds = {"ceil((window - 1 + chunk) / 16) + 1: during a chunk":
              cdiv(window - 1 + chunk, BLOCK_SIZE) + 1,
              "ceil(window / 16) + 1: decoding": cdiv(window, BLOCK_SIZE) + 1}
    for (label, bound), style in zip(bounds.items(), (":", "-.")):
        bottom.axhline(bound, color="grey", lw=0.8, ls=style, label=label)
    bottom.set_xlabel("engine step")
    bottom.set_ylabel("KV blocks")
    bottom.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/images/sliding_window_blocks.png")
    args = parser.parse_args()
    states, computed = block_states()
    print(f"{states.shape[1]} steps; blocks held at most: {(states == 1).sum(axis=0).max()}")
    draw(states, computed, args.out)
