"""Step records for `LLM(..., trace=True)`: what each engine step ran, moved and finished, with the queues and
the KV pool after it. `nanoserve/tools/trace.py` prints and plots them. With trace off nothing here runs."""
from dataclasses import dataclass, field
from time import perf_counter

from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledRequest:
    request_id: int
    num_tokens: int  # tokens computed this step
    start: int  # position of the first of them (num_computed_tokens before the step)
    sampled: bool  # the step reached the request's end, so a next token was sampled
    is_decode: bool  # computed just its newest token, one the model generated


@dataclass
class StepRecord:
    step: int
    kind: str  # "prefill", "decode", "mixed", or "idle" (everyone was preempted)
    scheduled: list[ScheduledRequest]
    recomputed: list[int]  # preempted, KV dropped: the request computes its tokens again later
    swapped_out: list[int]  # preempted, KV copied to host memory
    swapped_in: list[int]  # KV copied back from host memory
    num_scheduled_tokens: int
    token_budget: int  # max_num_batched_tokens
    time: float  # seconds from the plan to the end of postprocess (perf_counter() at the plan until then)
    finished: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)  # queues after the step, as request ids
    running: list[int] = field(default_factory=list)
    swapped: list[int] = field(default_factory=list)
    num_used_blocks: int = 0  # KV blocks held by running requests
    num_cached_blocks: int = 0  # free blocks that still hold a prefix a later prompt can hit
    num_free_blocks: int = 0  # all free blocks, the cached ones included


def begin_step_record(step: int, out: SchedulerOutput, scheduler: Scheduler) -> StepRecord:
    """The plan, read before the step moves the requests on."""
    swapped_in_blocks = {device_block for _, device_block in out.blocks_to_swap_in}
    scheduled = [ScheduledRequest(seq.seq_id, n, seq.num_computed_tokens, sample,
                                  seq.num_computed_tokens == len(seq) - 1 and seq.num_completion_tokens > 0)
                 for seq, n, sample in zip(out.seqs, out.num_scheduled_tokens, out.do_sample)]
    decodes = [r.is_decode for r in scheduled]
    kind = "idle" if not scheduled else "decode" if all(decodes) else "mixed" if any(decodes) else "prefill"
    swapped = [seq.status == SequenceStatus.SWAPPED for seq in out.preempted]
    return StepRecord(step, kind, scheduled,
                      [seq.seq_id for seq, s in zip(out.preempted, swapped) if not s],
                      [seq.seq_id for seq, s in zip(out.preempted, swapped) if s],
                      [seq.seq_id for seq in out.seqs if seq.block_table[0] in swapped_in_blocks],
                      sum(out.num_scheduled_tokens), scheduler.max_num_batched_tokens, perf_counter())


def end_step_record(record: StepRecord, finished: list[Sequence], scheduler: Scheduler) -> StepRecord:
    """What the step left behind: who finished, the queues, the KV pool."""
    record.time = perf_counter() - record.time
    record.finished = [seq.seq_id for seq in finished]
    record.waiting, record.running, record.swapped = ([seq.seq_id for seq in queue] for queue in
                                                      (scheduler.waiting, scheduler.running, scheduler.swapped))
    bm = scheduler.block_manager
    record.num_free_blocks = bm.num_free_blocks
    record.num_used_blocks = bm.num_blocks - bm.num_free_blocks
    record.num_cached_blocks = sum(bm.blocks[i].ref_count == 0 and bm.blocks[i].hash == h
                                   for h, i in bm.hash_to_block_id.items())
    return record
