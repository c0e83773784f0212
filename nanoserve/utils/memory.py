import ctypes
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's malloc.h
KEEP_BYTES = 2**31 - 1  # mallopt takes an int


def keep_freed_memory() -> None:
    """CPU: ask glibc to keep freed memory for reuse instead of giving it back to the OS.

    Each step allocates and frees the same large activations. By default glibc maps allocations over
    32 MiB fresh from the OS and unmaps them when freed (and trims the heap), so every step
    page-faults its memory in again, which can cost as much as the math on a small model. PyTorch's
    CUDA caching allocator avoids this on GPUs; on CPU this switch does (vLLM's CPU backend preloads
    tcmalloc for it). It affects the whole process, and the process keeps its peak memory until it
    exits.
    """
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl)
        return
    libc.mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)  # serve allocations up to 2 GiB from the heap ...
    libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES)  # ... and don't shrink the heap when they are freed
