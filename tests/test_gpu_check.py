"""benchmarks/gpu_check.sh, the part of it a CPU can run: a part named on the command line runs alone, under its
time limit, and its figures reach summary.md (on a GPU machine the whole script runs: docs/benchmarks.md)."""
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_named_part_runs_alone_and_its_figures_reach_the_summary(tmp_path):
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    subprocess.run(["bash", "benchmarks/gpu_check.sh", str(tmp_path), "paged_attention", "lora_layers"], cwd=ROOT,
                   env=env, check=True, timeout=300, capture_output=True)
    status = (tmp_path / "status.txt").read_text().splitlines()
    assert len(status) == 2 and all(re.fullmatch(rf"{part}: ok, \d+ s", line)
                                    for part, line in zip(("paged_attention", "lora_layers"), status)), status
    summary = (tmp_path / "summary.md").read_text()
    assert re.search(r"^paged_attention:\n(.*\n)*?  torch, float32 cache +[\d.]+ ms", summary, re.M), summary
    # LoRA's layers: rank 16, 4 adapters, 1 and 16 rows (a CPU's default), the base model's time and LoRA's
    assert re.search(r"^lora_layers:\n(.*\n)*?    16        4    16 +[\d.]+ +[\d.]+ +[\d.]+x$", summary, re.M), summary
    assert not any((tmp_path / f"{part}.log").exists()
                   for part in ("tests", "async", "sync", "lora", "host_step", "census"))
