"""The paged-attention kernel alone, at decode shapes, with the KV cache in the model's dtype and in fp8: the time
of one call (one layer's decode attention) and the K/V bytes it reads per second. Qwen3-0.6B's attention shapes
(16 query heads, 8 KV heads, head_dim 128), one new token per sequence, each sequence's blocks scattered in the pool.

    python benchmarks/paged_attention.py                 # CUDA: the Triton kernel, bfloat16 and fp8 caches
    python benchmarks/paged_attention.py --block-n 64,128   # the Triton kernel's keys per loop step, both tried
    python benchmarks/paged_attention.py --backends cpu,torch --num-seqs 32 --context 512   # on a CPU

GB/s counts the K and V values each sequence's context holds, read once (what a memory-bound kernel must read),
in the cache's dtype: fp8 reads half of bfloat16's bytes, so at the same time per call it shows half the GB/s.
"""
import argparse
import statistics
import sys
from pathlib import Path
from time import perf_counter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, like bench.py

import nanoserve  # noqa: E402,F401  first: its thread defaults precede torch's OpenMP

# isort: split
import torch  # noqa: E402

from nanoserve.layers.attention import AttentionMetadata  # noqa: E402
from nanoserve.layers.selector import attention_backend  # noqa: E402
from nanoserve.layers.torch_attention import to_cache_dtype  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128


def metadata(num_seqs: int, context: int, block_size: int, device: torch.device) -> tuple[AttentionMetadata, int]:
    """num_seqs decoding sequences of `context` tokens each (the new one included), blocks drawn at random."""
    per_seq = -(-context // block_size)
    blocks = torch.randperm(num_seqs * per_seq, generator=torch.Generator().manual_seed(0))
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(num_seqs, dtype=torch.int64, device=device),
        block_tables=blocks.view(num_seqs, per_seq).to(**i32),
        context_lens=torch.full((num_seqs,), context, **i32),
        cu_seqlens_q=torch.arange(num_seqs + 1, **i32),
        cu_seqlens_k=torch.arange(num_seqs + 1, **i32) * context,
        max_seqlen_q=1, max_seqlen_k=context)
    return meta, num_seqs * per_seq


def time_call(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of fn() over repeats calls, after 3 untimed ones (compilation, caches)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start = perf_counter()
            fn()
            times.append(perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="triton" if cuda else "cpu,torch")
    p.add_argument("--num-seqs", type=int, default=256 if cuda else 32)
    p.add_argument("--context", type=int, default=1024 if cuda else 512, help="tokens per sequence")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--block-n", default=None, help="Triton: keys per loop step to try for every cache dtype "
                                                   "(comma-separated); default: the kernel's own BLOCK_N")
    p.add_argument("--repeats", type=int, default=50 if cuda else 5)
    args = p.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    meta, num_blocks = metadata(args.num_seqs, args.context, args.block_size, device)
    gen = torch.Generator(device).manual_seed(0)
    kv = torch.randn(2, num_blocks, args.block_size, KV_HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype)
    q = torch.randn(args.num_seqs, HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype)
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"{name}: {args.num_seqs} sequences x {args.context} tokens, {HEADS} query heads, {KV_HEADS} KV heads, "
          f"head_dim {HEAD_DIM}, blocks of {args.block_size}, q in {dtype}")
    for backend in args.backends.split(","):
        _, attend = attention_backend(backend)
        for cache_dtype in (dtype, torch.float8_e4m3fn):
            k_cache, v_cache = (to_cache_dtype(x, cache_dtype) for x in kv)
            nbytes = 2 * args.num_seqs * args.context * KV_HEADS * HEAD_DIM * cache_dtype.itemsize
            block_ns = [None] if backend != "triton" or args.block_n is None else \
                [int(n) for n in args.block_n.split(",")]
            for block_n in block_ns:
                label = f"{backend}, {str(cache_dtype).removeprefix('torch.')} cache"
                if block_n is not None:  # the kernel's keys per step, for this run only
                    from nanoserve.layers import triton_attention
                    triton_attention.BLOCK_N = block_n
                    label += f", BLOCK_N {block_n}"

                def call(attend=attend, k_cache=k_cache, v_cache=v_cache):
                    meta.torch_plan = None  # the PyTorch path plans once per step (per layer 0), as in the engine
                    attend(q, k_cache, v_cache, meta, HEAD_DIM**-0.5)

                seconds = time_call(call, device, args.repeats)
                print(f"  {label:40s} {1e3 * seconds:8.3f} ms  {nbytes / 1e6:8.1f} MB  "
                      f"{nbytes / seconds / 1e9:7.1f} GB/s")


if __name__ == "__main__":
    main()
