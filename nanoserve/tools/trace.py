"""See the scheduler at work: print and plot the step records of `LLM(..., trace=True)`.

    python -m nanoserve.tools.trace --scenario chunked [--model PATH] [--out DIR]

runs a small scripted workload (see SCENARIOS) and writes NAME.txt (the step table),
NAME_timeline.png (one row per request, coloured by its state in each step) and NAME_kv.png (the KV
pool and the token budget). In Python: `llm = LLM(..., trace=True)`, generate, then
`print_trace(llm.trace)`, `plot_timeline(llm.trace, "t.png")`, `plot_kv(llm.trace, "kv.png")`.
docs/workshop.md is a workshop built on it.
This file holds the scenarios and the command; the table is nanoserve/tools/step_table.py
(`print_trace`, `format_trace`), the pictures nanoserve/tools/trace_pictures.py (`plot_timeline`,
`plot_kv`, `plot_adapters`).
"""
import argparse
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from nanoserve import LLM, SamplingParams
from nanoserve.tools.step_table import default_names, format_trace
from nanoserve.tools.trace_pictures import plot_kv, plot_timeline


# ---- scripted workloads --------------------------------------------------------------------------
@dataclass
class Request:
    name: str
    prompt_len: int
    max_tokens: int
    arrival: int = 0  # the step it arrives before (sooner if the engine has nothing else to do)
    priority: int = 0
    shared_prefix: int = 0  # how many of its first tokens are the scenario's shared system prompt


@dataclass
class Scenario:
    title: str
    requests: list[Request]
    options: dict = field(default_factory=dict)  # LLM(...) options


SCENARIOS = {
    "default": Scenario(
        "default (nano-vllm): prefill first, LIFO preemption; 8 KV blocks of 4 tokens",
        [Request("A", 8, 8), Request("B", 6, 8), Request("C", 5, 8), Request("D", 5, 8)],
        dict(num_kvcache_blocks=8)),
    "chunked": Scenario(
        "chunked prefill: a budget of 10 tokens; R1, R2, R3 (3, 5, 12 tokens), then R4 (34)",
        [Request("R1", 3, 12), Request("R2", 5, 12), Request("R3", 12, 2),
         Request("R4", 34, 4, arrival=4)],
        dict(enable_chunked_prefill=True, max_num_batched_tokens=10, num_kvcache_blocks=24)),
    "priority": Scenario(
        "priority: L1, L2 (priority 5) run when U (priority 0) arrives; 10 KV blocks",
        [Request("L1", 12, 10, priority=5), Request("L2", 12, 10, priority=5),
         Request("U", 10, 4, arrival=3, priority=0)],
        dict(num_kvcache_blocks=10, scheduling_policy="priority")),
    "swap": Scenario(
        "swap: the default's requests, preempted ones move to host memory and back",
        [Request("A", 8, 8), Request("B", 6, 8), Request("C", 5, 8), Request("D", 5, 8)],
        dict(num_kvcache_blocks=8, preemption_mode="swap", swap_space=0.01)),
    "prefix": Scenario(
        "prefix caching: S1-S5 share a 16-token system prompt, X does not; S5 comes last",
        [Request("S1", 20, 4, shared_prefix=16), Request("S2", 19, 4, arrival=2, shared_prefix=16),
         Request("S3", 22, 4, arrival=2, shared_prefix=16),
         Request("S4", 18, 4, arrival=2, shared_prefix=16), Request("X", 10, 4, arrival=2),
         Request("S5", 21, 3, arrival=99, shared_prefix=16)],
        dict(num_kvcache_blocks=32)),
}


def run_scenario(name: str, model: str | None = None,
                 on_step: Callable[[LLM], None] | None = None) -> tuple[LLM, dict[int, str]]:
    """Run a scenario step by step (requests arrive at their step), with blocks of 4 tokens on the
    CPU so the pictures are the same for every model. Returns the engine (its trace) and the row
    names by sequence id."""
    scenario = SCENARIOS[name]
    llm = LLM(model, trace=True, block_size=4, max_model_len=128, device="cpu", **scenario.options)
    rng = random.Random(0)
    vocab = min(llm.engine.config.hf_config.vocab_size, 1000)
    system_prompt = [rng.randrange(3, vocab) for _ in range(32)]
    pending = list(scenario.requests)
    while pending or llm.engine.has_unfinished_requests():
        while pending and (pending[0].arrival <= len(llm.trace)
                           or not llm.engine.has_unfinished_requests()):
            r = pending.pop(0)
            prompt = system_prompt[:r.shared_prefix] + [rng.randrange(3, vocab) for _ in
                                                         range(r.prompt_len - r.shared_prefix)]
            params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
            # the request id names its row
            llm.engine.add_request(r.name, prompt, params, r.priority)
        llm.engine.step()
        if on_step:
            on_step(llm)
    return llm, default_names(llm.trace)


DEFAULT_OUT = "trace-out"  # in .gitignore: a run in the repository leaves nothing to commit


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=list(SCENARIOS), default="default")
    parser.add_argument("--model", default=None,
                        help="a model folder or hub id (default: the embedded model)")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help="folder for NAME.txt, NAME_timeline.png, NAME_kv.png "
                        f"(default: {DEFAULT_OUT}, which git ignores)")
    args = parser.parse_args(argv)
    llm, names = run_scenario(args.scenario, args.model)
    os.makedirs(args.out, exist_ok=True)
    table = format_trace(llm.trace, names)
    print(SCENARIOS[args.scenario].title, table, sep="\n")
    base = os.path.join(args.out, args.scenario)
    with open(base + ".txt", "w") as f:
        f.write(table + "\n")
    plot_timeline(llm.trace, base + "_timeline.png", names, SCENARIOS[args.scenario].title)
    plot_kv(llm.trace, base + "_kv.png", SCENARIOS[args.scenario].title)
    print(f"wrote {base}.txt, {base}_timeline.png, {base}_kv.png")


if __name__ == "__main__":
    main()
