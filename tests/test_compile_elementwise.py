"""compile_elementwise=True (layers/compile_elementwise.py): the same greedy tokens as transformers, float32."""
import pytest

from conftest import ARCHS, hf_greedy, random_prompts
from nanoserve import LLM, SamplingParams
from nanoserve.config import Config
from nanoserve.layers.activation import SiluAndMul
from nanoserve.layers.compile_elementwise import compiled_forward
from nanoserve.layers.layernorm import RMSNorm
from nanoserve.layers.rotary_embedding import RotaryEmbedding

MAX_TOKENS = 24


@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_elementwise_chains_equal_transformers(tiny_models, arch):
    # Prompts of 1 to 40 tokens: prefill batches, decode batches, and a batch of one token (Dynamo specializes 1).
    prompts = random_prompts(6, seed=5, low=1, high=40)
    llm = LLM(tiny_models[arch], block_size=16, compile_elementwise=True)
    model = llm.engine.executor.model_runner.model
    modules = [m for m in model.modules() if isinstance(m, (RMSNorm, SiluAndMul, RotaryEmbedding))]
    assert {type(m) for m in modules} == {RMSNorm, SiluAndMul, RotaryEmbedding}
    assert all(m.forward.__func__ is compiled_forward(type(m)) for m in modules)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(tiny_models[arch], prompts, MAX_TOKENS)
    one = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert one[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_compile_elementwise_is_refused_off_cpu(tiny_models):
    with pytest.raises(ValueError, match="compile_elementwise=True is for CPU"):
        Config(tiny_models["qwen3"], device="cuda", compile_elementwise=True)
