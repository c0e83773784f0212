"""The Triton kernels compiled for a Hopper GPU (sm_90) on this machine, which has none: Triton's own compiler, from
the Python source down to the cubin (with the ptxas its wheel ships). The other Triton tests run the kernels through
the interpreter, which takes Python that Triton's compiler may reject; this catches that before a GPU run does
(tests/test_cuda.py and benchmarks/gpu_check.sh run them natively). The arguments are typed as the JIT types them
at a launch, the ones divisible by 16 marked so (how it vectorizes loads)."""
import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")  # (its wheel for Linux x86-64 has it, ptxas included)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from nanoserve.layers.triton_attention import paged_attention_kernel  # noqa: E402
from nanoserve.lora.triton_lora import lora_kernel  # noqa: E402


@pytest.fixture(autouse=True)
def compiled(monkeypatch):
    """Triton's compiler, not its interpreter, which conftest.py turns on for the other tests."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def compile_for_hopper(fn, signature: dict[str, str], constexprs: dict, divisible_by_16: tuple[str, ...]):
    fn = JITFunction(getattr(fn, "fn", fn))  # the kernel's Python function (an interpreted one, here)
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible_by_16}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32))


@pytest.mark.parametrize("expand", [False, True], ids=["shrink", "expand"])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "decode"])
def test_the_lora_kernel_compiles(expand, grouped):
    """Split-K's partial sums (4 here) written by the shrink and added up by the expand, in bfloat16."""
    pointers = dict(x_ptr="*fp32" if expand else "*bf16", w_ptr="*bf16", out_ptr="*bf16" if expand else "*fp32",
                    cols_ptr="*i32", order_ptr="*i64", starts_ptr="*i32", counts_ptr="*i32", slots_ptr="*i64",
                    scaling_ptr="*fp32")
    ints = dict.fromkeys(("K", "stride_x", "stride_w", "stride_slot", "stride_out", "stride_split"), "i32")
    kernel = compile_for_hopper(lora_kernel, {**pointers, **ints}, dict(
        NUM_PARTS=3 if expand else 1, EXPAND=expand, GROUPED=grouped, BLOCK_M=16 if grouped else 1, BLOCK_N=64,
        BLOCK_K=16 if expand else 64, SPLIT_K=4, PRECISION="tf32"), (*pointers, *ints))
    assert kernel.asm["cubin"] and ("mma.sync" in kernel.asm["ptx"]) == grouped  # tensor cores for the tiles


@pytest.mark.parametrize("cache", ["bf16", "fp8e4nv"])
def test_the_paged_attention_kernel_compiles(cache):
    """Qwen3-0.6B's decode shapes (2 query heads per KV head, head_dim 128, blocks of 16), either cache dtype."""
    pointers = dict(out_ptr="*bf16", q_ptr="*bf16", k_cache_ptr=f"*{cache}", v_cache_ptr=f"*{cache}",
                    block_tables_ptr="*i32", context_lens_ptr="*i32", cu_seqlens_q_ptr="*i32")
    strides = dict.fromkeys(("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_slot", "stride_kvh",
                             "stride_bt"), "i32")
    kernel = compile_for_hopper(paged_attention_kernel, {**pointers, "scale_log2e": "fp32", **strides, "window": "i32"},
                                dict(BLOCK_SIZE=16, GROUP=2, GROUP_PAD=2, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_Q=8,
                                     BLOCK_N=64, PRECISION="tf32"), (*pointers, *strides))
    assert kernel.asm["cubin"] and "mma.sync" in kernel.asm["ptx"]
