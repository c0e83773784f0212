"""Structured outputs with n-gram speculative decoding: how many drafts survive the grammar and the target, and
what it does to the time of a batch of JSON-schema requests (docs/structured_outputs.md).

Runs the same greedy requests without and with speculation (after one warm-up of each), checks that the outputs
are equal, and prints the wall time, the steps, and the draft counters (llm.stats.spec_decoding).

    python benchmarks/structured_spec.py                   # the demo model, 8 requests, k = 3
    python benchmarks/structured_spec.py --num-prompts 16 --k 5
"""
import argparse
import sys
from pathlib import Path
from time import perf_counter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, like bench.py

from nanoserve import LLM, SamplingParams  # noqa: E402  first: its thread defaults precede torch's OpenMP
from nanoserve.structured_outputs import StructuredOutputsParams  # noqa: E402

# A list of records: the keys repeat, which is what prompt lookup guesses from.
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "minItems": 4, "maxItems": 4, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "city": {"enum": ["Paris", "London", "Rome", "Berlin"]}},
    "required": ["name", "age", "city"]}}}, "required": ["people"]}
PROMPTS = ["A list of people as JSON:", "Four people and where they live, in JSON:", "The team, as JSON:",
           "Here are the users:"]


def run(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, list[list[int]]]:
    start = perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the demo model)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    args = parser.parse_args()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    results = {}
    for name, options in (("without", {}), ("with ngram", {"speculative_config": spec})):
        llm = LLM(args.model, max_model_len=512, enable_structured_outputs=True, **options)
        run(llm, prompts[:2], params)  # warm-up
        spec_stats = llm.stats.spec_decoding
        before = (llm.stats.num_steps, spec_stats.num_draft_tokens, spec_stats.num_accepted_tokens)
        seconds, token_ids = run(llm, prompts, params)
        results[name] = token_ids
        num_tokens = sum(map(len, token_ids))
        steps, drafts, accepted = (now - then for now, then in zip(
            (llm.stats.num_steps, spec_stats.num_draft_tokens, spec_stats.num_accepted_tokens), before))
        print(f"{name:>10}: {seconds:6.2f} s, {steps} steps, {num_tokens} tokens, {num_tokens / seconds:6.1f} "
              f"tokens/s, {drafts} drafts, {accepted} accepted")
        del llm
    assert results["without"] == results["with ngram"], "greedy outputs differ"
    print("outputs equal")


if __name__ == "__main__":
    main()
