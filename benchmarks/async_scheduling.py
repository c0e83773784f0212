"""How much host work does async scheduling hide under the forward? (docs/engine.md)

Runs one workload through the engine with synchronous and with async scheduling, timing every scheduler
call, input preparation, forward (with sampling) and output update, and prints: throughput, the host time per
step, the share of scheduling + input preparation that ran while a forward was running, and a timeline of two
overlapping steps. `--plot PATH` draws that timeline.

    python benchmarks/async_scheduling.py                     # the demo model, 16 requests, 32 + 64 tokens
    python benchmarks/async_scheduling.py --model PATH --num-prompts 32 --output-len 128
"""
import argparse
import sys
import threading
from pathlib import Path
from time import perf_counter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, like bench.py

import torch  # noqa: E402

from nanoserve import LLM, SamplingParams  # noqa: E402

PARTS = {"schedule": "scheduler", "prepare_inputs": "input_builder", "execute_model": "executor",
         "_update_from_output": None}  # method -> the engine attribute that owns it (None: the engine)


def instrument(engine, log: list) -> None:
    """Wrap the four parts of a step (instance attributes shadow the methods); log (part, thread, start, end)."""
    for name, owner in PARTS.items():
        obj = getattr(engine, owner) if owner else engine
        method = getattr(obj, name)

        def timed(*args, _method=method, _name=name, **kwargs):
            start = perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                log.append((_name, threading.current_thread().name, start, perf_counter()))

        setattr(obj, name, timed)


def overlap(a: tuple[float, float], spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a[1], b[1]) - max(a[0], b[0])) for b in spans)


def measure(args, async_scheduling: bool) -> tuple[dict, list]:
    llm = LLM(args.model, max_model_len=1024, async_scheduling=async_scheduling, cpu_kvcache_space=0.5)
    prompts = [[3 + (7 * i + 11 * j) % 500 for j in range(args.input_len)] for i in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    log: list = []
    instrument(llm.engine, log)
    start = perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = perf_counter() - start
    forwards = [(s, e) for name, _, s, e in log if name == "execute_model"]
    host = [(s, e) for name, _, s, e in log if name in ("schedule", "prepare_inputs")]
    host_s = sum(e - s for s, e in host)
    hidden_s = sum(overlap(h, forwards) for h in host)
    result = dict(tokens_per_s=sum(len(o.outputs[0].token_ids) for o in outputs) / wall, wall_s=wall,
                  steps=len(forwards), forward_ms=1e3 * sum(e - s for s, e in forwards) / len(forwards),
                  host_ms=1e3 * host_s / len(forwards), hidden=hidden_s / host_s,
                  update_ms=1e3 * sum(e - s for n, _, s, e in log if n == "_update_from_output") / len(forwards))
    return result, [(n, t, s - start, e - start) for n, t, s, e in log]


def two_steps(log: list) -> list:
    """What happened from the start of the middle forward to the end of the next one."""
    forwards = sorted((s, e) for n, _, s, e in log if n == "execute_model")
    (start, _), (_, end) = forwards[len(forwards) // 2 : len(forwards) // 2 + 2]
    return sorted((r for r in log if start <= r[2] <= end), key=lambda r: r[2])


def plot(rows: list, path: str) -> None:
    import matplotlib.pyplot as plt

    t0 = rows[0][2]
    lanes = sorted({thread for _, thread, _, _ in rows}, key=lambda t: t != "MainThread")
    colors = {"schedule": "tab:blue", "prepare_inputs": "tab:orange", "execute_model": "tab:green",
              "_update_from_output": "tab:red"}
    fig, ax = plt.subplots(figsize=(10, 2.4))
    for name, thread, s, e in rows:
        y = lanes.index(thread)
        ax.barh(y, 1e3 * (e - s), left=1e3 * (s - t0), color=colors[name], edgecolor="black", height=0.6)
    ax.set_yticks(range(len(lanes)), ["engine (main)" if t == "MainThread" else "executor" for t in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()],
              labels=["schedule", "prepare inputs", "forward + sample", "update"], loc="upper center",
              bbox_to_anchor=(0.5, 1.35), ncol=4, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (1 gives steadier figures on a busy "
                        "machine: spinning OpenMP threads make the forward's time swing wildly)")
    parser.add_argument("--plot", help="save the timeline of two overlapping steps as this PNG")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for async_scheduling in (False, True):
        result, log = measure(args, async_scheduling)
        print(f"async_scheduling={async_scheduling}: " + ", ".join(f"{k} {v:.3g}" for k, v in result.items()))
    t0 = None
    for name, thread, s, e in two_steps(log):
        t0 = s if t0 is None else t0
        print(f"  {thread:<22}{name:<22}{1e3 * (s - t0):8.2f} -> {1e3 * (e - t0):8.2f} ms")
    if args.plot:
        plot(two_steps(log), args.plot)


if __name__ == "__main__":
    main()
