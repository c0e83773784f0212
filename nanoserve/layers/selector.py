"""vLLM's attention/selector.py, for both kinds of kernels: the functions a model's layers run, for
the backends Config chose (utils/backends.py resolves "auto" and checks a backend asked for by
name). The ModelRunner calls these once, as it builds the model and sizes the cache; a backend's
module is imported only when chosen."""
import types
from collections.abc import Callable

from torch import nn

from nanoserve.layers.attention import cpu_paged_attention
from nanoserve.layers.elementwise_backend import CPU_FORWARDS
from nanoserve.utils.cpu_kernel import load_cpu_kernel


def attention_backend(name: str) -> tuple[Callable, Callable]:
    """The (store K/V, attend) pair of a backend, as Config resolved it; all but "cpu" are imported
    only when chosen."""
    if name == "cpu":
        return load_cpu_kernel("paged_attention_cpu").store_kvcache, cpu_paged_attention
    if name == "triton":
        from nanoserve.layers.triton_attention import triton_paged_attention, triton_store_kvcache
        return triton_store_kvcache, triton_paged_attention
    from nanoserve.layers.torch_attention import store_kvcache, torch_paged_attention
    if name == "flash_attn":
        from nanoserve.layers.flash_attention import flash_paged_attention
        return store_kvcache, flash_paged_attention
    return store_kvcache, torch_paged_attention


def use_elementwise_backend(model: nn.Module, backend: str) -> None:
    """Give model's RMSNorm, SiluAndMul and RotaryEmbedding modules the backend's forward ("torch":
    their own); "triton" and "compile" are imported only when chosen."""
    if backend == "triton":
        from nanoserve.layers.triton_elementwise import TRITON_FORWARDS as forwards
    elif backend == "compile":
        from nanoserve.layers.torch_compile import compiled_forward

        forwards = {cls: compiled_forward(cls) for cls in CPU_FORWARDS}
    else:
        forwards = CPU_FORWARDS if backend == "cpu" else {}
    for module in model.modules():
        if type(module) in forwards:
            module.forward = types.MethodType(forwards[type(module)], module)
