"""The scheduler's parts beyond nano-vllm's default (engine/scheduler.py calls them where the policies differ):
scheduling_policy="priority" and preemption_mode="swap" (vLLM V0), the n sequences of one request
(SamplingParams.n > 1: vLLM V0's sequence group, which runs, is preempted and swapped as one), and which groups
sit a step out while their token is in flight (async scheduling, pipeline stages)."""
import bisect
from collections import deque

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.engine.spec_decode.accounting import waits_for_drafts
from nanoserve.engine.structured_output_manager import waits_for_grammar
from nanoserve.utils.math import cdiv


def num_seats(seq: Sequence) -> int:
    """The max_num_seqs seats a sequence takes: n for a request's first one until its prompt is done (the
    others fork from it then; a beam search's n is its beam_width), else 1."""
    return seq.sampling_params.n if seq.num_completion_tokens == 0 else 1


def priority_key(seq: Sequence) -> tuple[int, int]:
    """Lower priority value first; ties by arrival (seq ids count up in arrival order)."""
    return seq.priority, seq.seq_id


class SchedulerPolicies:
    """Scheduler inherits these; they use its queues (waiting, running, swapped), block managers and stats."""

    scheduling_policy: str
    max_num_seqs: int
    speculative_config: object
    pipeline_depth: int  # P with pipeline stages and async_scheduling (P batches in flight), else 1
    block_manager: BlockManager
    host_block_manager: BlockManager | None
    waiting: deque[Sequence]
    running: deque[Sequence]
    swapped: deque[Sequence]

    def _sits_out(self, group: list[Sequence]) -> bool:
        """A running group whose next token a step in flight is still sampling waits for it (async scheduling): if
        its grammar needs that token for its next mask, if it speculates (its drafts start from that token:
        spec_decode/accounting.py), and always with pipeline stages in flight, where a batch holding it could not
        enter the first stage before the batch in flight left the last (vLLM V1's scheduled_req_ids): planned
        without it, the next batch keeps the stages busy with other requests (docs/parallelism.md)."""
        in_flight = any(s.num_output_placeholders for s in group)
        return waits_for_grammar(group) or waits_for_drafts(group, self.speculative_config) or \
            (self.pipeline_depth > 1 and in_flight)

    def _num_free_seats(self, out: SchedulerOutput | None = None) -> int:
        """max_num_seqs less the running sequences and those that will fork from them. With P pipeline stages in
        flight a step admits at most 1/P of the requests (`out`: this step's so far): a burst admitted whole would fill
        one batch and leave no request for the batches in flight beside it (V0's virtual engines share
        arrivals out among themselves for the same reason)."""
        free = self.max_num_seqs - sum(map(num_seats, self.running))
        if out is not None and self.pipeline_depth > 1:
            share = cdiv(sum(map(num_seats, [*self.running, *self.waiting])), self.pipeline_depth)
            free = min(free, share - sum(map(num_seats, out.seqs)))
        return free

    # ---- priority (scheduling_policy="priority") --------------------------------------------------------
    def _enqueue(self, queue: deque[Sequence], seq: Sequence, front: bool = False) -> None:
        """FCFS: join at the back (a preempted request at the front). Priority: every queue stays sorted by
        (priority, arrival), so its head is the most urgent request and the tail of running the first victim."""
        if self.scheduling_policy == "priority":
            bisect.insort(queue, seq, key=priority_key)
        elif front:
            queue.appendleft(seq)
        else:
            queue.append(seq)

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """While the most urgent waiting request lacks its blocks or a seat (max_num_seqs), running requests
        of lower priority give theirs up, least urgent first. They recompute rather than swap: swapped
        requests come back before new ones are admitted, so a swapped victim would take its blocks back."""
        if not self.waiting or self.swapped:
            return
        seq = self.waiting[0]
        while (self.running and priority_key(self.running[-1]) > priority_key(seq) and (
                num_seats(seq) > self._num_free_seats() or not self.block_manager.can_allocate(seq))):
            self.preempt(self.running.pop(), out, swap=False)
            self.stats.num_priority_preemptions += 1

    # ---- swap (preemption_mode="swap") -----------------------------------------------------------------
    def _swap_out(self, group: list[Sequence], out: SchedulerOutput) -> bool:
        """Copy the KV of a preempted request's sequences to the host pool, if there is one with room."""
        host = self.host_block_manager
        if host is None or host.num_free_blocks < len({b for s in group for b in s.block_table}):
            return False
        out.blocks_to_swap_out += self.block_manager.swap_out(group, host)
        self.stats.num_swapped_out += 1
        return True

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> None:
        """Swap requests back in, first in line first, while their blocks fit; they go on where they stopped."""
        while self.swapped and budget > 0:
            group = self._pop_group(self.swapped)
            if sum(map(num_seats, group)) > self._num_free_seats() or not self.block_manager.can_swap_in(group):
                self.swapped.extendleft(reversed(group))
                break
            out.blocks_to_swap_in += self.block_manager.swap_in(group, self.host_block_manager)
            self.stats.num_swapped_in += 1
            for seq in group:
                seq.status = SequenceStatus.RUNNING
                self._enqueue(self.running, seq)
                budget -= self._schedule_chunk(seq, budget, out) if budget > 0 else 0

    # ---- a request's n sequences (SamplingParams.n > 1) -------------------------------------------------
    def _pop_group(self, queue: deque[Sequence]) -> list[Sequence]:
        """The head of queue with the other sequences of its request in queue, taken out together."""
        seq = queue.popleft()
        group = [seq] + [s for s in seq.group if s is not seq and s in queue]
        for s in group[1:]:
            queue.remove(s)
        return group

    def _fork(self, parent: Sequence, child: Sequence, num_computed_tokens: int) -> None:
        """child, another sequence of parent's request, starts as a copy of it (early vLLM's fork): it shares
        its KV blocks, wherever they are (none if it was preempted to recompute), and joins its queue."""
        pool = {SequenceStatus.RUNNING: self.block_manager, SequenceStatus.SWAPPED: self.host_block_manager}
        if parent.status in pool:
            pool[parent.status].fork(parent, child)
            child.num_computed_tokens = num_computed_tokens
        child.status = parent.status
        queue = {SequenceStatus.RUNNING: self.running, SequenceStatus.SWAPPED: self.swapped}.get(parent.status,
                                                                                               self.waiting)
        queue.insert(queue.index(parent) + child.index, child)  # the request's sequences stay side by side
