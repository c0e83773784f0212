"""When does each pipeline stage compute? A timeline of every rank's forwards, one step at a time and with one
batch in flight per stage (docs/parallelism.md, docs/images/pipeline_timeline.png).

    python benchmarks/pipeline_timeline.py [MODEL] --out docs/images/pipeline_timeline.png

Each rank appends the start and end of its stage's layers (from the end of Stage.receive_or_embed to the start of
Stage.send_or_norm: waiting for the previous stage is not work) to a file; spawned workers re-import this script,
so the wrappers below are in place on every rank (one per stage: rank = stage).
"""
import argparse
import os
import tempfile
import time

from nanoserve.parallel.pipeline import Stage

LOG = os.environ.setdefault("NANOSERVE_TIMELINE", tempfile.mkdtemp(prefix="timeline-"))
receive_or_embed, send_or_norm, started = Stage.receive_or_embed, Stage.send_or_norm, [0.0]


def timed_receive_or_embed(self, *args):
    result = receive_or_embed(self, *args)
    started[0] = time.time()
    return result


def timed_send_or_norm(self, *args):
    with open(os.path.join(LOG, f"rank{self.index}.txt"), "a") as f:
        f.write(f"{started[0]} {time.time()}\n")
    return send_or_norm(self, *args)


Stage.receive_or_embed, Stage.send_or_norm = timed_receive_or_embed, timed_send_or_norm


def run(model: str, async_scheduling: bool, num_prompts: int) -> dict[int, list[tuple[float, float]]]:
    """Generate with 2 stages; returns each rank's forwards as (start, end), seconds from the first."""
    from nanoserve import LLM, SamplingParams

    for name in os.listdir(LOG):
        os.remove(os.path.join(LOG, name))
    llm = LLM(model, pipeline_parallel_size=2, async_scheduling=async_scheduling)
    prompts = [[100 + i] * 32 for i in range(num_prompts)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    del llm
    spans = {}
    for rank in (0, 1):
        with open(os.path.join(LOG, f"rank{rank}.txt")) as f:
            spans[rank] = [tuple(map(float, line.split())) for line in f]
    t0 = min(s for v in spans.values() for s, _ in v)
    return {rank: [(s - t0, e - t0) for s, e in v] for rank, v in spans.items()}


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None, help="a model folder (default: the demo model)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--out", default="pipeline_timeline.png")
    args = p.parse_args()
    from nanoserve.utils.default_model import resolve_model

    model = resolve_model(args.model)
    runs = [(False, "one step at a time (async_scheduling=False)"),
            (True, "2 batches in flight (async_scheduling=True)")]
    fig, axes = plt.subplots(2, 1, figsize=(10, 4.2), sharex=True)
    for ax, (flag, title) in zip(axes, runs):
        spans = run(model, flag, args.num_prompts)
        busy = {rank: sum(e - s for s, e in v) for rank, v in spans.items()}
        end = max(e for v in spans.values() for _, e in v)
        for rank, v in spans.items():
            ax.broken_barh([(s, e - s) for s, e in v], (1 - rank - 0.4, 0.8), color=f"C{rank}")
        ax.set_yticks([1, 0], [f"stage {r} (rank {r}): busy {busy[r] / end:.0%}" for r in (0, 1)])
        ax.set_title(f"{title}: {end:.2f} s")
        print(f"{title}: {end:.2f} s, stage 0 busy {busy[0] / end:.0%}, stage 1 busy {busy[1] / end:.0%}")
    axes[-1].set_xlabel("seconds (each bar: one step's forward through the stage's layers)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
