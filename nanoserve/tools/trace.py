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
from collections.abc import Callable
from dataclasses import dataclass, field

from matplotlib.figure import Figure  # a bare Figure draws with Agg: no GUI backend, no pyplot state
from matplotlib.patches import Patch, Rectangle

from nanoserve import LLM, SamplingParams
from nanoserve.step_records import StepReader, StepRecord

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

FORKED = "beam forked (shares its parent's blocks)"
DROPPED = ("s", "beam dropped (blocks freed)")
SPEC = "4[2/3]: 3 drafts in 4 tokens, 2 accepted (the bar)"
ACCEPTED = "#009e73"  # speculative decoding: the share of a cell's draft tokens accepted
# LoRA adapters, a colour each in the order they first run (the dashboard's too); the base model's rows: BASE.
LORA_COLOURS = ["#7b3294", "#1b7837", "#c51b7d", "#8c510a", "#01665e", "#e08214"]
BASE = "#bbbbbb"


def adapter_names(trace: list[StepRecord]) -> dict[int, str]:
    """Each sequence that computed with a LoRA adapter -> the adapter's name (a request keeps its adapter)."""
    return {r.seq_id: r.lora_name for rec in trace for r in rec.scheduled if r.lora_name}


def default_names(trace: list[StepRecord]) -> dict[int, str]:
    """A row name per sequence id: its request id, and if the request has several sequences (n > 1, or the
    beams of a beam search), which one: .0, .1... in the order they came (for n > 1, the sequence's index)."""
    seqs = {seq_id: request_id for rec in trace for seq_id, (request_id, _) in rec.seq_requests.items()}
    order: dict[str, list[int]] = {}
    for seq_id in sorted(seqs):
        order.setdefault(seqs[seq_id], []).append(seq_id)
    return {seq_id: request_id if len(order[request_id]) == 1 else f"{request_id}.{order[request_id].index(seq_id)}"
            for seq_id, request_id in seqs.items()}


def request_states(trace: list[StepRecord]) -> dict[int, list[str]]:
    """One state per sequence per step (StepReader tells them), "not arrived" before its first step."""
    states: dict[int, list[str]] = {}
    reader = StepReader()
    for t, rec in enumerate(trace):
        step = reader.read(rec).states
        for rid in step:
            states.setdefault(rid, ["not arrived"] * t)
        for rid, row in states.items():
            row.append(step.get(rid, "finished"))
    return states


def token_labels(trace: list[StepRecord]) -> list[dict[int, str]]:
    """Per step, per scheduled request: the tokens it computed, "*" if it sampled nothing (a chunk short of
    the end), "@N" if it started at position N, past its own computation: the tokens before were cache hits;
    with speculative decoding, "[a/p]": of the p draft tokens it verified (counted in the tokens), a passed."""
    reader = StepReader()
    views = [reader.read(rec) for rec in trace]
    return [{seq_id: label + (f"[{view.spec[seq_id][0]}/{view.spec[seq_id][1]}]" if seq_id in view.spec else "")
             for seq_id, label in view.labels.items()} for view in views]


def spec_totals(rec: StepRecord) -> str:
    """A step's draft tokens, all requests together: "accepted/proposed", or "-" if it verified none."""
    proposed = sum(len(r.spec_token_ids) for r in rec.scheduled)
    return f"{sum(r.num_accepted_tokens for r in rec.scheduled)}/{proposed}" if proposed else "-"


# ---- the step table -----------------------------------------------------------------------------------------
def format_trace(trace: list[StepRecord], names: dict[int, str] | None = None) -> str:
    """The articles' step table: who ran and how many tokens each (* = a chunk that sampled nothing,
    @N = started at position N, the tokens before came from the prefix cache, [a/p] = a of its p draft
    tokens accepted, +NAME = with LoRA adapter NAME), what happened to whom (beam search: "X<Y forked", X a
    new beam sharing Y's blocks; "dropped", a beam without a child, its blocks freed; "N freed behind window",
    sliding-window attention's), the queues (waiting/running/swapped), the KV blocks (used/free-but-cached/free)
    after the step, with speculative decoding the step's drafts accepted/proposed, and the milliseconds since the
    step before (in a busy engine: the step's time)."""
    names, loras = names or default_names(trace), adapter_names(trace)
    speculating = any(r.spec_token_ids for rec in trace for r in rec.scheduled)  # (else no spec column)
    lines = [f"{'step':>4}  {'kind':<7}  {'batch':<30}  {'events':<26}  {'w/r/s':<8}  {'blocks u/c/f':<12}  "
             f"{'tokens/budget':<13}  {'spec a/p  ' if speculating else ''}{'ms':>6}"]
    for rec, prev, labels in zip(trace, [None, *trace], token_labels(trace)):
        batch = [f"{names[rid]}:{label}{f'+{loras[rid]}' if rid in loras else ''}" for rid, label in labels.items()]
        who = {what: [names[i] for i in ids] for what, ids in (("preempted", rec.recomputed), ("swapped out",
               rec.swapped_out), ("swapped in", rec.swapped_in), ("dropped", rec.dropped), ("finished", rec.finished))}
        who["forked"] = [f"{names[child]}<{names[parent]}" for child, parent in rec.forked]
        events = [f"{' '.join(who[what])} {what}" for what in EVENTS if who[what]]
        if freed := rec.num_freed_behind_window - (prev.num_freed_behind_window if prev else 0):
            events.append(f"{freed} freed behind window")  # sliding-window attention: no layer reads them again
        queues = f"{len(rec.waiting)}/{len(rec.running)}/{len(rec.swapped)}"
        blocks = f"{rec.num_used_blocks}/{rec.num_cached_blocks}/{rec.num_free_blocks}"
        spec = f"{spec_totals(rec):<8}  " if speculating else ""
        ms = "-" if prev is None else f"{(rec.time - prev.time) * 1e3:.1f}"  # since the step before
        lines.append(f"{rec.step:>4}  {rec.kind:<7}  {' '.join(batch):<30}  {', '.join(events):<26}  {queues:<8}  "
                     f"{blocks:<12}  {f'{rec.num_scheduled_tokens}/{rec.token_budget}':<13}  {spec}{ms:>6}")
    return "\n".join(lines)


EVENTS = ("preempted", "swapped out", "swapped in", "forked", "dropped", "finished")  # the table's order


def print_trace(trace: list[StepRecord], names: dict[int, str] | None = None) -> None:
    print(format_trace(trace, names))


# ---- pictures -----------------------------------------------------------------------------------------------
def plot_timeline(trace: list[StepRecord], path: str, names: dict[int, str] | None = None, title: str = "") -> None:
    """One row per request (the first arrival on top), one column per step, coloured by state; the cells
    show the tokens computed as in the table (token_labels) and markers show preemptions and swaps. A request
    with a LoRA adapter has its name beside the request's."""
    names = names or default_names(trace)
    states = request_states(trace)
    request_of = {seq_id: request_id for rec in trace for seq_id, (request_id, _) in rec.seq_requests.items()}
    first_seq = {}  # a request's sequences (its beams) stay together, in the order the requests came
    for seq_id in sorted(states):
        first_seq.setdefault(request_of[seq_id], seq_id)
    ids = sorted(states, key=lambda seq_id: (first_seq[request_of[seq_id]], seq_id))
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
        drafts = {r.seq_id: r for r in rec.scheduled if r.spec_token_ids}
        for rid, label in labels.items() if label_cells else []:
            state = states[rid][t]
            box = dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none") if STATES[state][1] else None
            ax.text(t, ids.index(rid) - 0.12 * (rid in drafts), label, ha="center", va="center",
                    fontsize=8 if len(label) < 4 else 7, color="white" if state in DARK and not box else "black",
                    bbox=box)
        for rid, r in drafts.items():  # speculative decoding: a bar along the cell's foot, the drafts accepted
            y = ids.index(rid) + 0.22
            ax.add_patch(Rectangle((t - 0.4, y), 0.8, 0.16, facecolor="white", edgecolor="black", linewidth=0.5))
            ax.add_patch(Rectangle((t - 0.4, y), 0.8 * r.num_accepted_tokens / len(r.spec_token_ids), 0.16,
                                   facecolor=ACCEPTED, edgecolor="none"))
        for event, (marker, _) in MARKERS.items():
            for rid in getattr(rec, event):
                ax.plot(t - 0.5, ids.index(rid), marker=marker, color="black", markersize=9,
                        markeredgecolor="white", markeredgewidth=0.8, linestyle="none", clip_on=False)
        # Beam search, after the step: a line from each new beam's parent to its first cell; a dropped beam's end.
        for child, parent in rec.forked:
            ax.plot([t + 0.5] * 2, [ids.index(parent), ids.index(child)], color="black", linewidth=1.5,
                    marker="o", markersize=4, clip_on=False)
        for rid in rec.dropped:
            ax.plot(t + 0.5, ids.index(rid), marker=DROPPED[0], color="black", markersize=9, markeredgecolor="white",
                    markeredgewidth=0.8, linestyle="none", clip_on=False)
    loras = adapter_names(trace)
    ax.set_yticks(range(len(ids)), [f"{names[i]} ({loras[i]})" if i in loras else names[i] for i in ids])
    ax.set_xticks(range(0, num_steps, max(1, num_steps // 25)))
    ax.set_xlabel("engine step")
    ax.set_ylabel("request")
    ax.set_title(title or "requests over the steps", fontsize=10)
    used = {s for row in states.values() for s in row} - {"not arrived"}
    handles = [Patch(facecolor=STATES[s][0], hatch=STATES[s][1], edgecolor="#888888", label=STATES[s][2])
               for s in STATES if s in used]
    handles += [ax.plot([], [], marker=m, color="black", linestyle="none", label=label)[0]
                for event, (m, label) in MARKERS.items() if any(getattr(rec, event) for rec in trace)]
    if any(rec.forked for rec in trace):
        handles.append(ax.plot([], [], marker="o", markersize=4, color="black", label=FORKED)[0])
    if any(rec.dropped for rec in trace):
        handles.append(ax.plot([], [], marker=DROPPED[0], color="black", linestyle="none", label=DROPPED[1])[0])
    if any(r.spec_token_ids for rec in trace for r in rec.scheduled):
        handles.append(Patch(facecolor=ACCEPTED, edgecolor="#888888", label=SPEC))
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


def plot_adapters(trace: list[StepRecord], path: str, names: dict[int, str] | None = None, title: str = "",
                  max_loras: int | None = None) -> None:
    """Top: one row per request, a cell for each step that computed it, coloured by its LoRA adapter (grey: the
    base model), with the tokens it computed. Bottom: the distinct adapters in each step's batch, against
    max_loras (the slots on the device)."""
    names, loras = names or default_names(trace), adapter_names(trace)
    colours = {}  # adapter -> colour, in the order they first run
    for rec in trace:
        for r in rec.scheduled:
            if r.lora_name and r.lora_name not in colours:
                colours[r.lora_name] = LORA_COLOURS[len(colours) % len(LORA_COLOURS)]
    ids = sorted(names)
    fig = Figure(figsize=(min(14, max(7.5, 3 + 0.35 * len(trace))), 3.4 + 0.4 * len(ids)), dpi=100,
                 layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[max(len(ids), 2), 2])
    for t, labels in enumerate(token_labels(trace)):
        for rid, label in labels.items():
            colour = colours.get(loras.get(rid), BASE)
            top.add_patch(Rectangle((t - 0.5, ids.index(rid) - 0.5), 1, 1, facecolor=colour, edgecolor="white"))
            top.text(t, ids.index(rid), label, ha="center", va="center", fontsize=8 if len(label) < 4 else 7,
                     color="black" if colour == BASE else "white")
    top.set_xlim(-0.5, len(trace) - 0.5)
    top.set_ylim(len(ids) - 0.5, -0.5)
    top.set_yticks(range(len(ids)), [f"{names[i]} ({loras[i]})" if i in loras else names[i] for i in ids])
    top.set_ylabel("request")
    top.set_title(title or "which adapter each request computed with, step by step", fontsize=10)
    per_step = [len({r.lora_name for r in rec.scheduled if r.lora_name}) for rec in trace]
    bottom.bar(range(len(trace)), per_step, width=0.8, color="#555555", label="adapters in the step's batch")
    if max_loras is not None:
        bottom.axhline(max_loras, color="black", linestyle="--", linewidth=1.5, label=f"max_loras ({max_loras})")
    bottom.set_ylim(0, max(per_step + [max_loras or 0]) + 1)
    bottom.yaxis.get_major_locator().set_params(integer=True)
    bottom.set_ylabel("adapters")
    bottom.set_xlabel("engine step")
    bottom.set_xticks(range(0, len(trace), max(1, len(trace) // 25)))
    bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    handles = [Patch(facecolor=BASE, label="base model")]
    handles += [Patch(facecolor=c, label=f"adapter {name}") for name, c in colours.items()]
    top.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
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
