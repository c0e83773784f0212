"""The Triton kernels compiled for a Hopper GPU (sm_90) on any machine, with a GPU or without, and a census of their
PTX: the instructions that move and convert K/V and feed the tensor cores, counted. A kernel is compiled as the
JIT compiles it at a launch: its arguments typed, those divisible by 16 marked so (how loads get vectorized).
It tells what a kernel's loop does per element without timing it: why an fp8 KV cache is read more slowly than a
bfloat16 one, say (docs/benchmarks.md), before a GPU is lent to measure it. Each kernel's counts start with three
totals (lines with "="): its launches a decoder layer, its conversions between floating-point types, its loads of
single bytes, and the instructions of its machine code (SASS, after ptxas).

    python benchmarks/ptx_census.py                 # paged attention at decode shapes, bfloat16 and fp8 caches
    python benchmarks/ptx_census.py --block-n 128   # with 128 keys a step of its loop
    python benchmarks/ptx_census.py --lora          # and LoRA's kernel, both ways
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, like bench.py

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.knobs import nvidia  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from nanoserve.layers.triton_attention import paged_attention_kernel  # noqa: E402
from nanoserve.lora.triton_lora import lora_kernel  # noqa: E402

# PTX instructions by what they do (the first word of each kind, its suffixes kept: .b8 against .v4.b32 matters)
KINDS = ("ld.global", "cp.async", "ld.shared", "st.shared", "ldmatrix", "cvt", "prmt", "mma", "wgmma")


def compile_for_hopper(fn, signature: dict[str, str], constexprs: dict, divisible_by_16: tuple[str, ...]):
    """fn (a @triton.jit kernel, or one the interpreter wraps) compiled for sm_90, down to the cubin."""
    if os.environ.get("TRITON_INTERPRET") == "1":  # (imported with it on, Triton cannot compile in this process)
        raise ValueError("TRITON_INTERPRET=1: Triton's interpreter is on, and compiling needs it off")
    fn = JITFunction(getattr(fn, "fn", fn))
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible_by_16}
    source = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
                       constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32))


def paged_attention(cache: str, block_n: int = 64):
    """Qwen3-0.6B's decode shapes (2 query heads per KV head, head_dim 128, blocks of 16), q in bfloat16; cache:
    "bf16" or "fp8e4nv"."""
    pointers = dict(out_ptr="*bf16", q_ptr="*bf16", k_cache_ptr=f"*{cache}", v_cache_ptr=f"*{cache}",
                    block_tables_ptr="*i32", context_lens_ptr="*i32", cu_seqlens_q_ptr="*i32")
    strides = dict.fromkeys(("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_slot", "stride_kvh",
                             "stride_bt"), "i32")
    return compile_for_hopper(paged_attention_kernel, {**pointers, "scale_log2e": "fp32", **strides, "window": "i32"},
                              dict(BLOCK_SIZE=16, GROUP=2, GROUP_PAD=2, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_Q=8,
                                   BLOCK_N=block_n, PRECISION="tf32"), (*pointers, *strides))


def lora(grouped: bool):
    """A bfloat16 model's expand over qkv_proj's three parts, reading h from the stacked matmul's output."""
    pointers = dict(h_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", cols_ptr="*i32", order_ptr="*i64",
                    starts_ptr="*i64", counts_ptr="*i64", slots_ptr="*i64", scaling_ptr="*fp32")
    ints = dict.fromkeys(("R", "stride_h", "stride_w", "stride_slot", "stride_out"), "i32")
    return compile_for_hopper(lora_kernel, {**pointers, **ints}, dict(
        NUM_PARTS=3, GROUPED=grouped, BLOCK_M=16 if grouped else 1, BLOCK_N=64, BLOCK_K=16, PRECISION="tf32"),
        (*pointers, *ints))


def census(ptx: str) -> collections.Counter:
    """How many of each instruction of KINDS the PTX holds (static: a loop's body counts once)."""
    words = re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)", ptx, re.MULTILINE)
    return collections.Counter(word for word in words if word.startswith(KINDS))


# Launches a decoder layer: one attention call; LoRA's expand, once for each of its four layers (qkv_proj, o_proj,
# gate_up_proj, down_proj: the shrink is the base matmul's; tests/test_lora_triton.py counts them)
LAUNCHES = {"paged_attention_kernel": 1, "lora_kernel": 4}


def sass_instructions(cubin: bytes) -> int:
    """The machine code's instructions (static), disassembled by the nvdisasm of Triton's wheel: what ptxas left
    of the PTX (it merges and drops much of it)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvidia.nvdisasm.path, "-c", f.name], capture_output=True, text=True, check=True).stdout
    return len(re.findall(r"^\s*/\*[0-9a-f]{4}\*/\s+\S", sass, re.MULTILINE))


def totals(name: str, kernel) -> dict[str, int]:
    """The census in four figures: launches a decoder layer, conversions between floating-point types (not the
    integer ones: cvt.s64.s32 is address arithmetic), loads of single bytes (a byte-wise operand), and the
    instructions of the machine code."""
    counts, floats = census(kernel.asm["ptx"]), ("f16", "bf16", "f32", "e4m3", "e5m2")
    return {"=launches-a-decoder-layer": LAUNCHES[name.split(",")[0]],
            "=float-conversions": sum(n for word, n in counts.items()
                                      if word.startswith("cvt") and any(f".{t}" in word for t in floats)),
            "=byte-loads": sum(n for word, n in counts.items()
                               if word.startswith(("ld.", "ldmatrix")) and word.endswith((".b8", ".u8", ".s8"))),
            "=sass-instructions": sass_instructions(kernel.asm["cubin"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-n", type=int, default=64, help="keys a step of the attention kernel's loop")
    p.add_argument("--lora", action="store_true", help="also LoRA's kernel (its expand), grouped and per row")
    args = p.parse_args()
    kernels = {f"paged_attention_kernel, {cache} cache, BLOCK_N {args.block_n}": partial(paged_attention, cache,
                                                                                       args.block_n)
               for cache in ("bf16", "fp8e4nv")}
    if args.lora:
        kernels |= {f"lora_kernel, {'grouped' if grouped else 'a row each'}": partial(lora, grouped)
                    for grouped in (True, False)}
    for name, build in kernels.items():
        kernel = build()
        print(f"{name}: {kernel.asm['ptx'].count(chr(10))} lines of PTX, {kernel.metadata.shared} bytes of shared "
              f"memory, {kernel.metadata.num_warps} warps")
        counts = sorted(census(kernel.asm["ptx"]).items(), key=lambda item: (-item[1], item[0]))
        for word, n in [*totals(name, kernel).items(), *counts]:
            print(f"  {n:5d}  {word}")


if __name__ == "__main__":
    main()
