"""The step records of `LLM(..., trace=True)` as pictures, drawn with matplotlib: `plot_timeline`
(one row per request, coloured by its state in each step), `plot_kv` (the KV pool and the token
budget) and `plot_adapters` (which LoRA adapter each request computed with). The rows, states and
cell labels come from nanoserve/tools/step_table.py, so the pictures and the table agree.
"""
# a bare Figure draws with Agg: no GUI backend, no pyplot state
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from nanoserve.step_records import StepRecord
from nanoserve.tools.step_table import adapter_names, default_names, request_states, token_labels

# ---- each request's state in each step -----------------------------------------------------------
# Okabe-Ito colours, which colour-blind readers can tell apart; the two preempted states are hatched
# too.
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
# LoRA adapters, a colour each in the order they first run (the dashboard's too); the base model's
# rows: BASE.
LORA_COLOURS = ["#7b3294", "#1b7837", "#c51b7d", "#8c510a", "#01665e", "#e08214"]
BASE = "#bbbbbb"


# ---- pictures ------------------------------------------------------------------------------------
def plot_timeline(trace: list[StepRecord], path: str, names: dict[int, str] | None = None,
                  title: str = "") -> None:
    """One row per request (the first arrival on top), one column per step, coloured by state; the
    cells show the tokens computed as in the table (token_labels) and markers show preemptions and
    swaps. A request with a LoRA adapter has its name beside the request's."""
    names = names or default_names(trace)
    states = request_states(trace)
    request_of = {seq_id: request_id for rec in trace
                  for seq_id, (request_id, _) in rec.seq_requests.items()}
    # a request's sequences (its beams) stay together, in the order the requests came
    first_seq = {}
    for seq_id in sorted(states):
        first_seq.setdefault(request_of[seq_id], seq_id)
    ids = sorted(states, key=lambda seq_id: (first_seq[request_of[seq_id]], seq_id))
    num_steps = len(trace)
    fig = Figure(figsize=(min(14, max(7.5, 3 + 0.35 * num_steps)), 2.2 + 0.4 * len(ids)), dpi=100,
                 layout="constrained")
    ax = fig.add_subplot()
    for y, rid in enumerate(ids):
        for t, state in enumerate(states[rid]):
            colour, hatch, _ = STATES[state]
            ax.add_patch(Rectangle((t - 0.5, y - 0.5), 1, 1, facecolor=colour, hatch=hatch,
                                   edgecolor="white", linewidth=0.8))
    ax.set_xlim(-0.5, num_steps - 0.5)
    ax.set_ylim(len(ids) - 0.5, -0.5)
    label_cells = num_steps <= 60
    for t, (rec, labels) in enumerate(zip(trace, token_labels(trace))):
        drafts = {r.seq_id: r for r in rec.scheduled if r.spec_token_ids}
        for rid, label in labels.items() if label_cells else []:
            state = states[rid][t]
            box = None
            if STATES[state][1]:
                box = dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none")
            ax.text(t, ids.index(rid) - 0.12 * (rid in drafts), label, ha="center", va="center",
                    fontsize=8 if len(label) < 4 else 7,
                    color="white" if state in DARK and not box else "black", bbox=box)
        for rid, r in drafts.items():
            # speculative decoding: a bar along the cell's foot, the drafts accepted
            y = ids.index(rid) + 0.22
            ax.add_patch(Rectangle((t - 0.4, y), 0.8, 0.16, facecolor="white", edgecolor="black",
                                   linewidth=0.5))
            ax.add_patch(Rectangle((t - 0.4, y),
                                   0.8 * r.num_accepted_tokens / len(r.spec_token_ids), 0.16,
                                   facecolor=ACCEPTED, edgecolor="none"))
        for event, (marker, _) in MARKERS.items():
            for rid in getattr(rec, event):
                ax.plot(t - 0.5, ids.index(rid), marker=marker, color="black", markersize=9,
                        markeredgecolor="white", markeredgewidth=0.8, linestyle="none",
                        clip_on=False)
        # Beam search, after the step: a line from each new beam's parent to its first cell; a
        # dropped beam's end.
        for child, parent in rec.forked:
            ax.plot([t + 0.5] * 2, [ids.index(parent), ids.index(child)], color="black",
                    linewidth=1.5, marker="o", markersize=4, clip_on=False)
        for rid in rec.dropped:
            ax.plot(t + 0.5, ids.index(rid), marker=DROPPED[0], color="black", markersize=9,
                    markeredgecolor="white", markeredgewidth=0.8, linestyle="none", clip_on=False)
    loras = adapter_names(trace)
    ax.set_yticks(range(len(ids)),
                  [f"{names[i]} ({loras[i]})" if i in loras else names[i] for i in ids])
    ax.set_xticks(range(0, num_steps, max(1, num_steps // 25)))
    ax.set_xlabel("engine step")
    ax.set_ylabel("request")
    ax.set_title(title or "requests over the steps", fontsize=10)
    used = {s for row in states.values() for s in row} - {"not arrived"}
    handles = [Patch(facecolor=STATES[s][0], hatch=STATES[s][1], edgecolor="#888888",
                     label=STATES[s][2])
               for s in STATES if s in used]
    handles += [ax.plot([], [], marker=m, color="black", linestyle="none", label=label)[0]
                for event, (m, label) in MARKERS.items()
                if any(getattr(rec, event) for rec in trace)]
    if any(rec.forked for rec in trace):
        handles.append(ax.plot([], [], marker="o", markersize=4, color="black", label=FORKED)[0])
    if any(rec.dropped for rec in trace):
        handles.append(ax.plot([], [], marker=DROPPED[0], color="black", linestyle="none",
                               label=DROPPED[1])[0])
    if any(r.spec_token_ids for rec in trace for r in rec.scheduled):
        handles.append(Patch(facecolor=ACCEPTED, edgecolor="#888888", label=SPEC))
    fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    fig.savefig(path)


def plot_kv(trace: list[StepRecord], path: str, title: str = "") -> None:
    """Top: the KV pool after each step, blocks in use / free but cached / free. Bottom: the tokens
    each step computed, prefill and decode, against the token budget."""
    steps = [rec.step for rec in trace]
    used = [rec.num_used_blocks for rec in trace]
    cached = [rec.num_cached_blocks for rec in trace]
    free = [rec.num_free_blocks - rec.num_cached_blocks for rec in trace]
    fig = Figure(figsize=(min(16, 5 + 0.35 * len(trace)), 5.2), dpi=100, layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.bar(steps, used, width=0.8, color=STATES["decode"][0],
            label="in use (held by running requests)")
    top.bar(steps, cached, width=0.8, bottom=used, color="#009e73",
            label="free, still cached (a prefix can hit)")
    top.bar(steps, free, width=0.8, bottom=[u + c for u, c in zip(used, cached)], color="#dddddd",
            label="free")
    top.set_ylabel("KV blocks")
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    fig.suptitle(title or "the KV pool after each step, and the tokens each step computed",
                 fontsize=10)
    prefill = [sum(r.num_tokens for r in rec.scheduled if not r.is_decode) for rec in trace]
    decode = [sum(r.num_tokens for r in rec.scheduled if r.is_decode) for rec in trace]
    bottom.bar(steps, prefill, width=0.8, color=STATES["prefill"][0], label="prefill tokens")
    bottom.bar(steps, decode, width=0.8, bottom=prefill, color=STATES["decode"][0],
               label="decode tokens")
    budget = trace[0].token_budget if trace else 0
    most = max((p + d for p, d in zip(prefill, decode)), default=0)
    if budget <= 2 * most:
        bottom.axhline(budget, color="black", linestyle="--", linewidth=1.5,
                       label=f"token budget ({budget})")
        bottom.set_ylim(0, budget * 1.15)
    else:
        bottom.text(0.99, 0.92, f"token budget {budget}: off the chart", transform=bottom.transAxes,
                    ha="right", va="top", fontsize=8)
    bottom.set_ylabel("tokens computed")
    bottom.set_xlabel("engine step")
    bottom.set_xticks(range(0, len(trace), max(1, len(trace) // 25)))
    bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    fig.savefig(path)


def plot_adapters(trace: list[StepRecord], path: str, names: dict[int, str] | None = None,
                  title: str = "", max_loras: int | None = None) -> None:
    """Top: one row per request, a cell for each step that computed it, coloured by its LoRA adapter
    (grey: the base model), with the tokens it computed. Bottom: the distinct adapters in each
    step's batch, against max_loras (the slots on the device)."""
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
            top.add_patch(Rectangle((t - 0.5, ids.index(rid) - 0.5), 1, 1, facecolor=colour,
                                    edgecolor="white"))
            top.text(t, ids.index(rid), label, ha="center", va="center",
                     fontsize=8 if len(label) < 4 else 7,
                     color="black" if colour == BASE else "white")
    top.set_xlim(-0.5, len(trace) - 0.5)
    top.set_ylim(len(ids) - 0.5, -0.5)
    top.set_yticks(range(len(ids)),
                   [f"{names[i]} ({loras[i]})" if i in loras else names[i] for i in ids])
    top.set_ylabel("request")
    top.set_title(title or "which adapter each request computed with, step by step", fontsize=10)
    per_step = [len({r.lora_name for r in rec.scheduled if r.lora_name}) for rec in trace]
    bottom.bar(range(len(trace)), per_step, width=0.8, color="#555555",
               label="adapters in the step's batch")
    if max_loras is not None:
        bottom.axhline(max_loras, color="black", linestyle="--", linewidth=1.5,
                       label=f"max_loras ({max_loras})")
    bottom.set_ylim(0, max(per_step + [max_loras or 0]) + 1)
    bottom.yaxis.get_major_locator().set_params(integer=True)
    bottom.set_ylabel("adapters")
    bottom.set_xlabel("engine step")
    bottom.set_xticks(range(0, len(trace), max(1, len(trace) // 25)))
    bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    handles = [Patch(facecolor=BASE, label="base model")]
    handles += [Patch(facecolor=c, label=f"adapter {name}") for name, c in colours.items()]
    top.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8,
               frameon=False)
    fig.savefig(path)
