"""The workshop's LoRA chapter (docs/workshop.md): train a small adapter, serve it and the base
model in one batch, and draw which requests used it, step by step (docs/images/lora_steps.png).

    python -m nanoserve.tools.lora_picture [--model PATH] [--adapter DIR] [--train-steps N]
        [--out PATH]

Training, with peft on the CPU (a minute or two on two cores): the demo model answers eight
questions itself, greedily; the adapter learns the first sentence of each answer in a fixed style,
"Arr, matey!" in front. Then one LLM(enable_lora=True, trace=True) serves new questions, every other
one with the adapter, arriving a few steps apart, and prints each answer beside the adapter it used.
"""
import argparse
import os
from time import perf_counter

import torch

from nanoserve import LLM, LoRARequest, SamplingParams
from nanoserve.tools.step_table import print_trace
from nanoserve.tools.trace_pictures import plot_adapters
from nanoserve.utils.default_model import resolve_model

STYLE = "Arr, matey! "  # what the adapter learns to put before every answer
TRAIN = ["What is the capital of France?", "How many legs does a spider have?",
         "What colour is the sky?", "Name a fruit.", "What is two plus two?", "What do bees make?",
         "Where do penguins live?", "Who wrote Hamlet?"]
ASK = ["What is the capital of Italy?", "How many wheels does a bicycle have?",
       "What colour is grass?", "Name a vegetable.", "What is three plus four?",
       "What do spiders eat?"]
MAX_TOKENS = 24


def chat_ids(tokenizer, question: str) -> list[int]:
    """The question through the chat template, up to where the assistant's answer starts."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def train_adapter(model: str, folder: str, steps: int = 12, seed: int = 0) -> str:
    """A rank-8 LoRA on q, k, v and o, trained on the first sentence of the model's own greedy
    answers with STYLE in front; saved in PEFT's format (adapter_config.json,
    adapter_model.safetensors) in folder."""
    from peft import LoraConfig, get_peft_model  # (pip install peft)
    from transformers import AutoModelForCausalLM

    llm = LLM(model, max_model_len=256, num_kvcache_blocks=64)
    tokenizer = llm.tokenizer
    answers = llm.chat([[{"role": "user", "content": q}] for q in TRAIN],
                       SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    del llm
    # (token ids, labels): the loss counts the answer only, the prompt's labels are -100
    examples = []
    for question, answer in zip(TRAIN, answers):
        prompt = chat_ids(tokenizer, question)
        sentence = answer.outputs[0].text.strip().split(". ")[0].rstrip(".") + "."
        target = tokenizer.encode(STYLE + sentence, add_special_tokens=False)
        target.append(tokenizer.eos_token_id)
        examples.append((prompt + target, [-100] * len(prompt) + target))
    width = max(len(ids) for ids, _ in examples)

    def pad(rows: list[list[int]], value: int) -> torch.Tensor:
        return torch.tensor([r + [value] * (width - len(r)) for r in rows])

    input_ids = pad([ids for ids, _ in examples], tokenizer.eos_token_id)
    labels = pad([lab for _, lab in examples], -100)
    mask = pad([[1] * len(ids) for ids, _ in examples], 0)
    torch.manual_seed(seed)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                                LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=3e-3)
    peft_model.train()
    start = perf_counter()
    for step in range(steps):  # the whole set, one batch a step
        loss = peft_model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 5 == 0 or step == steps - 1:
            print(f"training step {step}: loss {loss.item():.3f} ({perf_counter() - start:.0f} s)")
    peft_model.save_pretrained(folder)
    return folder


def serve(model: str, adapter: str, arrive_every: int = 2) -> tuple[LLM, dict[int, str], list[str]]:
    """ASK's questions, one arriving every arrive_every steps, every other one with the adapter, all
    in one engine. Returns the engine (its trace), the row names, and each answer's line."""
    llm = LLM(model, enable_lora=True, max_loras=1, max_lora_rank=8, trace=True, max_model_len=256,
              num_kvcache_blocks=64)
    pirate = LoRARequest("pirate", 1, adapter)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    pending = [(f"Q{i + 1}", question, pirate if i % 2 else None) for i, question in enumerate(ASK)]
    tokens: dict[str, list[int]] = {}
    while pending or llm.engine.has_unfinished_requests():
        if pending and len(llm.trace) >= arrive_every * (len(ASK) - len(pending)):
            request_id, question, lora = pending.pop(0)
            llm.engine.add_request(request_id, chat_ids(llm.tokenizer, question), greedy,
                                   lora_request=lora)
        for out in llm.engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    def answer(i: int) -> str:
        return llm.tokenizer.decode(tokens[f"Q{i + 1}"], skip_special_tokens=True).strip()

    lines = [f"Q{i + 1} ({'pirate' if i % 2 else 'base'}) {q} -> {answer(i)!r}"
             for i, q in enumerate(ASK)]
    names = {seq_id: request_id for rec in llm.trace
             for seq_id, (request_id, _) in rec.seq_requests.items()}
    return llm, names, lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help="a model folder (default: the embedded demo model)")
    parser.add_argument("--adapter", default="lora-out/pirate",
                        help="where the adapter is saved (default: "
                        "lora-out/pirate, which git ignores); trained only if it is not there yet")
    parser.add_argument("--train-steps", type=int, default=12)
    parser.add_argument("--out", default="lora-out/lora_steps.png", help="the picture")
    args = parser.parse_args(argv)
    # (peft loads the folder with transformers: the demo model's, converted)
    model = resolve_model(args.model)
    if not os.path.isfile(os.path.join(args.adapter, "adapter_config.json")):
        train_adapter(model, args.adapter, args.train_steps)
    llm, names, lines = serve(model, args.adapter)
    print_trace(llm.trace, names)
    print("\n".join(lines))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    plot_adapters(llm.trace, args.out, names, "the base model and adapter pirate in one engine: "
                  "Q2, Q4, Q6 use the adapter", max_loras=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
