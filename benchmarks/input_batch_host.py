"""Host time per step of building a step's inputs (InputBuilder.prepare_inputs: token ids, positions, slot
mapping, block tables, sampling metadata), without a model: N running requests decode, one token a step. Both
ways: the core's plain loops, and the persistent input batch (nanoserve/persistent_batch.py) plugged in.

    python benchmarks/input_batch_host.py                  # 16, 64 and 256 running requests
    python benchmarks/input_batch_host.py --num-seqs 64 --steps 200
"""
import argparse
import random
import sys
from pathlib import Path
from time import perf_counter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, like bench.py

import nanoserve  # noqa: E402,F401  first: its thread defaults precede torch's OpenMP

# isort: split
import torch  # noqa: E402

from nanoserve.engine.block_manager import BlockManager  # noqa: E402
from nanoserve.engine.model_runner import InputBuilder  # noqa: E402
from nanoserve.engine.scheduler import SchedulerOutput  # noqa: E402
from nanoserve.engine.sequence import Sequence  # noqa: E402
from nanoserve.persistent_batch import InputBatch  # noqa: E402
from nanoserve.sampling_params import SamplingParams  # noqa: E402

BLOCK_SIZE, VOCAB = 16, 49152  # the engine's CPU block size, the demo model's vocabulary


def decode_steps(num_seqs: int, steps: int, sampled: bool, persistent: bool, seed: int = 0) -> list[float]:
    """Seconds of prepare_inputs per step: prompts of 32-512 tokens (bench.py's default workload), prefilled,
    then `steps` decode steps planned as the scheduler plans them (a slot for the new token, then the plan)."""
    rng = random.Random(seed)
    blocks = BlockManager(num_blocks=num_seqs * 64, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=10**6) if sampled else \
        SamplingParams(temperature=0, max_tokens=10**6)
    seqs = []
    for i in range(num_seqs):
        seq = Sequence(i, [rng.randrange(VOCAB) for _ in range(rng.randint(32, 512))], params, BLOCK_SIZE)
        blocks.allocate(seq)
        seq.num_computed_tokens = len(seq)
        seq.append_token(rng.randrange(VOCAB))
        seqs.append(seq)
    builder = (InputBatch if persistent else InputBuilder)(block_size=BLOCK_SIZE, vocab_size=VOCAB,
                                                           eos_token_ids=[0], device=torch.device("cpu"))
    times = []
    for _ in range(steps):
        out = SchedulerOutput()
        for seq in seqs:
            blocks.may_append(seq)
            out.add(seq, 1)
            seq.num_computed_tokens += 1
        start = perf_counter()
        builder.prepare_inputs(out)
        times.append(perf_counter() - start)
        for seq in seqs:
            seq.append_token(rng.randrange(VOCAB))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-seqs", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    torch.set_num_threads(1)
    print("running | sampling    | inputs     | prepare_inputs per step, median (p90) | per request")
    for n in args.num_seqs:
        for sampled in (False, True):
            for persistent in (False, True):
                times = sorted(decode_steps(n, args.steps, sampled, persistent)[10:])  # the first steps warm up
                med, p90 = times[len(times) // 2], times[int(len(times) * 0.9)]
                print(f"{n:7d} | {'T=0.8 top_p' if sampled else 'greedy':11s} | "
                      f"{'persistent' if persistent else 'plain':10s} | {med * 1e3:7.3f} ms ({p90 * 1e3:.3f})"
                      f" | {med / n * 1e6:.2f} us")


if __name__ == "__main__":
    main()
