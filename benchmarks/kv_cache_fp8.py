"""What kv_cache_dtype="fp8" does to the output, against "auto" (the model's dtype), on the demo model (SmolLM2-135M,
real weights, English prompts) and a tiny random-weight Qwen3 (random token ids):

- free-running: the share of greedy tokens equal to "auto"'s at the same position (bench.py's "same tokens"); after
  the first differing token the two continuations part, so this share falls with the output's length;
- teacher-forced: "auto"'s prompt + greedy output scored again under each dtype (prompt_logprobs): how often "auto"'s
  greedy token is still fp8's top-1, and the drift |logprob_fp8 - logprob_auto| of those tokens.

    python benchmarks/kv_cache_fp8.py             # float32 on the CPU, a few minutes on 2 cores
"""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, like bench.py

import nanoserve  # noqa: E402,F401  first: its thread defaults precede torch's OpenMP

# isort: split
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config  # noqa: E402

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.utils.default_model import resolve_model  # noqa: E402

TEXT_PROMPTS = ["The history of the Roman Empire begins", "To bake bread at home, you need", "def fibonacci(n):",
                "The three laws of thermodynamics are", "Once upon a time, in a small village,",
                "The capital of Australia is", "Photosynthesis is the process by which",
                "In machine learning, overfitting means"]
MAX_TOKENS = 64


def tiny_qwen3(path: str) -> str:
    """2 layers, hidden 64, random weights (seed 0; sharper logits than the default init, as in the tests)."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         tie_word_embeddings=True, initializer_range=0.2)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def measure(path: str, prompts: list[list[int]]) -> dict[str, float]:
    greedy, outputs, scores = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), {}, {}
    for kv in ("auto", "fp8"):
        llm = LLM(path, dtype="float32", kv_cache_dtype=kv, max_logprobs=1)
        outputs[kv] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        # "auto"'s continuation scored under this dtype: the logprob and rank of each of its greedy tokens
        forced = [p + out for p, out in zip(prompts, outputs["auto"])]  # ("auto" runs first)
        scored = llm.generate(forced, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        scores[kv] = [[(lp[t].logprob, lp[t].rank) for t, lp in zip(ids[len(p):], o.prompt_logprobs[len(p):])]
                      for ids, p, o in zip(forced, prompts, scored)]
        del llm
    pairs = [(a, b) for x, y in zip(outputs["auto"], outputs["fp8"]) for a, b in zip(x, y)]
    forced = [(a, b) for x, y in zip(scores["auto"], scores["fp8"]) for a, b in zip(x, y)]
    drift = torch.tensor([abs(b[0] - a[0]) for a, b in forced])
    return dict(same_tokens=sum(a == b for a, b in pairs) / len(pairs),
                top1=sum(b[1] == 1 for _, b in forced) / len(forced),
                drift_mean=drift.mean().item(), drift_p99=drift.quantile(0.99).item(), drift_max=drift.max().item())


if __name__ == "__main__":
    demo = resolve_model("default")
    tokenizer = AutoTokenizer.from_pretrained(demo)
    rows = {"demo model (SmolLM2-135M)": measure(demo, [tokenizer.encode(p) for p in TEXT_PROMPTS])}
    with tempfile.TemporaryDirectory() as tmp:
        g = torch.Generator().manual_seed(1)
        lengths = torch.randint(8, 64, (len(TEXT_PROMPTS),), generator=g).tolist()
        prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]
        rows["tiny random Qwen3"] = measure(tiny_qwen3(tmp), prompts)
    print(f"float32, {len(TEXT_PROMPTS)} prompts x {MAX_TOKENS} greedy tokens, kv_cache_dtype='fp8' against 'auto'")
    print(f"{'model':<28}{'same tokens':>12}{'top-1 kept':>12}{'|dlogprob| mean':>17}{'p99':>8}{'max':>8}")
    for name, r in rows.items():
        print(f"{name:<28}{r['same_tokens']:>12.1%}{r['top1']:>12.1%}{r['drift_mean']:>17.4f}"
              f"{r['drift_p99']:>8.3f}{r['drift_max']:>8.3f}")
