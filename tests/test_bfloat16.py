"""bfloat16 on CPU (AVX-512-BF16 / AMX make it about twice as fast as float32): greedy output equal to
float32 within ties.

bfloat16 keeps 8 bits of mantissa, so where float32's two best logits are nearly equal the argmax may flip,
and after a flip the two sequences continue differently. The test measures both: the share of tokens
equal to float32's (documented in docs/benchmarks.md), and, teacher-forced in float32 on bfloat16's own
output, that every token bfloat16 picked was within a tie of float32's best logit.
"""
import pytest

from conftest import ARCHS, assert_within_ties, random_prompts
from nanoserve import LLM, SamplingParams

TIE = 0.1  # logits; the tiny models' logits spread with std ~1.6, and measured flips were at gaps <= 0.05
MIN_SAME_SHARE = 0.75  # measured 0.81-0.88 on these models (8 prompts x 16 tokens)


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_greedy_equals_float32_within_ties(tiny_models, arch):
    path = tiny_models[arch]
    prompts = random_prompts(8, seed=1)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    fp32, bf16 = ([o.outputs[0].token_ids for o in LLM(path, device="cpu", dtype=dtype).generate(
        prompts, params, use_tqdm=False)] for dtype in ("float32", "bfloat16"))
    same = sum(a == b for x, y in zip(fp32, bf16) for a, b in zip(x, y)) / sum(map(len, fp32))
    assert same >= MIN_SAME_SHARE

    assert_within_ties(path, prompts, bf16, TIE)
