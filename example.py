"""Chat with a model through nanoserve: `python example.py` uses the embedded SmolLM2-135M-Instruct."""
import argparse
import time

from nanoserve import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about a paged KV cache.",
    "Give me three tips for learning a new programming language.",
    "Explain in two sentences why the sky is blue.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a model folder or hub id (default: the embedded model)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.6, help="0 for greedy")
    args = parser.parse_args()

    llm = LLM(args.model, max_model_len=1024)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    elapsed = time.perf_counter() - start

    for question, output in zip(QUESTIONS, outputs):
        print(f"\nPrompt: {question!r}\nCompletion: {output.outputs[0].text!r}")
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{num_tokens} tokens in {elapsed:.1f} s: {num_tokens / elapsed:.1f} tokens/s")


if __name__ == "__main__":
    main()
