"""One conversation's prompt blocks across the cache tiers, turn by turn
(docs/images/kv_offload_turns.png).

    python -m nanoserve.tools.kv_offload_picture [--out PATH]

Four conversations take turns on the demo model, one request at a time, each turn re-sending its
history, on a device pool that holds about one of them; the host tier (kv_offloading_size) holds
them all. For conversation 0's every turn, each block of its prompt is drawn by where its KV came
from: the device pool's prefix cache, the host tier (copied back), or the forward (computed).
"""
import argparse
import random

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from nanoserve import LLM, SamplingParams

COLOURS = {"device pool": "#4c72b0", "host tier": "#dd8452", "computed": "#cccccc"}


def turns(num_conversations: int = 4, num_turns: int = 5,
          seed: int = 0) -> list[tuple[int, int, int]]:
    """Conversation 0's turns: (device-hit blocks, host-hit blocks, computed blocks) of each
    prompt."""
    llm = LLM(num_kvcache_blocks=48, kv_offloading_size=0.25)
    block_size, rng = llm.engine.config.block_size, random.Random(seed)
    histories = [[] for _ in range(num_conversations)]
    rows = []
    for _ in range(num_turns):
        for i in range(num_conversations):
            prompt = histories[i] + [rng.randrange(3, 40000) for _ in range(rng.randint(48, 96))]
            host_before = llm.stats.num_host_cached_tokens
            out = llm.generate([prompt],
                               SamplingParams(temperature=0, ignore_eos=True, max_tokens=16),
                               use_tqdm=False)[0]
            histories[i] = prompt + out.outputs[0].token_ids
            if i == 0:
                host = (llm.stats.num_host_cached_tokens - host_before) // block_size
                device = out.num_cached_tokens // block_size - host
                rows.append((device, host, -(-len(prompt) // block_size) - device - host))
    return rows


def draw(rows: list[tuple[int, int, int]], path: str) -> None:
    fig = Figure(figsize=(8, 0.6 * len(rows) + 1.4))
    ax = fig.subplots()
    for turn, counts in enumerate(rows):
        start = 0
        for colour, n in zip(COLOURS.values(), counts):
            ax.barh(turn, n, left=start, color=colour, edgecolor="white", height=0.7)
            start += n
    ax.set_yticks(range(len(rows)), [f"turn {t + 1}" for t in range(len(rows))])
    ax.invert_yaxis()
    ax.set_xlabel("conversation 0's prompt, in KV blocks (16 tokens each)")
    ax.set_title("Where each block's KV came from: three other conversations ran between its turns")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/images/kv_offload_turns.png")
    out = parser.parse_args().out
    rows = turns()
    print(rows)
    draw(rows, out)
