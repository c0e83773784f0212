"""Where a decode step's device time goes: torch.profiler over a few eager decode steps of a full batch, the kernels
summed into attention, elementwise (norms, RoPE, SwiGLU, copies), matmuls and the rest, and the top kernels.

    python benchmarks/profile_decode.py --model benchmarks/qwen3-0.6b --random-weights --num-seqs 256
    python benchmarks/profile_decode.py --elementwise-backend torch   # the unfused chains, for comparison

Eager (enforce_eager=True): the profiler sees each kernel a CUDA graph would replay. On the CPU it lists PyTorch's
CPU ops instead, and misses nanoserve's C++ kernels (called through pybind, not as PyTorch ops): a GPU tool.
"""
import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, like bench.py

import nanoserve  # noqa: E402,F401  first: its thread defaults precede torch's OpenMP

# isort: split
import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.workloads import random_weights  # noqa: E402
from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.utils.default_model import resolve_model  # noqa: E402

# A kernel's category: the first whose words its name contains (lower case).
CATEGORIES = {
    "attention": ("paged_attention", "flash", "attention"),
    "matmul": ("gemm", "cutlass", "sm90_", "sm80_", "ampere_", "cublas", "nvjet", "addmm", "linear", "_mm", "mkldnn"),
    "elementwise": ("rms_norm", "silu", "rotary", "elementwise", "vectorized", "reduce", "copy", "cat", "mul", "add",
                    "pow", "mean", "rsqrt", "index", "fill", "store_kvcache"),
}


def category(name: str) -> str:
    name = name.lower()
    return next((c for c, words in CATEGORIES.items() if any(w in name for w in words)), "other")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--random-weights", nargs="?", const=True, default=False, metavar="FOLDER",
                   help="the config's architecture with seeded random weights (in FOLDER: as bench.py's)")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=5, help="decode steps profiled")
    p.add_argument("--elementwise-backend", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = resolve_model(args.model)
        if args.random_weights:
            path = random_weights(path, 0, tmp if args.random_weights is True else args.random_weights)
        llm = LLM(path, enforce_eager=True, max_num_seqs=args.num_seqs, elementwise_backend=args.elementwise_backend,
                  kv_cache_dtype=args.kv_cache_dtype)
        engine, cuda = llm.engine, llm.engine.config.device == "cuda"
        greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.steps + 50)
        for i in range(args.num_seqs):
            engine.add_request(str(i), [(i * 7 + j) % 1000 + 10 for j in range(args.prompt_len)], greedy)
        while any(seq.num_computed_tokens < args.prompt_len for seq in engine.scheduler.running) or \
                engine.scheduler.waiting:  # prefill everything first: only decode steps are profiled
            engine.step()
        for _ in range(3):  # warm-up decodes (Triton compiles each kernel variant once)
            engine.step()
        activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                engine.step()
            if cuda:
                torch.cuda.synchronize()
    # Each kernel's own time (a CPU op's device time would count its kernels a second time)
    device_time = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, device_time) > 0
              and (not cuda or e.device_type == DeviceType.CUDA)]
    totals: dict[str, float] = {}
    for e in events:
        totals[category(e.key)] = totals.get(category(e.key), 0.0) + getattr(e, device_time)
    total = sum(totals.values())
    config = llm.engine.config
    print(f"{torch.cuda.get_device_name() if cuda else 'CPU'}: {args.steps} decode steps of {args.num_seqs} "
          f"sequences ({args.prompt_len}-token prompts), {config.dtype}, elementwise {config.elementwise_backend}, "
          f"attention {config.attention_backend}, KV {config.kv_cache_dtype}")
    print(f"{total / args.steps / 1e3:.2f} ms of kernel time a step, "
          f"{sum(e.count for e in events) / args.steps:.0f} kernels a step")
    for name, t in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<12}{t / total:>6.1%}")
    print("top kernels:")
    for e in sorted(events, key=lambda e: -getattr(e, device_time))[:12]:
        print(f"  {getattr(e, device_time) / total:>6.1%} {e.count // args.steps:>5}/step  {e.key[:90]}")


if __name__ == "__main__":
    main()
