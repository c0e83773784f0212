"""The CPU matmul path: weights reordered once for oneDNN (layers/linear.py) give the plain matmul's results,
and the engine runs on them with greedy output still equal to transformers'."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import hf_greedy, random_prompts
from nanoserve import LLM, SamplingParams
from nanoserve.layers.linear import linear, reorder_for_cpu

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_reordered_weight_multiplies_like_the_plain_one(dtype, tol):
    torch.manual_seed(0)
    w, b = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype)
    reordered = reorder_for_cpu(w)
    assert reordered.is_mkldnn and reordered.shape == w.shape
    for rows in (0, 1, 5, 33):
        x = torch.randn(rows, 128, dtype=dtype)[:, ::2]  # a strided input, as a slice of a wider tensor
        for bias in (None, b):
            expected = F.linear(x, w, bias)
            assert torch.allclose(linear(x, reordered, bias), expected, rtol=tol, atol=tol * 8)


def test_float16_and_non_x86_cpus_keep_the_plain_weight(monkeypatch):
    w = torch.randn(8, 4, dtype=torch.float16)
    assert reorder_for_cpu(w) is w  # oneDNN's float16 needs AVX512-FP16: plain matmuls then
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")  # e.g. an ARM laptop
    w = torch.randn(8, 4)
    assert reorder_for_cpu(w) is w


@needs_onednn
@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])  # tied and untied LM head
def test_engine_runs_on_reordered_weights_with_transformers_greedy_output(tiny_models, arch):
    llm = LLM(tiny_models[arch])
    model = llm.engine.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(m.weight.is_mkldnn for m in [*linears, model.lm_head])
    assert not model.model.embed_tokens.weight.is_mkldnn  # the embedding keeps the rows it looks up
    prompts = random_prompts(4, seed=3)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(tiny_models[arch], prompts, 12)
