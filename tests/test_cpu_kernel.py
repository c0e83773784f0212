"""Building the C++ CPU kernels (nanoserve/utils/cpu_kernel.py): said on stdout, keyed by what the binary depends
on, and never a silent wait behind a build that died."""
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from nanoserve.utils import cpu_kernel
from nanoserve.utils.backends import build_cpu_kernels
from nanoserve.utils.cpu_kernel import build_dir_for, load_cpu_kernel

ROOT = Path(__file__).resolve().parent.parent
# A run that takes longer than this hangs: one build is 25-30 s on 2 idle cores; tests run beside other work (174 s
# seen for both kernels at a load average of 6 on 2 cores).
HANG_S = 600
BUILD = "from nanoserve.utils.cpu_kernel import load_cpu_kernel; print(load_cpu_kernel('elementwise_cpu'))"
needs_compiler = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


def test_the_build_folder_is_keyed_by_source_torch_and_capability(tmp_path, monkeypatch):
    """Checkouts and branches sharing one cache reuse a build only where the binary would be the same."""
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    folder = build_dir_for("elementwise_cpu", "AVX512")
    assert folder.parent == tmp_path / "torch_extensions" and folder.name.startswith("elementwise_cpu-")
    assert build_dir_for("elementwise_cpu", "AVX512") == folder
    assert build_dir_for("elementwise_cpu", "AVX2") != folder
    assert build_dir_for("paged_attention_cpu", "AVX512").name.startswith("paged_attention_cpu-")
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert build_dir_for("elementwise_cpu", "AVX512") != folder
    monkeypatch.undo()
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    source = (cpu_kernel.CSRC / "elementwise_cpu.cpp").read_text()
    (csrc / "elementwise_cpu.cpp").write_text(source + "\n// another checkout's edit\n")
    monkeypatch.setattr(cpu_kernel, "CSRC", csrc)
    assert build_dir_for("elementwise_cpu", "AVX512") != folder


def test_a_live_builder_is_waited_for_with_a_message_then_a_timeout_that_says_what_to_do(tmp_path, monkeypatch,
                                                                                         capsys):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernel, "WAIT_FOR_OTHER_BUILD_S", 1.5)  # (it speaks up after 1 s)
    folder = build_dir_for("elementwise_cpu", torch.backends.cpu.get_cpu_capability())
    folder.mkdir(parents=True)
    with open(folder / "owner", "w") as owner:  # another process, alive, building: it holds the OS lock
        owner.write("pid 4242")
        owner.flush()
        fcntl.flock(owner, fcntl.LOCK_EX)
        why = load_cpu_kernel.__wrapped__("elementwise_cpu")
    out = capsys.readouterr().out
    assert f"waiting for pid 4242, which is building the CPU kernel elementwise_cpu in {folder}" in out
    assert why.startswith("TimeoutError: pid 4242 has been building") and "delete that folder" in why
    assert "could not be built" in out  # said, not only logged


@needs_compiler
def test_a_build_killed_midway_then_a_real_build_then_a_load_that_compiles_nothing(tmp_path):
    """SIGTERM during the compile leaves the folder without nanoserve's marker (no `finally` runs); the next run
    must see the build is unfinished, say so, build, and finish: before, it waited for torch's lock file to go
    away, silently, forever. Then the third process loads that build as is: with torch 2.14+, whose cpp_extension
    leaves its FileLock file `lock` after every build, every run used to take it for a killed build and compile
    again (a `lock` file is put there for torches that remove it, as 2.14+ leave it)."""
    env = {**os.environ, "NANOSERVE_CACHE": str(tmp_path)}
    first = subprocess.Popen([sys.executable, "-c", BUILD], cwd=ROOT, env=env, start_new_session=True,
                             stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + HANG_S
    while not list(tmp_path.glob("torch_extensions/*/*.ninja")) and first.poll() is None:  # the compiler runs
        assert time.monotonic() < deadline, "the first build never started"
        time.sleep(0.05)
    time.sleep(1)
    os.killpg(first.pid, signal.SIGTERM)  # python and its compiler, as a terminal's job control would
    out, _ = first.communicate(timeout=30)
    assert first.returncode == -signal.SIGTERM
    assert "compiling the C++ CPU kernel elementwise_cpu" in out  # said before it started
    [folder] = tmp_path.glob("torch_extensions/elementwise_cpu-*")
    assert not (folder / cpu_kernel.MARKER).exists()  # not built: no marker
    second = subprocess.run([sys.executable, "-c", BUILD], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=HANG_S)
    assert second.returncode == 0, second.stderr
    assert "a build of elementwise_cpu was killed midway (it left " in second.stdout
    assert "compiling the C++ CPU kernel elementwise_cpu" in second.stdout  # the real build, whole
    assert "built the CPU kernel elementwise_cpu in" in second.stdout
    assert "<module 'nanoserve_elementwise_cpu'" in second.stdout
    assert (folder / cpu_kernel.MARKER).read_text() == f"torch {torch.__version__}\n"
    (folder / "lock").touch()  # what torch 2.14+'s FileLock leaves behind
    built = {path.name: path.stat().st_mtime_ns for path in folder.iterdir()}
    third = subprocess.run([sys.executable, "-c", BUILD], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=HANG_S)
    assert third.returncode == 0, third.stderr
    assert third.stdout.startswith("<module 'nanoserve_elementwise_cpu'")  # loaded without a word: no compile
    assert {path.name: path.stat().st_mtime_ns for path in folder.iterdir()} == built  # nothing rebuilt or removed


def test_importing_the_cpp_extension_on_a_cpu_machine_says_nothing_of_cuda(tmp_path):
    """A CUDA build of torch (what a bare `pip install torch` gives) warns "No CUDA runtime is found, using
    CUDA_HOME=..." when torch.utils.cpp_extension is imported on a machine with a CUDA toolkit and no GPU: nanoserve
    drops that warning, and only it. The record is also logged by hand, for a CPU build of torch, which never warns."""
    env = {**os.environ, "CUDA_HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    code = ("import logging\n{}import torch.utils.cpp_extension\n"
            "log = logging.getLogger('torch.utils.cpp_extension')\n"
            "log.warning(\"No CUDA runtime is found, using CUDA_HOME='%s'\", '/usr/local/cuda')\n"
            "log.warning('another warning')\n")
    quiet, bare = (subprocess.run([sys.executable, "-c", code.format(first)], cwd=ROOT, env=env, capture_output=True,
                                  text=True, timeout=HANG_S) for first in ("import nanoserve\n", ""))
    assert quiet.returncode == 0, quiet.stderr
    assert "No CUDA runtime" not in quiet.stderr and "another warning" in quiet.stderr
    assert "No CUDA runtime is found" in bare.stderr  # (without nanoserve: the test can fail)


def test_both_kernels_build_side_by_side(monkeypatch):
    """Config asks for both C++ kernels at once where both may be wanted: each build waits here for the other to
    have started (a barrier that builds one after the other would never pass)."""
    barrier, asked = threading.Barrier(2, timeout=30), []

    def build(source: str) -> str:
        barrier.wait()
        asked.append(source)
        return "not built in this test"

    monkeypatch.setattr("nanoserve.utils.backends.load_cpu_kernel", build)
    build_cpu_kernels("auto", "auto", "cpu", "float32")
    assert sorted(asked) == ["elementwise_cpu", "paged_attention_cpu"]
    asked.clear()
    for options in (("torch", "auto", "cpu", "float32"), ("auto", "auto", "cpu", "bfloat16")):
        build_cpu_kernels(*options)  # one kernel wanted at most, or none: nothing is built ahead
    assert asked == []
