"""The "cpu" attention backend: a C++ kernel that reads each sequence's K/V in place in the paged cache.

torch_paged_attention (layers/attention.py) is the version to read: it copies a sequence's blocks out of the
pool, then runs PyTorch's SDPA on the copy. The copy costs as much as the attention itself, so on CPU the
default is csrc/paged_attention_cpu.cpp: the same three steps (scores, softmax, weighted values) walking the
block table, vectorized with PyTorch's own at::vec. It is compiled on first use (about 15 s, with the C++
compiler PyTorch extensions use) into nanoserve's cache, for the vector instructions PyTorch picked on this CPU
(ATEN_CPU_CAPABILITY), and loaded from there afterwards. Where it cannot be built (no compiler, no OpenMP)
"auto" keeps the PyTorch path.
"""
import functools
import logging
import time
from pathlib import Path
from types import ModuleType

import torch

from nanoserve.utils.default_model import cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
# The flags that let at::vec use the instructions PyTorch's own kernels use on this CPU.
ISA_FLAGS = {"AVX512": ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
             "AVX2": ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma"]}


@functools.cache
def load_cpu_attention() -> ModuleType | str:
    """The compiled kernel, or why it could not be built here (a string: "auto" then picks PyTorch's path)."""
    from torch.utils.cpp_extension import load  # imports setuptools: only when the kernel is wanted

    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    name = f"nanoserve_paged_attention_{capability.lower().replace(' ', '_')}"
    build_dir = cache_dir() / "torch_extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        module = load(name=name, sources=[str(SOURCE)], build_directory=str(build_dir),
                      extra_cflags=["-O3", "-fopenmp", f"-DCPU_CAPABILITY={capability.replace(' ', '_')}",
                                    *ISA_FLAGS.get(capability, [])], extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler, no OpenMP (Apple's clang), a failed build: say so, keep PyTorch's path
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    if (seconds := time.perf_counter() - started) > 1:
        logger.info("built the CPU attention kernel for %s in %.1f s (%s)", capability, seconds, build_dir)
    return module


def cpu_store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write this step's K/V into their slots, in the kernel's layout within each block."""
    load_cpu_attention().store_kvcache(k, v, k_cache, v_cache, slot_mapping)


def cpu_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float
                        ) -> torch.Tensor:
    """torch_paged_attention's contract (meta: its AttentionMetadata), reading the cache in place."""
    return load_cpu_attention().paged_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                                meta.cu_seqlens_q, scale)
