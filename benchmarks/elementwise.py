"""The elementwise chains per call, eager PyTorch ("torch") against the C++ loops ("cpu"): RMSNorm with its residual
add, SwiGLU's gate and RoPE on q and k, at the demo model's shapes (hidden 576, MLP 1,536, 9 + 3 heads of 64),
float32, for a decode step's 64 tokens and a prefill's 4,096.

    python benchmarks/elementwise.py              # µs per call
"""
import sys
from pathlib import Path
from time import perf_counter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, like bench.py

import nanoserve  # noqa: E402,F401  first: its thread defaults precede torch's OpenMP

# isort: split
import torch  # noqa: E402

from nanoserve.layers.activation import SiluAndMul  # noqa: E402
from nanoserve.layers.elementwise_backend import CPU_FORWARDS  # noqa: E402
from nanoserve.layers.layernorm import RMSNorm  # noqa: E402
from nanoserve.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from nanoserve.utils.cpu_kernel import load_cpu_kernel  # noqa: E402


def microseconds(call, repeats: int) -> float:
    for _ in range(10):
        call()
    start = perf_counter()
    for _ in range(repeats):
        call()
    return (perf_counter() - start) / repeats * 1e6


if __name__ == "__main__":
    if isinstance(why := load_cpu_kernel("elementwise_cpu"), str):
        sys.exit(f"the CPU kernel cannot be built here: {why}")
    print(f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, µs per call: torch -> cpu")
    norm, act, rope = RMSNorm(576, 1e-5), SiluAndMul(), RotaryEmbedding(64, 8192, 100000.0)
    for tokens, repeats in ((64, 2000), (4096, 50)):
        x, residual, gate_up = torch.randn(tokens, 576), torch.randn(tokens, 576), torch.randn(tokens, 3072)
        qkv = torch.randn(tokens, 960)  # q and k are views of the fused projection, as in the model
        q, k = qkv[:, :576].view(tokens, 9, 64), qkv[:, 576:768].view(tokens, 3, 64)
        positions = torch.randint(0, 8192, (tokens,))
        cases = {"RMSNorm + residual": (norm, (x, residual)), "SwiGLU": (act, (gate_up,)),
                 "RoPE": (rope, (positions, q, k))}
        for name, (module, args) in cases.items():
            eager = microseconds(lambda m=module, a=args: m(*a), repeats)
            fused = microseconds(lambda m=module, a=args: CPU_FORWARDS[type(m)](m, *a), repeats)
            print(f"{tokens:5} tokens  {name:19} {eager:8.1f} -> {fused:7.1f}  {eager / fused:5.2f}x")
