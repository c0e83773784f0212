"""Which kernels run here: the attention and elementwise backends Config's "auto" resolves to, and
the checks for one asked for by name (a ValueError naming the option when it cannot run on this
device, dtype or machine)."""
import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor

from nanoserve.utils.cpu_kernel import load_cpu_kernel


def pick_attention_backend(name: str, device: str, dtype: str, kv_cache_dtype: str = "auto") -> str:
    """Resolve "auto" (flash-attn, else Triton on CUDA; on CPU the C++ kernel in float32 where it
    builds, else PyTorch), or check that `name` can run here. flash-attn 2 reads no fp8 cache: with
    it, "auto" skips flash-attn."""
    choices = ("auto", "flash_attn", "triton", "cpu", "torch")
    if name not in choices:
        raise ValueError(f"attention_backend must be one of {choices}, got {name!r}")
    installed = {b: importlib.util.find_spec(b) is not None for b in ("flash_attn", "triton")}
    if kv_cache_dtype == "fp8" and name == "flash_attn":
        raise ValueError("kv_cache_dtype='fp8' is read by the triton, cpu and torch attention "
                         "backends, not flash_attn")
    if name == "auto" and device == "cuda":
        usable = ("triton",) if kv_cache_dtype == "fp8" else ("flash_attn", "triton")
        return next((b for b in usable if installed[b]), "torch")
    if name == "auto":
        return "cpu" if cpu_kernel_runs("paged_attention_cpu", device, dtype) else "torch"
    if name == "flash_attn" and not installed[name]:
        raise ValueError(f"attention_backend={name!r}, but {name} is not installed")
    if name == "flash_attn" and device != "cuda":
        raise ValueError(f"attention_backend='flash_attn' needs CUDA, but device is {device!r}")
    if name == "triton":
        check_triton("attention_backend", device)
    if name == "cpu":
        check_cpu_kernel("attention_backend", "paged_attention_cpu", device, dtype)
    return name


def check_triton(field: str, device: str) -> None:
    """field='triton' asks for Triton kernels: installed, and on CUDA or (slowly, for tests)
    Triton's interpreter."""
    if importlib.util.find_spec("triton") is None:
        raise ValueError(f"{field}='triton', but triton is not installed")
    if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{field}='triton' on device {device!r} needs Triton's interpreter (slow, "
                         "for tests): export TRITON_INTERPRET=1 before starting Python")


def build_cpu_kernels(attention_backend: str, elementwise_backend: str, device: str,
                      dtype: str) -> None:
    """Where both C++ kernels may be wanted, build (or load) them side by side before the picks ask:
    each build is one compiler process, so 2 cores build both in 43 s instead of 62 s one after the
    other (a first run's wait)."""
    backends = {attention_backend, elementwise_backend}
    if device == "cpu" and dtype == "float32" and backends <= {"auto", "cpu"}:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(load_cpu_kernel, ["paged_attention_cpu", "elementwise_cpu"]))


def cpu_kernel_runs(source: str, device: str, dtype: str) -> bool:
    """What "auto" asks: nanoserve's C++ kernel csrc/<source>.cpp is float32 on the CPU, and must
    build here."""
    return device == "cpu" and dtype == "float32" and not isinstance(load_cpu_kernel(source), str)


def check_cpu_kernel(field: str, source: str, device: str, dtype: str) -> None:
    """field='cpu' asks for nanoserve's C++ kernel csrc/<source>.cpp: float32, on the CPU, and it
    must build."""
    if device != "cpu" or dtype != "float32":
        raise ValueError(f"{field}='cpu' is a float32 kernel for the CPU, got device {device!r} "
                         f"and dtype {dtype!r}")
    if isinstance(why := load_cpu_kernel(source), str):
        raise ValueError(f"{field}='cpu': the kernel could not be built here ({why})")


def pick_elementwise_backend(name: str, device: str, dtype: str) -> str:
    """RMSNorm, SwiGLU and RoPE (layers/elementwise_backend.py): "torch" (eager, the code to read),
    "cpu" (C++, one pass each), "triton" (one kernel each), "compile" (torch.compile). "auto":
    "triton" on CUDA where it is installed; "cpu" on the CPU in float32 where it builds; else
    "torch"."""
    choices = ("auto", "torch", "cpu", "triton", "compile")
    if name not in choices:
        raise ValueError(f"elementwise_backend must be one of {choices}, got {name!r}")
    if name == "auto" and device == "cuda":
        return "triton" if importlib.util.find_spec("triton") is not None else "torch"
    if name == "auto":
        return "cpu" if cpu_kernel_runs("elementwise_cpu", device, dtype) else "torch"
    if name == "cpu":
        check_cpu_kernel("elementwise_backend", "elementwise_cpu", device, dtype)
    if name == "triton":
        check_triton("elementwise_backend", device)
    if name == "compile" and device != "cpu":
        raise ValueError("elementwise_backend='compile' is for the CPU (not tried with CUDA "
                         f"graphs), got device {device!r}")
    return name
