"""The CPU matmul path: where reorders_for_onednn says the CPU can, weights are reordered once for oneDNN
(layers/onednn.py) and give the plain matmul's results; the engine runs on them with greedy output still equal to
transformers'. The AVX2 laptop's path (no oneDNN bfloat16) is exercised on any x86 machine by a subprocess
started with PyTorch's and oneDNN's ISA lowered to AVX2."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import ROOMY_POOL, assert_within_ties, hf_greedy, random_prompts
from nanoserve import LLM, SamplingParams
from nanoserve.layers.linear import linear
from nanoserve.layers.onednn import reorder_for_cpu, reorders_for_onednn

AVX2_LAPTOP = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}  # read when torch loads


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_cpu_weight_multiplies_like_the_plain_one(dtype, tol):
    torch.manual_seed(0)
    w, b = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype)
    reordered = reorder_for_cpu(w)
    assert reordered.is_mkldnn == reorders_for_onednn(dtype) and reordered.shape == w.shape
    for rows in (0, 1, 5, 33):
        x = torch.randn(rows, 128, dtype=dtype)[:, ::2]  # a strided input, as a slice of a wider tensor
        for bias in (None, b):
            expected = F.linear(x, w, bias)
            assert torch.allclose(linear(x, reordered, bias), expected, rtol=tol, atol=tol * 8)


@pytest.mark.parametrize("capability, float32, bfloat16", [
    ("AVX512", True, None),  # bfloat16: as oneDNN's own check says (ONEDNN_MAX_CPU_ISA can lower it)
    ("AVX2", True, False),  # oneDNN's bfloat16 reorder needs AVX-512: plain bfloat16 weights
    ("DEFAULT", False, False),  # no AVX2, e.g. an old x86
    ("SVE256", False, False),  # an ARM server or laptop
])
def test_the_path_follows_the_capability_pytorch_reports(monkeypatch, capability, float32, bfloat16):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    onednn = torch.backends.mkldnn.is_available()
    assert reorders_for_onednn(torch.float32) == (float32 and onednn)
    if bfloat16 is None:
        bfloat16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert reorders_for_onednn(torch.bfloat16) == (bfloat16 and onednn)
    assert not reorders_for_onednn(torch.float16)  # oneDNN's float16 needs AVX512-FP16: plain matmuls then
    w = torch.randn(8, 4, dtype=torch.bfloat16)
    assert (reorder_for_cpu(w) is w) != reorders_for_onednn(torch.bfloat16)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])  # tied and untied LM head
def test_engine_runs_on_the_cpu_weights_with_transformers_greedy_output(tiny_models, arch):
    llm = LLM(tiny_models[arch], **ROOMY_POOL)
    model = llm.engine.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(m.weight.is_mkldnn == reorders_for_onednn(torch.float32) for m in [*linears, model.lm_head])
    assert not model.model.embed_tokens.weight.is_mkldnn  # the embedding keeps the rows it looks up
    prompts = random_prompts(4, seed=3)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(tiny_models[arch], prompts, 12)


AVX2_RUN = """
import json, sys, torch
from torch import nn
from nanoserve import LLM, SamplingParams
from nanoserve.layers.onednn import reorders_for_onednn
prompts, result = json.loads(sys.argv[2]), {"capability": torch.backends.cpu.get_cpu_capability()}
for dtype in ("float32", "bfloat16"):  # (PyTorch's attention and elementwise ops: compiling the C++ kernels for
    # AVX2 would take a minute, for nothing this test checks; CI's AVX2 pass tests those kernels themselves)
    llm = LLM(sys.argv[1], dtype=dtype, num_kvcache_blocks=1024, attention_backend="torch", elementwise_backend="torch")
    model = llm.engine.model_runner.model
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)] + [model.lm_head.weight]
    result[dtype] = dict(reordered=[w.is_mkldnn for w in weights], onednn=reorders_for_onednn(getattr(torch, dtype)),
                         tokens=[o.outputs[0].token_ids for o in llm.generate(
                             prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)])
print(json.dumps(result))
"""


def test_an_avx2_cpu_runs_bfloat16_on_plain_weights(tiny_models):
    """PyTorch and oneDNN limited to AVX2 before Python starts, as on a laptop without AVX-512: float32 keeps
    oneDNN's reorder, bfloat16 multiplies plain weights (oneDNN's bfloat16 reorder would raise), and both run
    correctly: float32 equal to transformers, bfloat16 within ties of it."""
    path, prompts = tiny_models["llama"], random_prompts(4, seed=5)
    env = {**os.environ, **AVX2_LAPTOP}
    out = subprocess.run([sys.executable, "-c", AVX2_RUN, path, json.dumps(prompts)], env=env, check=True,
                         capture_output=True, text=True, timeout=300)
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["capability"] != "AVX512"  # the variable lowered it (AVX2 on x86; lower CPUs stay lower)
    fp32, bf16 = result["float32"], result["bfloat16"]
    assert not bf16["onednn"] and not any(bf16["reordered"])
    assert "bfloat16 on this CPU" in out.stderr and "dtype='float32' is faster here" in out.stderr
    assert fp32["onednn"] == (result["capability"] == "AVX2" and torch.backends.mkldnn.is_available())
    assert all(r == fp32["onednn"] for r in fp32["reordered"])
    assert fp32["tokens"] == hf_greedy(path, prompts, 12)
    assert_within_ties(path, prompts, bf16["tokens"], tie=0.1)
