"""LoRA's layers alone, at decode shapes: one decoder layer's four LoRA layers (qkv_proj, o_proj, gate_up_proj,
down_proj, Qwen3-0.6B's sizes) with every row using an adapter, against the same layers' base model, the time of
one forward of the four. On CUDA each forward is a CUDA graph's replay, as the engine's decode steps are: the
time is the device's, launches and all (LoRA's: one expand a layer, the shrink in the base matmul,
nanoserve/lora/triton_lora.py); on a CPU the PyTorch path runs, timed by the wall clock.

    python benchmarks/lora_layers.py                        # CUDA: ranks 8 and 64, 1-8 adapters, 1-256 rows
    python benchmarks/lora_layers.py --ranks 16 --adapters 4 --rows 1,16   # a few shapes (a CPU's default)
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, like bench.py

import nanoserve  # noqa: E402,F401  first: its thread defaults precede torch's OpenMP

# isort: split
import torch  # noqa: E402
from paged_attention import time_call  # noqa: E402

from nanoserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear  # noqa: E402
from nanoserve.lora.layers import LoRALinear, LoRARows  # noqa: E402

HIDDEN, Q, KV, INTERMEDIATE = 1024, 2048, 1024, 3072  # Qwen3-0.6B's


def decoder_layer_loras(max_loras: int, rank: int, max_rows: int, device: torch.device, dtype: torch.dtype):
    """The four LoRA layers, random base weights and adapters in every slot, sharing one LoRARows."""
    gen = torch.Generator(device).manual_seed(0)
    rows = LoRARows(max_rows, max_loras, device, dtype)
    rows.slot_scaling.fill_(2.0)
    layers = []
    for base in (MergedColumnParallelLinear(HIDDEN, [Q, KV, KV]), RowParallelLinear(Q, HIDDEN),
                 MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE] * 2), RowParallelLinear(INTERMEDIATE, HIDDEN)):
        base = base.to(device, dtype).requires_grad_(False)
        base.weight.normal_(0, base.in_features**-0.5, generator=gen)
        layer = LoRALinear(base, max_loras, rank, rows)
        layer.lora_a.normal_(0, base.in_features**-0.5, generator=gen)  # (A: stacked under the weight)
        layer.lora_b.normal_(0, rank**-0.5, generator=gen)
        layers.append(layer)
    return rows, layers


@torch.inference_mode()
def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="8,64" if cuda else "16", help="max_lora_rank values (comma-separated)")
    p.add_argument("--adapters", default="1,4,8" if cuda else "4", help="adapters in the step, round robin")
    p.add_argument("--rows", default="1,16,256" if cuda else "1,16", help="rows a step (decode: a sequence each)")
    p.add_argument("--repeats", type=int, default=50 if cuda else 5)
    args = p.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    ints = {name: [int(v) for v in getattr(args, name).split(",")] for name in ("ranks", "adapters", "rows")}
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"{name}: one decoder layer's qkv_proj, o_proj, gate_up_proj and down_proj (Qwen3-0.6B's), {dtype}, "
          f"{'the Triton kernel, CUDA graphs' if cuda else 'the PyTorch path'}; ms a forward of the four")
    print(f"  {'rank':>4s} {'adapters':>8s} {'rows':>5s} {'base ms':>9s} {'LoRA ms':>9s}  LoRA/base")
    for rank in ints["ranks"]:
        for adapters in ints["adapters"]:
            rows, layers = decoder_layer_loras(adapters, rank, max(ints["rows"]), device, dtype)
            for n in ints["rows"]:
                xs = [torch.randn(n, layer.base.in_features, device=device, dtype=dtype) for layer in layers]
                times = []
                for lora in (False, True):
                    # decode: the engine's choice for a step of one row a sequence (grouped past DECODE_ROWS)
                    rows.set(torch.arange(n) % adapters if lora else None, "decode" if cuda else "torch")

                    def forward(layers=layers, xs=xs):
                        for layer, x in zip(layers, xs):
                            layer(x)

                    if cuda:  # a replay, as a decode step's: its launches cost the device, not the host
                        forward()  # (Triton compiles here, outside the capture)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            forward()
                        times.append(time_call(graph.replay, device, args.repeats))
                    else:
                        times.append(time_call(forward, device, args.repeats))
                print(f"  {rank:4d} {adapters:8d} {n:5d} {1e3 * times[0]:9.4f} {1e3 * times[1]:9.4f}  "
                      f"{times[1] / times[0]:6.2f}x")


if __name__ == "__main__":
    main()
