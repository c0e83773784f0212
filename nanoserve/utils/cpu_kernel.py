"""Builds nanoserve's C++ kernels for the CPU (nanoserve/layers/csrc/) on first use: the "cpu"
attention backend's (layers/attention.py) and the "cpu" elementwise backend's
(layers/elementwise_backend.py).

With the C++ compiler PyTorch extensions use (`torch.utils.cpp_extension`), into nanoserve's cache,
for the vector instructions PyTorch picked on this CPU (`torch.backends.cpu.get_cpu_capability()`);
later calls load it from there. Config asks it too: "auto" picks a kernel only where it builds (no
compiler, or no OpenMP as with Apple's clang: the PyTorch path).

A build takes from half a minute (2 idle cores) to minutes (busy ones), so it says so on stdout
before it starts; Config builds the two kernels side by side (utils/backends.py: build_cpu_kernels),
one compiler process each. Its folder is named by a
hash of what the binary depends on (the source, torch's version, the CPU capability, the flags):
checkouts and branches sharing one cache reuse each other's builds instead of rebuilding over them.
A finished build is known by nanoserve's own marker (<build_dir>/built, written once the kernel
loaded): with it, the kernel is imported as is, whatever else the folder holds (torch 2.14+'s
cpp_extension leaves its FileLock file `lock` behind after every build; torch 2.13's FileBaton only
after a killed one). One process builds a folder at a time, under an OS lock (flock) that dies with
its holder: whoever holds it and finds no marker knows any files there are a build killed midway
(SIGTERM, SIGKILL), and removes them. torch's lock file is never read to decide anything.
"""
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

from nanoserve.utils.default_model import cache_dir

logger = logging.getLogger(__name__)


def not_the_cuda_home_warning(record: logging.LogRecord) -> bool:
    """Importing torch.utils.cpp_extension warns "No CUDA runtime is found, using CUDA_HOME=..." on
    every machine with a CUDA toolkit (or a CUDA wheel's) and no GPU: noise for a CPU run, which
    never builds CUDA code. That warning alone is dropped; the logger's others pass."""
    return not str(record.msg).startswith("No CUDA runtime is found")


# Before anything imports cpp_extension (it warns while importing): this module is imported with
# nanoserve's Config.
logging.getLogger("torch.utils.cpp_extension").addFilter(not_the_cuda_home_warning)

CSRC = Path(__file__).parent.parent / "layers" / "csrc"
# The flags that let at::vec use the instructions PyTorch's own kernels use on this CPU.
ISA_FLAGS = {"AVX512": ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
                        "-mavx512dq", "-mfma"],
             "AVX2": ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma"]}
# Measured, -O3, 2 cores, both side by side (Config builds them so): 31-37 s each on an idle Xeon;
# 58 s each at a load average of 1, 234-253 s at 5.5 (torch 2.14, 2.15). One alone, idle: 25-30 s.
BUILD_SECONDS = "30-60 s on 2 idle cores, 4 minutes or more on 2 cores kept busy by other work"
# How long to wait for another live process building the same kernel before giving up with a
# message.
WAIT_FOR_OTHER_BUILD_S = 600.0
# Written into the build folder after a build that loaded: the only sign nanoserve reads that a
# kernel is built.
MARKER = "built"


def say(message: str) -> None:
    """To stdout, not the log: a first run must not sit silent for half a minute (scripts don't show
    INFO)."""
    print(f"nanoserve: {message}", flush=True)


def cflags_for(capability: str) -> list[str]:
    return ["-O3", "-fopenmp", f"-DCPU_CAPABILITY={capability.replace(' ', '_')}",
            *ISA_FLAGS.get(capability, [])]


def build_dir_for(source: str, capability: str) -> Path:
    """<cache>/torch_extensions/<source>-<hash of the source, torch's version, the capability and
    the flags>."""
    cflags, key = cflags_for(capability), hashlib.sha256()
    for part in ((CSRC / f"{source}.cpp").read_bytes(), torch.__version__.encode(),
                 capability.encode(), " ".join(cflags).encode(),
                 MARKER.encode()):  # (the marker: folders from before it was written)
        key.update(part + b"\0")
    return cache_dir() / "torch_extensions" / f"{source}-{key.hexdigest()[:16]}"


@contextmanager
def build_lock(build_dir: Path, source: str) -> Iterator[None]:
    """Hold the build folder alone: an flock on <build_dir>/owner (the OS frees it when its holder
    dies, however it dies), whose text names the holder for whoever waits. Then, without the marker,
    what the folder holds is what a killed build left: it is removed (torch's lock file with the
    rest: with torch 2.13 it would block)."""
    with open(build_dir / "owner", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            owner = f.read().strip() or "another process"
            start, said = time.monotonic(), False
            while True:
                time.sleep(0.1)
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    waited = time.monotonic() - start
                    if not said and waited > 1:
                        # (another rank loading the built kernel takes well under that)
                        say(f"waiting for {owner}, which is building the CPU kernel {source} "
                            f"in {build_dir}")
                        said = True
                    if waited > WAIT_FOR_OTHER_BUILD_S:
                        raise TimeoutError(f"{owner} has been building {build_dir} for over "
                                           f"{WAIT_FOR_OTHER_BUILD_S:.0f} s: end it, or delete "
                                           "that folder, and run again") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}")
        f.flush()
        if not (build_dir / MARKER).exists():
            left = sorted(path.name for path in build_dir.iterdir() if path.name != "owner")
            if left:
                say(f"a build of {source} was killed midway (it left {', '.join(left)} "
                    f"in {build_dir}): building it again from scratch")
                for name in left:
                    path = build_dir / name
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
        yield


def import_built(path: Path) -> ModuleType:
    """A kernel built before, imported as is: torch's `load` would rebuild it whenever its build
    file names another checkout's copy of the source (ninja sees a new command), though the folder's
    hash says the source is the same."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def load_cpu_kernel(source: str) -> ModuleType | str:
    """csrc/<source>.cpp compiled, or why it could not be built here (a string: "auto" then picks
    PyTorch's path)."""
    from torch.utils.cpp_extension import load  # imports setuptools: only when the kernel is wanted

    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    build_dir = build_dir_for(source, capability)
    started, compiling = time.perf_counter(), False
    built = build_dir / f"nanoserve_{source}.so"
    try:
        if (build_dir / MARKER).exists():
            # built from the same source (the folder's hash): load it, whichever
            # checkout built it, without waiting on the lock (the marker stays)
            return import_built(built)
        build_dir.mkdir(parents=True, exist_ok=True)
        with build_lock(build_dir, source):
            if (build_dir / MARKER).exists():  # another process built it while we waited
                return import_built(built)
            compiling = True
            say(f"compiling the C++ CPU kernel {source} for {capability}, once ({BUILD_SECONDS}); "
                f"later runs load it from {build_dir}")
            module = load(name=f"nanoserve_{source}", sources=[str(CSRC / f"{source}.cpp")],
                          build_directory=str(build_dir), extra_cflags=cflags_for(capability),
                          extra_ldflags=["-fopenmp"])
            # last: the build is whole
            (build_dir / MARKER).write_text(f"torch {torch.__version__}\n")
    except Exception as e:
        # no compiler, no OpenMP (Apple's clang), a failed build: say so, keep PyTorch's path
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        # On stdout where the user waited for it; a machine without a compiler hears it at INFO, not
        # every run.
        (say if compiling or isinstance(e, TimeoutError) else logger.info)(
            f"the CPU kernel {source} could not be built ({why}): the PyTorch path runs instead")
        return why
    if compiling:
        say(f"built the CPU kernel {source} in {time.perf_counter() - started:.1f} s")
    return module
