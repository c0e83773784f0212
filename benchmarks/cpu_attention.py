"""One step's attention on CPU, all layers, on the PyTorch path and the C++ kernel ("torch" and "cpu" backends),
and the C++ kernel over an fp8 cache (kv_cache_dtype="fp8"): the demo model's shapes (30 layers, 9 query heads,
3 KV heads, head_dim 64, float32), KV blocks of 16 scattered in a pool, each layer its own cache (as in the engine:
a step reads every layer's K/V from memory once).

    python benchmarks/cpu_attention.py            # decode batches and prefills, ms per step
"""
import random
import sys
from pathlib import Path
from time import perf_counter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, like bench.py

import nanoserve  # noqa: E402,F401  first: its thread defaults precede torch's OpenMP

# isort: split
import torch  # noqa: E402

from nanoserve.layers.attention import AttentionMetadata  # noqa: E402
from nanoserve.layers.selector import attention_backend  # noqa: E402
from nanoserve.utils.cpu_kernel import load_cpu_kernel  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 9, 3, 64, 16
CASES = {  # name: (new tokens, context length after the step) per sequence
    "decode 64 x 300-540": [(1, random.Random(0).randint(300, 540)) for _ in range(64)],
    "decode 16 x 100-800": [(1, random.Random(1).randint(100, 800)) for _ in range(16)],
    "verify 16 x (1 + 4) at 300": [(5, 300)] * 16,
    "prefill 4 x 32-512": [(n, n) for n in (32, 100, 300, 512)],
}


def metadata(batch: list[tuple[int, int]]) -> tuple[AttentionMetadata, int]:
    """A block table per sequence, its blocks drawn at random from a pool just large enough."""
    blocks = [-(-ctx // BLOCK_SIZE) for _, ctx in batch]
    order = torch.randperm(sum(blocks), generator=torch.Generator().manual_seed(0)).tolist()
    tables = [[order.pop() for _ in range(n)] for n in blocks]
    i32 = dict(dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([], dtype=torch.int64),
        block_tables=torch.tensor([t + [-1] * (max(blocks) - len(t)) for t in tables], **i32),
        context_lens=torch.tensor([ctx for _, ctx in batch], **i32),
        cu_seqlens_q=torch.tensor([0, *torch.tensor([q for q, _ in batch]).cumsum(0).tolist()], **i32),
        cu_seqlens_k=torch.tensor([0, *torch.tensor([c for _, c in batch]).cumsum(0).tolist()], **i32),
        max_seqlen_q=max(q for q, _ in batch), max_seqlen_k=max(c for _, c in batch))
    return meta, sum(blocks)


def time_step(backend: str, batch: list[tuple[int, int]], repeats: int = 5, dtype: torch.dtype = torch.float32
              ) -> float:
    """ms for one step: every layer attends over its own cache (random values: the layout does not matter here)."""
    _, attend = attention_backend(backend)
    meta, num_blocks = metadata(batch)
    caches = [torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(LAYERS)]
    q = torch.randn(sum(n for n, _ in batch), HEADS, HEAD_DIM)

    def step():
        meta.torch_plan = None  # the PyTorch path plans once per step, as in the engine
        for k_cache, v_cache in caches:
            attend(q, k_cache, v_cache, meta, HEAD_DIM**-0.5)

    step()
    start = perf_counter()
    for _ in range(repeats):
        step()
    return (perf_counter() - start) / repeats * 1e3


if __name__ == "__main__":
    if isinstance(why := load_cpu_kernel("paged_attention_cpu"), str):
        sys.exit(f"the CPU kernel cannot be built here: {why}")
    capability, threads = torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()
    print(f"{capability}, {threads} threads, ms per step ({LAYERS} layers)")
    for name, batch in CASES.items():
        torch_ms, cpu_ms = time_step("torch", batch), time_step("cpu", batch)
        fp8_ms = time_step("cpu", batch, dtype=torch.float8_e4m3fn)
        print(f"{name:28} torch {torch_ms:7.1f}   cpu {cpu_ms:7.1f}   {torch_ms / cpu_ms:.2f}x   "
              f"cpu over fp8 {fp8_ms:7.1f}   {cpu_ms / fp8_ms:.2f}x")
