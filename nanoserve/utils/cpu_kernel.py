"""Builds nanoserve's C++ kernels for the CPU (nanoserve/layers/csrc/) on first use: the "cpu" attention backend's
(layers/cpu_attention.py) and the "cpu" elementwise backend's (layers/elementwise_backend.py).

With the C++ compiler PyTorch extensions use (`torch.utils.cpp_extension`), into nanoserve's cache, for the vector
instructions PyTorch picked on this CPU (`torch.backends.cpu.get_cpu_capability()`); later calls load it from
there. Config asks it too: "auto" picks a kernel only where it builds (no compiler, or no OpenMP as with
Apple's clang: the PyTorch path).
"""
import functools
import logging
import time
from pathlib import Path
from types import ModuleType

import torch

from nanoserve.utils.default_model import cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent.parent / "layers" / "csrc"
# The flags that let at::vec use the instructions PyTorch's own kernels use on this CPU.
ISA_FLAGS = {"AVX512": ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
             "AVX2": ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma"]}


@functools.cache
def load_cpu_kernel(source: str) -> ModuleType | str:
    """csrc/<source>.cpp compiled, or why it could not be built here (a string: "auto" then picks PyTorch's path)."""
    from torch.utils.cpp_extension import load  # imports setuptools: only when the kernel is wanted

    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    name = f"nanoserve_{source}_{capability.lower().replace(' ', '_')}"
    build_dir = cache_dir() / "torch_extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        logger.info("compiling the CPU kernel %s for %s, once (about 15 s on 2 cores)", source, capability)
    started = time.perf_counter()
    try:
        module = load(name=name, sources=[str(CSRC / f"{source}.cpp")], build_directory=str(build_dir),
                      extra_cflags=["-O3", "-fopenmp", f"-DCPU_CAPABILITY={capability.replace(' ', '_')}",
                                    *ISA_FLAGS.get(capability, [])], extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler, no OpenMP (Apple's clang), a failed build: say so, keep PyTorch's path
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        logger.info("the CPU kernel %s could not be built (%s): the PyTorch path runs instead", source, why)
        return why
    if (seconds := time.perf_counter() - started) > 1:
        logger.info("built the CPU kernel %s for %s in %.1f s (%s)", source, capability, seconds, build_dir)
    return module
