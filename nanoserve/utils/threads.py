"""The CPU thread setup nanoserve starts with: OpenMP threads that sleep when they wait
(docs/benchmarks.md).

PyTorch runs each CPU kernel on OpenMP threads, one per core. By default a thread that finishes its
share spins before it sleeps, waiting for the others and for the next kernel. On a machine where
another process wants a core (a browser, a second notebook), the spinning threads take the time
slices that the thread everyone waits for needs, and each step takes many times longer.
OMP_WAIT_POLICY=PASSIVE makes a waiting thread sleep at once: measured on 2 cores, 0-7% slower when
nothing else runs, 1.7-2.3x faster with one core busy, 4.7-8.7x with two.

OpenMP reads its variables once, when PyTorch loads it (at `import torch`), so
`nanoserve/__init__.py` calls set_thread_defaults before anything imports torch; processes started
later (tensor-parallel workers) inherit them. A variable already set wins:
`OMP_WAIT_POLICY=ACTIVE python example.py` spins again. No torch import here: this module runs
before torch loads.
"""
import logging
import os
import sys

THREAD_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}

logger = logging.getLogger(__name__)


def set_thread_defaults() -> None:
    """Sets THREAD_DEFAULTS in the environment, except variables the user set. If torch was imported
    first, its OpenMP has read the environment already: then this says so and what to do instead."""
    missing = {name: value for name, value in THREAD_DEFAULTS.items() if name not in os.environ}
    os.environ.update(missing)
    if missing and "torch" in sys.modules:
        settings = " ".join(f"{name}={value}" for name, value in missing.items())
        logger.warning("torch was imported before nanoserve, so its threads keep spinning while "
                       "they wait, which is many times slower when another process uses the cores; "
                       "import nanoserve first, or start Python with %s", settings)
