"""Step records for `LLM(..., trace=True)`: what each engine step ran, moved and finished, with the queues and
the KV pool after it. `nanoserve/tools/trace.py` prints and plots them. With trace off nothing here runs."""
from dataclasses import dataclass
from time import perf_counter

from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledRequest:
    """One sequence of the step's batch (a request with n > 1 has n of them)."""

    request_id: str
    seq_id: int
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
    waiting: list[int]  # the queues after the step (these lists hold sequence ids)
    running: list[int]
    swapped: list[int]
    num_used_blocks: int  # KV blocks held by running requests
    num_cached_blocks: int  # free blocks that still hold a prefix a later prompt can hit
    num_free_blocks: int  # all free blocks, the cached ones included
    num_scheduled_tokens: int
    token_budget: int  # max_num_batched_tokens
    time: float  # wall clock (perf_counter()) when the step's output was taken in
    seq_requests: dict[int, tuple[str, int]]  # every sequence named above: (request id, index among its n)


def record_step(step: int, out: SchedulerOutput, updated: list[Sequence], scheduler: Scheduler) -> StepRecord:
    """Read a step off its plan and what it left: who finished (of the sequences postprocess updated), the
    queues, the KV pool. With async scheduling these are read when the output comes in, the next step planned."""
    scheduled = [ScheduledRequest(request_id=seq.request_id, seq_id=seq.seq_id, num_tokens=n, start=start,
                                  sampled=sample, is_decode=out.is_decode(i))
                 for i, (seq, n, start, sample) in enumerate(zip(out.seqs, out.num_scheduled_tokens,
                                                                 out.num_computed_tokens, out.do_sample))]
    decodes = [r.is_decode for r in scheduled]
    kind = "idle" if not scheduled else "decode" if all(decodes) else "mixed" if any(decodes) else "prefill"
    swapped = [seq.status == SequenceStatus.SWAPPED for seq in out.preempted]
    swapped_in_blocks = {device_block for _, device_block in out.blocks_to_swap_in}
    bm = scheduler.block_manager
    named = [*out.seqs, *out.preempted, *updated, *scheduler.waiting, *scheduler.running, *scheduler.swapped]
    return StepRecord(
        step=step, kind=kind, scheduled=scheduled,
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
        seq_requests={seq.seq_id: (seq.request_id, seq.index) for seq in named},
    )
