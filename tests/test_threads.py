"""nanoserve's CPU thread defaults (nanoserve/utils/threads.py) reach the environment before torch loads OpenMP,
a variable the user set wins, and importing torch first is reported with what to do instead."""
import os
import subprocess
import sys

from nanoserve.utils.threads import THREAD_DEFAULTS

SHOW = f"import os; print({{name: os.environ.get(name) for name in {sorted(THREAD_DEFAULTS)!r}}})"


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in THREAD_DEFAULTS}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          check=True, timeout=120)


def test_importing_nanoserve_sets_the_defaults_before_torch_loads():
    out = run("import nanoserve, sys; assert 'torch' in sys.modules; " + SHOW)
    assert out.stdout.strip() == str(THREAD_DEFAULTS)
    assert "imported before nanoserve" not in out.stderr  # set while torch was not loaded yet
    assert THREAD_DEFAULTS == {"OMP_WAIT_POLICY": "PASSIVE"}  # the measured choice (docs/benchmarks.md)


def test_a_variable_the_user_set_wins():
    out = run("import nanoserve; " + SHOW, OMP_WAIT_POLICY="ACTIVE")
    assert out.stdout.strip() == str({"OMP_WAIT_POLICY": "ACTIVE"}) and not out.stderr


def test_torch_imported_first_is_reported_with_the_fix():
    out = run("import torch, nanoserve")
    assert "torch was imported before nanoserve" in out.stderr and "OMP_WAIT_POLICY=PASSIVE" in out.stderr
    assert not run("import torch, nanoserve", OMP_WAIT_POLICY="PASSIVE").stderr  # set in the shell: nothing to say
