"""Step records for `LLM(..., trace=True)`: what each engine step ran, moved and finished, with the queues and
the KV pool after it. `nanoserve/tools/trace.py` prints and plots them; the server's dashboard
(`nanoserve serve --dashboard`) streams them. With neither on, nothing here runs."""
from dataclasses import dataclass
from time import perf_counter

from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledRequest:
    request_id: int
    num_tokens: int  # tokens computed this step
    start: int  # position of the first of them (num_computed_tokens before the step)
    sampled: bool  # the step reached the request's end, so a next token was sampled (async scheduling: maybe dropped)
    is_decode: bool  # computed just its newest token, one the model generated


@dataclass
class StepRecord:
    step: int
    kind: str  # "prefill", "decode", "mixed", or "idle" (everyone was preempted)
    scheduled: list[ScheduledRequest]
    recomputed: list[int]  # preempted, KV dropped: the request computes its tokens again later
    swapped_out: list[int]  # preempted, KV copied to host memory
    swapped_in: list[int]  # KV copied back from host memory
    finished: list[int]
    waiting: list[int]  # the queues after the step, as request ids
    running: list[int]
    swapped: list[int]
    num_used_blocks: int  # KV blocks held by running requests
    num_cached_blocks: int  # free blocks that still hold a prefix a later prompt can hit
    num_free_blocks: int  # all free blocks, the cached ones included
    num_scheduled_tokens: int
    token_budget: int  # max_num_batched_tokens
    time: float  # wall clock (perf_counter()) when the step's output was taken in


def record_step(step: int, out: SchedulerOutput, updated: list[Sequence], scheduler: Scheduler) -> StepRecord:
    """Read a step off its plan and what it left: who finished (of the sequences postprocess updated), the
    queues, the KV pool. With async scheduling these are read when the output comes in, the next step planned."""
    scheduled = [ScheduledRequest(seq.seq_id, n, start, sample, n == 1 and start >= seq.num_prompt_tokens)
                 for seq, n, start, sample in zip(out.seqs, out.num_scheduled_tokens, out.num_computed_tokens,
                                                  out.do_sample)]
    decodes = [r.is_decode for r in scheduled]
    kind = "idle" if not scheduled else "decode" if all(decodes) else "mixed" if any(decodes) else "prefill"
    swapped = [seq.status == SequenceStatus.SWAPPED for seq in out.preempted]
    swapped_in_blocks = {device_block for _, device_block in out.blocks_to_swap_in}
    bm = scheduler.block_manager
    return StepRecord(
        step, kind, scheduled,
        recomputed=[seq.seq_id for seq, s in zip(out.preempted, swapped) if not s],
        swapped_out=[seq.seq_id for seq, s in zip(out.preempted, swapped) if s],
        swapped_in=[seq.seq_id for seq in out.seqs if seq.block_table and seq.block_table[0] in swapped_in_blocks],
        finished=[seq.seq_id for seq in updated if seq.is_finished],
        waiting=[seq.seq_id for seq in scheduler.waiting],
        running=[seq.seq_id for seq in scheduler.running],
        swapped=[seq.seq_id for seq in scheduler.swapped],
        num_used_blocks=bm.num_blocks - bm.num_free_blocks,
        num_cached_blocks=sum(bm.blocks[i].ref_count == 0 and bm.blocks[i].hash == h
                              for h, i in bm.hash_to_block_id.items()),
        num_free_blocks=bm.num_free_blocks,
        num_scheduled_tokens=sum(out.num_scheduled_tokens),
        token_budget=scheduler.max_num_batched_tokens,
        time=perf_counter(),
    )


@dataclass
class StepView:
    """One step as the step table, the timeline and the dashboard show it (StepReader.read)."""

    states: dict[int, str]  # each request in the step's queues or batch, or finished in it: its state
    labels: dict[int, str]  # each scheduled request: its tokens ("8"), "*" if it sampled nothing, "@N" if it
    # started at position N, past its own computation: the N tokens before came from the prefix cache
    hits: dict[int, int]  # prefills that started past their own computation: how many tokens the cache gave


class StepReader:
    """Reads the records in order and tells each request's state in each step: "waiting", "prefill" (a whole
    prompt or a chunk), "decode", "idle" (running, not scheduled), "preempted" (waiting or computing again
    after a recompute preemption, until it samples again), "swapped" or "finished"."""

    def __init__(self) -> None:
        self.recomputing: set[int] = set()  # preempted to recompute, not yet back where they were
        self.computed: dict[int, int] = {}  # how far each request's own computation got (0 after a recompute)
        self.live: set[int] = set()  # the requests in the queues after the step before

    def read(self, rec: StepRecord) -> StepView:
        scheduled = {r.request_id: r for r in rec.scheduled}
        self.recomputing |= set(rec.recomputed) - scheduled.keys()
        labels, hits = {}, {}
        for r in rec.scheduled:
            at = r.start != self.computed.get(r.request_id, 0)
            labels[r.request_id] = f"{r.num_tokens}{f'@{r.start}' if at else ''}{'' if r.sampled else '*'}"
            if at and not r.is_decode:
                hits[r.request_id] = r.start
            self.computed[r.request_id] = r.start + r.num_tokens
        states = dict.fromkeys(rec.finished, "finished")
        states |= dict.fromkeys(rec.running, "idle")
        states |= {rid: "preempted" if rid in self.recomputing else "waiting" for rid in rec.waiting}
        states |= dict.fromkeys(rec.swapped, "swapped")
        for rid, r in scheduled.items():
            states[rid] = "preempted" if rid in self.recomputing else "decode" if r.is_decode else "prefill"
            if r.sampled:
                self.recomputing.discard(rid)
        self.computed.update((rid, 0) for rid in rec.recomputed)
        # A request out of every queue has finished (or was aborted) for good: forget it, a step later (with async
        # scheduling, the step in flight when it finished computes its token still, and drops it).
        live = {*rec.waiting, *rec.running, *rec.swapped}
        keep, self.live = live | self.live, live
        self.recomputing &= keep
        self.computed = {rid: n for rid, n in self.computed.items() if rid in keep}
        return StepView(states, labels, hits)
