"""See the scheduler at work: print and plot the step records of `LLM(..., trace=True)`.

    python -m nanoserve.tools.trace --scenario chunked [--model PATH] [--out DIR]

runs a small scripted workload (see SCENARIOS) and writes NAME.txt (the step table), NAME_timeline.png (one
row per request, coloured by its state in each step) and NAME_kv.png (the KV pool and the token budget).
In Python: `llm = LLM(..., trace=True)`, generate, then `print_trace(llm.trace)`, `plot_timeline(llm.trace,
"t.png")`, `plot_kv(llm.trace, "kv.png")`. docs/workshop.md is a workshop built on it.
"""
import argparse
import os
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from matplotlib.figure import Figure  # a bare Figure draws with Agg: no GUI backend, no pyplot state
from matplotlib.patches import Patch, Rectangle

from nanoserve import LLM, SamplingParams
from nanoserve.engine.trace import StepRecord

# ---- each request's state in each step -------------------------------------------------------------------
# Okabe-Ito colours, which colour-blind readers can tell apart; the two preempted states are hatched too.
STATES = {  # state: (colour, hatch, legend label)
    "not arrived": ("#ffffff", "", "not arrived"),
    "waiting": ("#cccccc", "", "waiting"),
    "prefill": ("#e69f00", "", "prefill (a chunk or a whole prompt)"),
    "decode": ("#0072b2", "", "decode"),
    "idle": ("#56b4e9", "", "running, not scheduled this step"),
    "preempted": ("#d55e00", "///", "preempted: waiting, then recomputing"),
    "swapped": ("#cc79a7", "...", "swapped out to host memory"),
    "finished": ("#e5f4ef", "", "finished"),
}
DARK = {"decode", "preempted"}  # states whose cells get white text
MARKERS = {  # event: (marker, legend label)
    "recomputed": ("X", "preempted (recompute)"),
    "swapped_out": ("v", "swapped out"),
    "swapped_in": ("^", "swapped in"),
}


def default_names(trace: list[StepRecord]) -> dict[int, str]:
    """A row name per sequence id: its request id, with the sequence's index if the request has n > 1."""
    seqs = {seq_id: place for rec in trace for seq_id, place in rec.seq_requests.items()}
    num_seqs = Counter(request_id for request_id, _ in seqs.values())
    return {seq_id: request_id if num_seqs[request_id] == 1 else f"{request_id}.{index}"
            for seq_id, (request_id, index) in seqs.items()}


def request_states(trace: list[StepRecord]) -> dict[int, list[str]]:
    """One state per sequence per step, from the records (a preempted request stays "preempted" until its
    recomputed prefill reaches its end again)."""
    states: dict[int, list[str]] = {}
    recomputing: set[int] = set()
    for t, rec in enumerate(trace):
        scheduled = {r.seq_id: r for r in rec.scheduled}
        recomputing |= set(rec.recomputed) - scheduled.keys()
        for rid in [*rec.waiting, *rec.running, *rec.swapped, *rec.finished]:
            states.setdefault(rid, ["not arrived"] * t)
        for rid, row in states.items():
            if rid in scheduled:
                r = scheduled[rid]
                row.append("preempted" if rid in recomputing else "decode" if r.is_decode else "prefill")
                if r.sampled:
                    recomputing.discard(rid)
            elif rid in rec.swapped:
                row.append("swapped")
            elif rid in rec.waiting:
                row.append("preempted" if rid in recomputing else "waiting")
            elif rid in rec.running:
                row.append("idle")
            else:
                row.append("finished")
    return states


def token_labels(trace: list[StepRecord]) -> list[dict[int, str]]:
    """Per step, per scheduled request: the tokens it computed, "*" if it sampled nothing (a chunk short of
    the end), "@N" if it started at position N, past its own computation: the tokens before were cache hits."""
    computed: dict[int, int] = {}  # how far each request's own computation got (0 again after a recompute)
    labels = []
    for rec in trace:
        step = {}
        for r in rec.scheduled:
            at = f"@{r.start}" if r.start != computed.get(r.seq_id, 0) else ""
            step[r.seq_id] = f"{r.num_tokens}{at}{'' if r.sampled else '*'}"
            computed[r.seq_id] = r.start + r.num_tokens
        computed.update((rid, 0) for rid in rec.recomputed)
        labels.append(step)
    return labels


# ---- the step table -----------------------------------------------------------------------------------------
def format_trace(trace: list[StepRecord], names: dict[int, str] | None = None) -> str:
    """The articles' step table: who ran and how many tokens each (* = a chunk that sampled nothing,
    @N = started at position N, the tokens before came from the prefix cache), what happened to whom,
    the queues (waiting/running/swapped), the KV blocks (used/free-but-cached/free) after the step, and the
    milliseconds since the step before (in a busy engine: the step's time)."""
    names = names or default_names(trace)
    lines = [f"{'step':>4}  {'kind':<7}  {'batch':<30}  {'events':<26}  {'w/r/s':<8}  {'blocks u/c/f':<12}  "
             f"{'tokens/budget':<13}  {'ms':>6}"]
    for rec, prev, labels in zip(trace, [None, *trace], token_labels(trace)):
        batch = [f"{names[rid]}:{label}" for rid, label in labels.items()]
        events = [f"{' '.join(names[i] for i in ids)} {what}" for what, ids in (("preempted", rec.recomputed),
                  ("swapped out", rec.swapped_out), ("swapped in", rec.swapped_in), ("finished", rec.finished)) if ids]
        queues = f"{len(rec.waiting)}/{len(rec.running)}/{len(rec.swapped)}"
        blocks = f"{rec.num_used_blocks}/{rec.num_cached_blocks}/{rec.num_free_blocks}"
        ms = "-" if prev is None else f"{(rec.time - prev.time) * 1e3:.1f}"  # since the step before
        lines.append(f"{rec.step:>4}  {rec.kind:<7}  {' '.join(batch):<30}  {', '.join(events):<26}  {queues:<8}  "
                     f"{blocks:<12}  {f'{rec.num_scheduled_tokens}/{rec.token_budget}':<13}  {ms:>6}")
    return "\n".join(lines)


def print_trace(trace: list[StepRecord], names: dict[int, str] | None = None) -> None:
    print(format_trace(trace, names))


# ---- pictures -----------------------------------------------------------------------------------------------
def plot_timeline(trace: list[StepRecord], path: str, names: dict[int, str] | None = None, title: str = "") -> None:
    """One row per request (the first arrival on top), one column per step, coloured by state; the cells
    show the tokens computed as in the table (token_labels) and markers show preemptions and swaps."""
    names = names or default_names(trace)
    states = request_states(trace)
    ids = sorted(states)
    num_steps = len(trace)
    fig = Figure(figsize=(min(14, max(7.5, 3 + 0.35 * num_steps)), 2.2 + 0.4 * len(ids)), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for y, rid in enumerate(ids):
        for t, state in enumerate(states[rid]):
            colour, hatch, _ = STATES[state]
            ax.add_patch(Rectangle((t - 0.5, y - 0.5), 1, 1, facecolor=colour, hatch=hatch, edgecolor="white",
                                   linewidth=0.8))
    ax.set_xlim(-0.5, num_steps - 0.5)
    ax.set_ylim(len(ids) - 0.5, -0.5)
    label_cells = num_steps <= 60
    for t, (rec, labels) in enumerate(zip(trace, token_labels(trace))):
        for rid, label in labels.items() if label_cells else []:
            state = states[rid][t]
            box = dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none") if STATES[state][1] else None
            ax.text(t, ids.index(rid), label, ha="center", va="center", fontsize=8 if len(label) < 4 else 7,
                    color="white" if state in DARK and not box else "black", bbox=box)
        for event, (marker, _) in MARKERS.items():
            for rid in getattr(rec, event):
                ax.plot(t - 0.5, ids.index(rid), marker=marker, color="black", markersize=9,
                        markeredgecolor="white", markeredgewidth=0.8, linestyle="none", clip_on=False)
    ax.set_yticks(range(len(ids)), [names[i] for i in ids])
    ax.set_xticks(range(0, num_steps, max(1, num_steps // 25)))
    ax.set_xlabel("engine step")
    ax.set_ylabel("request")
    ax.set_title(title or "requests over the steps", fontsize=10)
    used = {s for row in states.values() for s in row} - {"not arrived"}
    handles = [Patch(facecolor=STATES[s][0], hatch=STATES[s][1], edgecolor="#888888", label=STATES[s][2])
               for s in STATES if s in used]
    handles += [ax.plot([], [], marker=m, color="black", linestyle="none", label=label)[0]
                for event, (m, label) in MARKERS.items() if any(getattr(rec, event) for rec in trace)]
    fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    fig.savefig(path)


def plot_kv(trace: list[StepRecord], path: str, title: str = "") -> None:
    """Top: the KV pool after each step, blocks in use / free but cached / free. Bottom: the tokens each
    step computed, prefill and decode, against the token budget."""
    steps = [rec.step for rec in trace]
    used = [rec.num_used_blocks for rec in trace]
    cached = [rec.num_cached_blocks for rec in trace]
    free = [rec.num_free_blocks - rec.num_cached_blocks for rec in trace]
    fig = Figure(figsize=(min(16, 5 + 0.35 * len(trace)), 5.2), dpi=100, layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.bar(steps, used, width=0.8, color=STATES["decode"][0], label="in use (held by running requests)")
    top.bar(steps, cached, width=0.8, bottom=used, color="#009e73", label="free, still cached (a prefix can hit)")
    top.bar(steps, free, width=0.8, bottom=[u + c for u, c in zip(used, cached)], color="#dddddd", label="free")
    top.set_ylabel("KV blocks")
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    fig.suptitle(title or "the KV pool after each step, and the tokens each step computed", fontsize=10)
    prefill = [sum(r.num_tokens for r in rec.scheduled if not r.is_decode) for rec in trace]
    decode = [sum(r.num_tokens for r in rec.scheduled if r.is_decode) for rec in trace]
    bottom.bar(steps, prefill, width=0.8, color=STATES["prefill"][0], label="prefill tokens")
    bottom.bar(steps, decode, width=0.8, bottom=prefill, color=STATES["decode"][0], label="decode tokens")
    budget = trace[0].token_budget if trace else 0
    most = max((p + d for p, d in zip(prefill, decode)), default=0)
    if budget <= 2 * most:
        bottom.axhline(budget, color="black", linestyle="--", linewidth=1.5, label=f"token budget ({budget})")
        bottom.set_ylim(0, budget * 1.15)
    else:
        bottom.text(0.99, 0.92, f"token budget {budget}: off the chart", transform=bottom.transAxes,
                    ha="right", va="top", fontsize=8)
    bottom.set_ylabel("tokens computed")
    bottom.set_xlabel("engine step")
    bottom.set_xticks(range(0, len(trace), max(1, len(trace) // 25)))
    bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    fig.savefig(path)


# ---- scripted workloads ----------------------------------------------------------------------------------
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
        [Request("R1", 3, 12), Request("R2", 5, 12), Request("R3", 12, 2), Request("R4", 34, 4, arrival=4)],
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
         Request("S3", 22, 4, arrival=2, shared_prefix=16), Request("S4", 18, 4, arrival=2, shared_prefix=16),
         Request("X", 10, 4, arrival=2), Request("S5", 21, 3, arrival=99, shared_prefix=16)],
        dict(num_kvcache_blocks=32)),
}


def run_scenario(name: str, model: str | None = None,
                 on_step: Callable[[LLM], None] | None = None) -> tuple[LLM, dict[int, str]]:
    """Run a scenario step by step (requests arrive at their step), with blocks of 4 tokens on the CPU so the
    pictures are the same for every model. Returns the engine (its trace) and the row names by sequence id."""
    scenario = SCENARIOS[name]
    llm = LLM(model, trace=True, block_size=4, max_model_len=128, device="cpu", **scenario.options)
    rng = random.Random(0)
    vocab = min(llm.engine.config.hf_config.vocab_size, 1000)
    system_prompt = [rng.randrange(3, vocab) for _ in range(32)]
    pending = list(scenario.requests)
    while pending or llm.engine.has_unfinished_requests():
        while pending and (pending[0].arrival <= len(llm.trace) or not llm.engine.has_unfinished_requests()):
            r = pending.pop(0)
            prompt = system_prompt[:r.shared_prefix] + [rng.randrange(3, vocab) for _ in
                                                         range(r.prompt_len - r.shared_prefix)]
            params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
            llm.engine.add_request(r.name, prompt, params, r.priority)  # the request id names its row
        llm.engine.step()
        if on_step:
            on_step(llm)
    return llm, default_names(llm.trace)


DEFAULT_OUT = "trace-out"  # in .gitignore: a run in the repository leaves nothing to commit


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=list(SCENARIOS), default="default")
    parser.add_argument("--model", default=None, help="a model folder or hub id (default: the embedded model)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="folder for NAME.txt, NAME_timeline.png, NAME_kv.png "
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
