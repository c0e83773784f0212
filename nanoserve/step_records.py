"""Step records for `LLM(..., trace=True)`: what each engine step ran, moved and finished, with the
queues and the KV pool after it. `StepRecordsEngineCore` is the engine core that makes them, once
per step (as vLLM's stat loggers are called): its `step_recorder` keeps them for `llm.trace` and
hands each to its listeners. `nanoserve/tools/trace.py` prints and plots them; the server's
dashboard (`nanoserve serve --dashboard`, whose engine has `step_records=True`) streams them. With
neither on, nothing here runs."""
from dataclasses import dataclass, field
from time import perf_counter
from typing import Protocol

from nanoserve.config import Config
from nanoserve.engine.core import EngineCore
from nanoserve.engine.output_processor import EngineCoreOutput
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.sequence import Request, Sequence, SequenceStatus


@dataclass
class ScheduledRequest:
    """One sequence of the step's batch (a request with n > 1 has n of them)."""

    request_id: str
    seq_id: int
    num_tokens: int  # tokens computed this step
    start: int  # position of the first of them (num_computed_tokens before the step)
    # the step reached the request's end, so a next token was sampled (async scheduling: maybe
    # dropped)
    sampled: bool
    # computed just its newest token, one the model generated (and its drafts, if any)
    is_decode: bool
    # Speculative decoding: the draft tokens it verified (num_tokens counts them too), and how many
    # passed.
    spec_token_ids: list[int] = field(default_factory=list)
    num_accepted_tokens: int = 0
    # the LoRA adapter its rows computed with (enable_lora); None: the base model
    lora_name: str | None = None


@dataclass
class StepRecord:
    step: int
    kind: str  # "prefill", "decode", "mixed", or "idle" (everyone was preempted)
    scheduled: list[ScheduledRequest]
    recomputed: list[int]  # preempted, KV dropped: the request computes its tokens again later
    swapped_out: list[int]  # preempted, KV copied to host memory
    swapped_in: list[int]  # KV copied back from host memory
    finished: list[int]
    waiting: list[int]  # the queues after the step (these lists hold sequence ids)
    running: list[int]
    swapped: list[int]
    num_used_blocks: int  # KV blocks held by running requests
    num_cached_blocks: int  # free blocks that still hold a prefix a later prompt can hit
    num_free_blocks: int  # all free blocks, the cached ones included
    num_scheduled_tokens: int
    token_budget: int  # max_num_batched_tokens
    time: float  # wall clock (perf_counter()) when the step's output was taken in
    # every sequence named above: (request id, index among its n)
    seq_requests: dict[int, tuple[str, int]]
    # Each running sequence's KV blocks after the step, and the copy-on-write copies before its
    # forward: who shares which block (nanoserve/tools/beam_trace.py draws a beam search's forks,
    # frees and copies).
    block_tables: dict[int, list[int]] = field(default_factory=dict)
    blocks_copied: list[tuple[int, int]] = field(default_factory=list)  # (source, destination)
    # Beam search: the beams forked this step, each (new beam, the beam whose blocks it shares), and
    # the beams that had no child (their blocks freed; all of a search's beams in its last step).
    forked: list[tuple[int, int]] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    # The prefix cache's host tier (kv_offloading_size): the step's copies out (device, host) and
    # back in (host, device), and the tier after it: host blocks holding a cached block, of how
    # many.
    blocks_offloaded: list[tuple[int, int]] = field(default_factory=list)
    blocks_loaded: list[tuple[int, int]] = field(default_factory=list)
    num_host_cached_blocks: int = 0
    num_host_blocks: int = 0
    # Sliding-window attention (sliding_window/): blocks handed back from behind the window so far,
    # all steps.
    num_freed_behind_window: int = 0


def record_step(step: int, out: SchedulerOutput, updated: list[Sequence],
                scheduler: Scheduler) -> StepRecord:
    """Read a step off its plan and what it left: who finished (of the sequences postprocess
    updated), the queues, the KV pool. With async scheduling these are read when the output comes
    in, the next step planned. Records are a chapter, so the plan and the scheduler are the
    composites' (nanoserve/chapters.py), with every chapter's fields, empty where it is off."""
    drafts, accepted = out.scheduled_spec_decode_tokens, out.num_accepted_tokens  # spec_decode/
    loras = scheduler.lora_manager  # None without enable_lora
    lora_names = {} if loras is None else {seq.seq_id: lora.lora_name for seq in out.seqs
                                           if (lora := loras.lora_request(seq)) is not None}
    scheduled = [ScheduledRequest(request_id=row.seq.request_id, seq_id=row.seq.seq_id,
                                  num_tokens=row.num_tokens, start=row.start, sampled=row.do_sample,
                                  is_decode=out.is_decode(row),
                                  spec_token_ids=drafts.get(row.seq.seq_id, []),
                                  num_accepted_tokens=accepted.get(row.seq.seq_id, 0),
                                  lora_name=lora_names.get(row.seq.seq_id))
                 for row in out.rows]
    decodes = [r.is_decode for r in scheduled]
    kind = ("idle" if not scheduled else "decode" if all(decodes) else "mixed" if any(decodes)
            else "prefill")
    swapped = [seq.status == SequenceStatus.SWAPPED for seq in out.preempted]
    swapped_in_blocks = {device_block for _, device_block in out.blocks_to_swap_in}  # swap.py's
    bm = scheduler.block_manager
    num_host_cached_blocks, num_host_blocks = bm.num_offloaded_blocks()  # (kv_offload/'s host tier)
    # the swap chapter's third queue (scheduling/swap.py)
    swapped_queue = scheduler.queues().get("swapped", [])
    named = [*out.seqs, *out.preempted, *updated, *scheduler.waiting, *scheduler.running,
             *swapped_queue]
    return StepRecord(
        step=step, kind=kind, scheduled=scheduled,
        recomputed=[seq.seq_id for seq, s in zip(out.preempted, swapped) if not s],
        swapped_out=[seq.seq_id for seq, s in zip(out.preempted, swapped) if s],
        swapped_in=[seq.seq_id for seq in out.seqs
                    if swapped_in_blocks.intersection(seq.block_table)],
        finished=[seq.seq_id for seq in updated if seq.is_finished],
        waiting=[seq.seq_id for seq in scheduler.waiting],
        running=[seq.seq_id for seq in scheduler.running],
        swapped=[seq.seq_id for seq in swapped_queue],
        num_used_blocks=bm.num_blocks - bm.num_free_blocks,
        num_cached_blocks=sum(bm.blocks[i].ref_count == 0 and bm.blocks[i].hash == h
                              for h, i in bm.hash_to_block_id.items()),
        num_free_blocks=bm.num_free_blocks,
        num_scheduled_tokens=out.total_num_scheduled_tokens,
        token_budget=scheduler.max_num_batched_tokens,
        time=perf_counter(),
        seq_requests={seq.seq_id: (seq.request_id, seq.index) for seq in named},
        block_tables={seq.seq_id: list(seq.block_table) for seq in scheduler.running},
        blocks_copied=list(out.blocks_to_copy),
        forked=list(out.forked_beams), dropped=list(out.dropped_beams),
        blocks_offloaded=list(out.blocks_to_offload),  # the host tier's copies (kv_offload/)
        blocks_loaded=list(out.blocks_to_load),
        num_host_cached_blocks=num_host_cached_blocks, num_host_blocks=num_host_blocks,
        num_freed_behind_window=bm.num_skipped_blocks(),
    )


@dataclass
class StepView:
    """One step as the step table, the timeline and the dashboard show it (StepReader.read), by
    sequence id."""

    # each sequence in the step's queues or batch, or finished in it: its state
    states: dict[int, str]
    # each scheduled sequence: its tokens ("8"), "*" if it sampled nothing, "@N" if it
    labels: dict[int, str]
    # started at position N, past its own computation: the N tokens before came from the prefix
    # cache
    # prefills that started past their own computation: how many tokens the cache gave
    hits: dict[int, int]
    # each sequence that verified drafts: (drafts accepted, drafts proposed)
    spec: dict[int, tuple[int, int]]


class StepListener(Protocol):
    """Who reads each step as it is recorded (the dashboard's StepStream), as vLLM's stat loggers
    read each step's stats: in the engine's thread, and None when an abort changed the queues and
    blocks between steps."""

    def record(self, rec: StepRecord | None) -> None: ...


class StepRecorder:
    """Records each step (StepRecordsEngineCore calls it): `LLM(..., trace=True)` keeps them all in
    `trace`; each listener (`nanoserve serve --dashboard`) gets it then and there. With no trace and
    no listener, no record is made."""

    def __init__(self, scheduler: Scheduler, keep: bool):
        self.scheduler = scheduler
        self.trace: list[StepRecord] | None = [] if keep else None
        self.listeners: list[StepListener] = []
        self.num_steps = 0

    def record(self, out: SchedulerOutput, updated: list[Sequence]) -> None:
        """The step planned as out is done; updated: its sequences that got tokens."""
        if self.trace is None and not self.listeners:
            return
        record = record_step(self.num_steps, out, updated, self.scheduler)
        self.num_steps += 1
        if self.trace is not None:
            self.trace.append(record)
        self.notify(record)

    def notify(self, record: StepRecord | None) -> None:
        for listener in self.listeners:
            listener.record(record)


class StepReader:
    """Reads the records in order and tells each sequence's state in each step: "waiting", "prefill"
    (a whole prompt or a chunk), "decode", "idle" (running, not scheduled), "preempted" (waiting or
    computing again after a recompute preemption, until it samples again), "swapped" or "finished".
    A beam forked in a step has no state in it: it starts in the next."""

    def __init__(self) -> None:
        self.recomputing: set[int] = set()  # preempted to recompute, not yet back where they were
        # how far each sequence's own computation got (0 after a recompute)
        self.computed: dict[int, int] = {}
        self.live: set[int] = set()  # the sequences in the queues after the step before

    def read(self, rec: StepRecord) -> StepView:
        scheduled = {r.seq_id: r for r in rec.scheduled}
        self.recomputing |= set(rec.recomputed) - scheduled.keys()
        labels, hits, spec = {}, {}, {}
        for r in rec.scheduled:
            at = r.start != self.computed.get(r.seq_id, 0)
            start, unsampled = f"@{r.start}" if at else "", "" if r.sampled else "*"
            labels[r.seq_id] = f"{r.num_tokens}{start}{unsampled}"
            if at and not r.is_decode:
                hits[r.seq_id] = r.start
            if r.spec_token_ids:
                spec[r.seq_id] = (r.num_accepted_tokens, len(r.spec_token_ids))
            # (the KV of rejected drafts does not count: the next step computes over it)
            num_rejected = len(r.spec_token_ids) - r.num_accepted_tokens
            self.computed[r.seq_id] = r.start + r.num_tokens - num_rejected
        states = dict.fromkeys(rec.finished, "finished")
        states |= dict.fromkeys(rec.running, "idle")
        states |= {seq_id: "preempted" if seq_id in self.recomputing else "waiting"
                   for seq_id in rec.waiting}
        states |= dict.fromkeys(rec.swapped, "swapped")
        for seq_id, r in scheduled.items():
            states[seq_id] = ("preempted" if seq_id in self.recomputing
                              else "decode" if r.is_decode else "prefill")
            if r.sampled:
                self.recomputing.discard(seq_id)
        for child, _ in rec.forked:
            # a beam forked at the end of the step: it starts with the next one
            states.pop(child, None)
        self.computed.update((seq_id, 0) for seq_id in rec.recomputed)
        self.computed.update((child, self.computed[parent]) for child, parent in rec.forked)
        # A sequence out of every queue has finished (or was aborted) for good: forget it, a step
        # later (with async scheduling, the step in flight when it finished computes its token
        # still, and drops it).
        live = {*rec.waiting, *rec.running, *rec.swapped}
        keep, self.live = live | self.live, live
        self.recomputing &= keep
        self.computed = {seq_id: n for seq_id, n in self.computed.items() if seq_id in keep}
        return StepView(states, labels, hits, spec)


class StepRecordsEngineCore(EngineCore):
    """The engine core that records each step once its output is taken in (observability_config:
    trace, step_records), and tells the listeners when an abort changed the queues between steps.
    With neither option it is the core's EngineCore (step_recorder is None)."""

    def __init__(self, config: Config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        observability = config.observability_config
        self.step_recorder: StepRecorder | None = None
        if observability.records_steps:
            self.step_recorder = StepRecorder(self.scheduler, keep=observability.trace)
        self.updated_seqs: list[Sequence] = []  # the step's sequences that got tokens, in order

    def _update_from_output(self, out: SchedulerOutput,
                            token_ids: list[int]) -> list[EngineCoreOutput]:
        self.updated_seqs = []
        outputs = super()._update_from_output(out, token_ids)
        if self.step_recorder is not None:
            self.step_recorder.record(out, self.updated_seqs)
        return outputs

    def _output(self, request: Request, seq: Sequence, num_new: int) -> EngineCoreOutput:
        if self.step_recorder is not None:  # (the core makes one output per sequence it updated)
            self.updated_seqs.append(seq)
        return super()._output(request, seq, num_new)

    def abort_request(self, request_id: str) -> bool:
        aborted = super().abort_request(request_id)
        if aborted and self.step_recorder is not None:  # the queues and blocks changed: no step
            self.step_recorder.notify(None)
        return aborted
