"""What bench.py reports: progress lines while it runs, the machine it ran on, and the table and JSON at the end.

A run takes minutes (the default 3 to 17 on 2 cores, with the load: README.md): every leg says when it starts,
how far it has come and when it ends, so a run cut short (benchmarks/gpu_check.sh's time limits) still shows what
it measured.
"""
import json
import os
import platform
from dataclasses import dataclass
from time import perf_counter

import nanoserve  # noqa: F401  first: its CPU thread defaults (nanoserve/utils/threads.py) precede torch's OpenMP

# isort: split
import numpy as np
import torch
import transformers

STARTED = perf_counter()


def progress(message: str) -> None:
    """A line as each long phase starts or moves on: a run of several minutes must not sit silent."""
    print(f"bench: {message} ({perf_counter() - STARTED:.0f} s in)", flush=True)


@dataclass
class Countdown:
    """Called with the requests a leg has finished so far: says so each time another `parts`-th of them is done
    (the transformers leg of the default run once printed nothing for 8 minutes)."""

    label: str
    total: int
    parts: int = 8
    shown: int = 0  # parts said so far

    def __call__(self, done: int) -> None:
        if (part := done * self.parts // max(self.total, 1)) > self.shown:
            self.shown = part
            progress(f"{self.label}: {done} of {self.total} requests done")


def percentiles(values: list[float]) -> tuple[float, float]:
    return (float(np.percentile(values, 50)), float(np.percentile(values, 90))) if values else (0.0, 0.0)


def same_tokens(token_ids: list[list[int]], reference: list[list[int]]) -> float:
    """Share of output tokens equal to the reference's at the same position (1.0: identical outputs)."""
    pairs = [(a, b) for x, y in zip(token_ids, reference) for a, b in zip(x, y)]
    return sum(a == b for a, b in pairs) / max(len(pairs), 1)


def machine() -> dict:
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return dict(cpu=cpu, cpu_capability=torch.backends.cpu.get_cpu_capability(), cpu_count=os.cpu_count(),
                torch_threads=torch.get_num_threads(), gpu=gpu,
                thread_env={k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_"))},
                torch=torch.__version__, transformers=transformers.__version__,
                load_avg_1min=os.getloadavg()[0])  # other work on the machine skews CPU timings


def print_table(results: dict, ratios: dict[str, float], bandwidth: float) -> None:
    head = (f"{'engine':<32}{'tok/s':>9}{'wall s':>9}{'TTFT p50/p90 s':>17}{'TPOT p50/p90 ms':>18}"
            f"{'overhead':>10}{'same tokens':>13}")
    print(head + "\n" + "-" * len(head))
    for name, r in results.items():
        line = f"{name:<32}{r['tokens_per_s']:>9.1f}{r['wall_s']:>9.2f}"
        if "ttft_p50_s" in r:
            line += f"{r['ttft_p50_s']:>8.2f} / {r['ttft_p90_s']:<6.2f}"
            line += f"{r['tpot_p50_ms']:>9.1f} / {r['tpot_p90_ms']:<6.1f}"
            line += f"{r['overhead_share']:>9.1%}" if "overhead_share" in r else " " * 9
        else:
            line += " " * 44
        if "same_tokens" in r:
            line += f"{r['same_tokens']:>13.1%}"
        print(line)
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x output tokens/s")
    for name, r in results.items():
        if "read_bytes_per_s" in r:
            print(f"{name}: the forward read {r['bytes_read'] / r['steps'] / 1e6:.1f} MB a step (weights and KV), "
                  f"{r['read_bytes_per_s'] / 1e9:.1f} GB/s: {r['bandwidth_share']:.0%} of the measured "
                  f"{bandwidth / 1e9:.1f} GB/s")
        if "num_preemptions" in r:  # what the KV pool held: the memory-bound scenario's figures
            print(f"{name}: a KV pool of {r['num_kvcache_blocks']} blocks ({r['kv_cache_bytes'] / 1e6:.1f} MB) ran "
                  f"{r['running_seqs_mean']:.1f} sequences a step (at most {r['running_seqs_max']}), "
                  f"{r['num_preemptions']} preemptions")


def write_json(report: dict, path: str | None) -> dict:
    """The report as JSON at --json's path, if one was given."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
    return report
