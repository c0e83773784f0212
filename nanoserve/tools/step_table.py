"""The step table: the step records of `LLM(..., trace=True)` read per sequence (its row name, its
state and the tokens it computed in each step) and printed one line per step (`format_trace`,
`print_trace`): who ran, what happened to whom, the queues, the KV blocks, the drafts accepted and
the milliseconds since the step before.
nanoserve/tools/trace_pictures.py draws the same records; nanoserve/tools/trace.py runs the scripted
scenarios.
"""
from nanoserve.step_records import StepReader, StepRecord


def adapter_names(trace: list[StepRecord]) -> dict[int, str]:
    """Each sequence that computed with a LoRA adapter -> the adapter's name (a request keeps its
    adapter)."""
    return {r.seq_id: r.lora_name for rec in trace for r in rec.scheduled if r.lora_name}


def default_names(trace: list[StepRecord]) -> dict[int, str]:
    """A row name per sequence id: its request id, and if the request has several sequences (n > 1,
    or the beams of a beam search), which one: .0, .1... in the order they came (for n > 1, the
    sequence's index)."""
    seqs = {seq_id: request_id for rec in trace
            for seq_id, (request_id, _) in rec.seq_requests.items()}
    order: dict[str, list[int]] = {}
    for seq_id in sorted(seqs):
        order.setdefault(seqs[seq_id], []).append(seq_id)
    return {seq_id: request_id if len(order[request_id]) == 1
            else f"{request_id}.{order[request_id].index(seq_id)}"
            for seq_id, request_id in seqs.items()}


def request_states(trace: list[StepRecord]) -> dict[int, list[str]]:
    """One state per sequence per step (StepReader tells them), "not arrived" before its first
    step."""
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
    """Per step, per scheduled request: the tokens it computed, "*" if it sampled nothing (a chunk
    short of the end), "@N" if it started at position N, past its own computation: the tokens before
    were cache hits; with speculative decoding, "[a/p]": of the p draft tokens it verified (counted
    in the tokens), a passed."""
    reader = StepReader()
    views = [reader.read(rec) for rec in trace]
    return [{seq_id: label + (f"[{view.spec[seq_id][0]}/{view.spec[seq_id][1]}]"
                              if seq_id in view.spec else "")
             for seq_id, label in view.labels.items()} for view in views]


def spec_totals(rec: StepRecord) -> str:
    """A step's draft tokens, all requests together: "accepted/proposed", or "-" if it verified
    none."""
    proposed = sum(len(r.spec_token_ids) for r in rec.scheduled)
    return f"{sum(r.num_accepted_tokens for r in rec.scheduled)}/{proposed}" if proposed else "-"


# ---- the step table ------------------------------------------------------------------------------
def format_trace(trace: list[StepRecord], names: dict[int, str] | None = None) -> str:
    """The articles' step table: who ran and how many tokens each (* = a chunk that sampled nothing,
    @N = started at position N, the tokens before came from the prefix cache, [a/p] = a of its p
    draft tokens accepted, +NAME = with LoRA adapter NAME), what happened to whom (beam search: "X<Y
    forked", X a new beam sharing Y's blocks; "dropped", a beam without a child, its blocks freed;
    "N freed behind window", sliding-window attention's), the queues (waiting/running/swapped), the
    KV blocks (used/free-but-cached/free) after the step, with speculative decoding the step's
    drafts accepted/proposed, and "ms since prev": the milliseconds from the step before's output to
    this one's, not the step's own time: the host's work between steps counts too, and after an idle
    wait, the wait."""
    names, loras = names or default_names(trace), adapter_names(trace)
    # (else no spec column)
    speculating = any(r.spec_token_ids for rec in trace for r in rec.scheduled)
    lines = [f"{'step':>4}  {'kind':<7}  {'batch':<30}  {'events':<26}  {'w/r/s':<8}  "
             f"{'blocks u/c/f':<12}  {'tokens/budget':<13}  "
             f"{'spec a/p  ' if speculating else ''}{'ms since prev':>13}"]
    for rec, prev, labels in zip(trace, [None, *trace], token_labels(trace)):
        batch = [f"{names[rid]}:{label}{f'+{loras[rid]}' if rid in loras else ''}"
                 for rid, label in labels.items()]
        who = {what: [names[i] for i in ids]
               for what, ids in (("preempted", rec.recomputed), ("swapped out", rec.swapped_out),
                                 ("swapped in", rec.swapped_in), ("dropped", rec.dropped),
                                 ("finished", rec.finished))}
        who["forked"] = [f"{names[child]}<{names[parent]}" for child, parent in rec.forked]
        events = [f"{' '.join(who[what])} {what}" for what in EVENTS if who[what]]
        if freed := rec.num_freed_behind_window - (prev.num_freed_behind_window if prev else 0):
            # sliding-window attention: no layer reads them again
            events.append(f"{freed} freed behind window")
        queues = f"{len(rec.waiting)}/{len(rec.running)}/{len(rec.swapped)}"
        blocks = f"{rec.num_used_blocks}/{rec.num_cached_blocks}/{rec.num_free_blocks}"
        spec = f"{spec_totals(rec):<8}  " if speculating else ""
        ms = "-" if prev is None else f"{(rec.time - prev.time) * 1e3:.1f}"  # since the step before
        tokens = f"{rec.num_scheduled_tokens}/{rec.token_budget}"
        lines.append(f"{rec.step:>4}  {rec.kind:<7}  {' '.join(batch):<30}  {', '.join(events):<26}"
                     f"  {queues:<8}  {blocks:<12}  {tokens:<13}  {spec}{ms:>13}")
    return "\n".join(lines)


# the table's order
EVENTS = ("preempted", "swapped out", "swapped in", "forked", "dropped", "finished")


def print_trace(trace: list[StepRecord], names: dict[int, str] | None = None) -> None:
    print(format_trace(trace, names))
