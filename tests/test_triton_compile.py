"""The Triton kernels compiled for a Hopper GPU (sm_90) on this machine, which has none: Triton's own compiler, from
the Python source down to the cubin (with the ptxas its wheel ships), by `python benchmarks/ptx_census.py --lora`
in a process of its own (conftest.py turns Triton's interpreter on in this one). The other Triton tests run the
kernels through the interpreter, which takes Python that Triton's compiler may reject; this catches that before a
GPU run does (tests/test_cuda.py and benchmarks/gpu_check.sh run them natively)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")  # (Triton's wheel for Linux x86-64 has it, ptxas included)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def census() -> dict[str, dict[str, int]]:
    """Each kernel's header line, and its PTX instructions of interest, counted."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ptx_census.py"), "--lora"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    kernels: dict[str, dict[str, int]] = {}
    for line in run.stdout.splitlines():
        if not line.startswith(" "):
            kernels[line.split(":")[0]] = counts = {}
        else:
            n, word = line.split()
            counts[word] = int(n)
    return kernels


def uses(counts: dict[str, int], prefix: str, *parts: str) -> bool:
    return any(word.startswith(prefix) and all(part in word for part in parts) for word in counts)


@pytest.mark.parametrize("cache", ["bf16", "fp8e4nv"])
def test_the_paged_attention_kernel_compiles(census, cache):
    counts = census[f"paged_attention_kernel, {cache} cache, BLOCK_N 64"]
    assert uses(counts, "mma") and uses(counts, "cp.async")  # tensor cores; K/V copied ahead of their use
    # an fp8 cache's values are converted in the loop (e4m3 to float16, two at a time), a bfloat16 one's are not;
    # over an fp8 cache the dots run in float16, so no value takes a second conversion (float16 to bfloat16)
    assert uses(counts, "cvt", "e4m3") == (cache == "fp8e4nv")
    assert uses(counts, "mma", "f16.f16") == (cache == "fp8e4nv") and not uses(counts, "cvt.bf16.f16")
    # V reaches the tensor cores as 16-bit values from either cache (an fp8 one's read in pairs), through
    # ldmatrix.trans: no byte loads (an fp8 cache's V took 64 ld.shared.b8 a thread and loop step before)
    assert uses(counts, "ldmatrix", "trans") and counts["=byte-loads"] == 0
    assert counts["=launches-a-decoder-layer"] == 1


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "a-row-each"])
def test_the_lora_kernel_compiles(census, grouped):
    """The expand, reading h from the stacked matmul's output, in bfloat16."""
    counts = census[f"lora_kernel, {'grouped' if grouped else 'a row each'}"]
    assert uses(counts, "mma") == grouped  # tensor cores for a tile of rows, none for one row
    assert counts["=launches-a-decoder-layer"] == 4  # (tests/test_lora_triton.py counts them)


def test_the_census_says_why_it_cannot_compile_with_the_interpreter_on(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import ptx_census

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (conftest.py's setting, said out loud)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1: Triton's interpreter is on"):
        ptx_census.paged_attention("bf16")
