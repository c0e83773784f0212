"""One long sequence's KV blocks, step by step, under sliding-window attention (docs/images/sliding_window_blocks.png).

    python -m nanoserve.tools.sliding_window_picture [--out PATH]

A tiny random-weight Mistral (every layer windowed, window 64, blocks of 16) generates 400 tokens after a prompt
of 40. Top: each logical block of the sequence over the steps: not yet needed, held, or handed back to the pool
behind the window (the null block in its place). Bottom: the blocks it holds, against what it would hold without
the window (one per 16 tokens), and the bound ceil(64 / 16) + 1 = 5.
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

COLOURS = {"not yet needed": "#eeeeee", "held": "#4c72b0", "freed behind the window": "#dd8452"}


def tiny_windowed_model(path: str, window: int, max_len: int = 4096, num_layers: int = 2) -> str:
    """A random-weight Mistral with every layer windowed, small enough for any CPU (no download)."""
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
                           sliding_window=window, eos_token_id=None, bos_token_id=None)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def block_states(window: int = 64, prompt_len: int = 40, max_tokens: int = 400) -> tuple[np.ndarray, list[int]]:
    """[logical block, step]: 0 not yet needed, 1 held, 2 freed; and the sequence's length after each step."""
    with tempfile.TemporaryDirectory() as folder:
        llm = LLM(tiny_windowed_model(folder, window), trace=True, block_size=16, num_kvcache_blocks=64)
        llm.generate([list(range(3, 3 + prompt_len))], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                       ignore_eos=True), use_tqdm=False)
    tables = [table for rec in llm.trace for table in rec.block_tables.values()]  # (none once it finished)
    states = np.zeros((max(map(len, tables)), len(tables)), np.int8)
    for step, table in enumerate(tables):
        states[: len(table), step] = [2 if b == NULL_BLOCK else 1 for b in table]
    lengths = [min(prompt_len + step, prompt_len + max_tokens) for step in range(len(tables))]
    return states, lengths


def draw(states: np.ndarray, lengths: list[int], path: str, window: int = 64) -> None:
    fig = Figure(figsize=(9, 6.5))
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    top.imshow(states, aspect="auto", origin="lower", interpolation="nearest",
               cmap=ListedColormap(list(COLOURS.values())), vmin=0, vmax=2)
    top.set_ylabel("logical block of the sequence")
    top.set_title(f"One sequence under a sliding window of {window} tokens (blocks of 16)")
    top.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper left")
    steps = np.arange(states.shape[1])
    bottom.plot(steps, (states == 1).sum(axis=0), label="held with the window")
    bottom.plot(steps, [-(-n // 16) for n in lengths], "--", label="held without it")
    bottom.axhline(-(-window // 16) + 1, color="grey", lw=0.8, ls=":", label="ceil(window / 16) + 1")
    bottom.set_xlabel("engine step")
    bottom.set_ylabel("KV blocks")
    bottom.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/images/sliding_window_blocks.png")
    args = parser.parse_args()
    states, lengths = block_states()
    print(f"{states.shape[1]} steps; blocks held at most: {(states == 1).sum(axis=0).max()}")
    draw(states, lengths, args.out)
