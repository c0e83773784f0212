"""bench.py runs end to end on a tiny random model and writes every figure (no timing assertions)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CONFIGS

ROOT = Path(__file__).resolve().parent.parent
TINY_WORKLOAD = ["--num-prompts", "4", "--input-len", "4", "24", "--output-len", "2", "8", "--hf-batch-size", "2"]
NANOSERVE_FIGURES = {"output_tokens", "wall_s", "tokens_per_s", "ttft_p50_s", "ttft_p90_s", "tpot_p50_ms",
                     "tpot_p90_ms", "forward_s", "overhead_share"}
TRANSFORMERS_FIGURES = {"output_tokens", "wall_s", "tokens_per_s"}


@pytest.fixture(scope="module")
def config_only(tmp_path_factory) -> str:
    """A model folder with only config.json: bench.py --random-weights supplies the weights."""
    path = tmp_path_factory.mktemp("bench_model")
    CONFIGS["qwen3"]().save_pretrained(path)
    return str(path)


def run_bench(model: str, json_path: Path, *flags: str) -> dict:
    cmd = [sys.executable, "bench.py", "--model", model, "--random-weights", *TINY_WORKLOAD,
           "--json", str(json_path), *flags]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=300)
    return json.loads(json_path.read_text())


def test_nanoserve_against_transformers(config_only, tmp_path):
    report = run_bench(config_only, tmp_path / "bench.json")
    nano, hf = report["results"]["nanoserve"], report["results"]["transformers"]
    assert NANOSERVE_FIGURES <= nano.keys() and TRANSFORMERS_FIGURES <= hf.keys()
    assert nano["output_tokens"] == hf["output_tokens"] == report["workload"]["output_tokens"] > 0
    assert 0 <= nano["overhead_share"] < 1 and nano["forward_s"] > 0
    assert report["ratio"] == pytest.approx(nano["tokens_per_s"] / hf["tokens_per_s"])
    assert {"cpu", "cpu_count", "torch"} <= report["machine"].keys()


def test_shared_prefix_with_and_without_prefix_cache(config_only, tmp_path):
    report = run_bench(config_only, tmp_path / "bench.json", "--shared-prefix", "--prefix-len", "64")
    on, off = report["results"]["nanoserve (prefix cache)"], report["results"]["nanoserve (no prefix cache)"]
    assert NANOSERVE_FIGURES <= on.keys() and NANOSERVE_FIGURES <= off.keys()
    assert on["cached_prompt_tokens"] > 0 and off["cached_prompt_tokens"] == 0
    assert report["ratio"] == pytest.approx(on["tokens_per_s"] / off["tokens_per_s"])
