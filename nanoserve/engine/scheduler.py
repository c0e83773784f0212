import bisect
from collections import deque
from dataclasses import dataclass, field

from nanoserve.config import Config
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerStats:
    """Counters a student can watch: `llm.stats` (docs/scheduling.md shows them at work)."""

    num_steps: int = 0
    num_prefill_steps: int = 0  # steps that compute prompt tokens, alone or (chunked prefill) mixed with decodes
    num_preemptions: int = 0  # recomputed or swapped out
    num_prompt_tokens: int = 0  # tokens admitted by prefills, cached or not (a preempted request counts again)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache instead of computed
    num_generated_tokens: int = 0
    num_chunked_prefills: int = 0  # prompt chunks that stopped short of the prompt's end (so sampled nothing)
    num_mixed_steps: int = 0  # steps whose batch mixed prefill work with decodes (chunked prefill)
    num_priority_preemptions: int = 0  # running requests evicted for a more urgent waiting one (priority policy)
    num_swapped_out: int = 0  # preemptions that moved the KV to host memory (the others recompute)
    num_swapped_in: int = 0  # swapped-out requests whose KV was copied back


@dataclass
class SchedulerOutput:
    """One step's plan (vLLM's name): who runs, how many tokens each computes, which KV blocks move first.

    seqs[i] computes num_scheduled_tokens[i] of its tokens, from num_computed_tokens[i] on; it samples a next
    token only if that reaches its end (do_sample[i]). The block copies run before the forward, swap-outs first
    (a block they free may be a copy's destination). A step never swaps both ways (swap-ins wait for a step
    that preempted nobody), and a sequence that got a copy this step is never preempted in it.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # where each chunk starts
    do_sample: list[bool] = field(default_factory=list)
    forks: list[list[Sequence]] = field(default_factory=list)  # sampled from the same row as seqs[i], forked
    preempted: list[Sequence] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (source, destination)
    is_prefill: bool = False  # computes prompt tokens (with chunked prefill: anything but decodes)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_scheduled_tokens.append(num_tokens)
        self.num_computed_tokens.append(seq.num_computed_tokens)
        self.do_sample.append(seq.num_computed_tokens + num_tokens == len(seq))
        # Parallel sampling (n > 1): the first token is sampled n times, and the request's other sequences
        # fork from this one with theirs.
        prompt_done = self.do_sample[-1] and seq.num_computed_tokens + num_tokens == seq.num_prompt_tokens
        self.forks.append(seq.group[1:] if prompt_done else [])


def num_seats(seq: Sequence) -> int:
    """The max_num_seqs seats a sequence takes: n for a request's first one until its prompt is done (the
    others fork from it then), else 1."""
    return len(seq.group) if seq.num_completion_tokens == 0 else 1


def priority_key(seq: Sequence) -> tuple[int, int]:
    """Lower priority value first; ties by arrival (seq ids count up in arrival order)."""
    return seq.priority, seq.seq_id


class Scheduler:
    """Picks each step's batch. The default is nano-vllm's policy: prefill whenever waiting prompts fit,
    else decode everything running, preempting the newest request when blocks run out. Three switches
    from vLLM change it: enable_chunked_prefill, scheduling_policy="priority", preemption_mode="swap"."""

    def __init__(self, config: Config, block_manager: BlockManager, host_block_manager: BlockManager | None = None):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.scheduling_policy = config.scheduling_policy
        self.eos_token_ids = set(config.eos_token_ids)
        self.block_manager = block_manager
        self.host_block_manager = host_block_manager  # the swap pool, in host memory (preemption_mode="swap")
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.swapped: deque[Sequence] = deque()
        self.stats = SchedulerStats()

    def add(self, seq: Sequence) -> None:
        self._enqueue(self.waiting, seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running and not self.swapped

    def schedule(self) -> SchedulerOutput:
        """Plan the next step."""
        self.stats.num_steps += 1
        out = SchedulerOutput()
        if self.scheduling_policy == "priority":
            self._preempt_for_priority(out)
        if self.enable_chunked_prefill:
            self._schedule_token_budget(out)
        else:
            self._schedule_default(out)
        self.stats.num_prefill_steps += out.is_prefill
        # The plan counts as done (vLLM V1): the next step, if planned before this one's output is back
        # (async scheduling), starts where this one ends, with a placeholder for each token it samples.
        for seq, num_tokens, do_sample in zip(out.seqs, out.num_scheduled_tokens, out.do_sample):
            seq.num_computed_tokens += num_tokens
            seq.num_output_placeholders += do_sample
        return out

    def _admit(self, seq: Sequence) -> None:
        """The waiting head got its blocks: it runs from now on. (One preempted by this very step waits for the
        next: with async scheduling, a step that computes it may still be in flight, its KV and token unknown.)"""
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        self._enqueue(self.running, seq)
        self.stats.num_prompt_tokens += len(seq)
        self.stats.num_cached_tokens += seq.num_cached_tokens

    def _num_free_seats(self) -> int:
        """max_num_seqs less the running sequences and those that will fork from them."""
        return self.max_num_seqs - sum(map(num_seats, self.running))

    def _schedule_chunk(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Schedule as many of seq's uncomputed tokens as the budget allows; returns how many."""
        num_tokens = min(len(seq) - seq.num_computed_tokens, budget)
        out.blocks_to_copy += self.block_manager.may_append(seq)  # a new block for its newest token, if needed
        out.add(seq, num_tokens)
        return num_tokens

    # ---- nano-vllm (the default): a step prefills whole prompts, or else decodes ---------------------
    def _schedule_default(self, out: SchedulerOutput) -> None:
        if not self.swapped:  # swapped-out requests come back before any new prompt is admitted (vLLM V0)
            self._schedule_prefill(out)
        if out.seqs:
            out.is_prefill = True
            return
        self._schedule_running(out, self.max_num_batched_tokens)  # decodes: a token each
        if not out.preempted:  # a step that had to preempt has no room to bring anyone back
            self._schedule_swapped(out, self.max_num_batched_tokens - len(out.seqs))

    def _schedule_prefill(self, out: SchedulerOutput) -> None:
        num_batched_tokens = 0
        while self.waiting and num_seats(self.waiting[0]) <= self._num_free_seats():
            seq = self.waiting[0]
            # The budget counts the tokens the step computes: a cached prefix costs none.
            num_new_tokens = self.block_manager.num_new_tokens(seq)
            if num_batched_tokens + num_new_tokens > self.max_num_batched_tokens or seq in out.preempted:
                break
            if not self.block_manager.allocate(seq):
                break
            num_batched_tokens += num_new_tokens
            self._admit(seq)
            out.add(seq, len(seq) - seq.num_computed_tokens)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Schedule the running requests in order, each taking min(tokens it has left, budget left); a
        request's sequences (n > 1) go together. When blocks run out, the tail of running gives up its KV
        first: the newest request (LIFO), so the oldest ones finish (under the priority policy the least
        urgent one); with nobody left behind it, the request itself. Returns the budget left."""
        scheduled: list[Sequence] = []
        while self.running and budget > 0:
            group = self._pop_group(self.running)
            while sum(map(self.block_manager.needs_block, group)) > self.block_manager.num_free_blocks:
                if not self.running:
                    self.preempt(group[0], out)  # nobody else to take from: it waits for memory itself
                    break
                self.preempt(self.running.pop(), out)
            else:
                for seq in group:
                    budget -= self._schedule_chunk(seq, budget, out) if budget > 0 else 0
                scheduled += group
        # Keep the order for the next step: scheduled ones first, then those the budget left out.
        self.running.extendleft(reversed(scheduled))
        return budget

    def _pop_group(self, queue: deque[Sequence]) -> list[Sequence]:
        """The head of queue with the other sequences of its request in queue, taken out together (vLLM V0's
        sequence group: the n sequences of a request run, are preempted and swapped as one)."""
        seq = queue.popleft()
        group = [seq] + [s for s in seq.group if s is not seq and s in queue]
        for s in group[1:]:
            queue.remove(s)
        return group

    # ---- vLLM V1 (enable_chunked_prefill=True): a token budget per step, chunked prefill -------------
    def _schedule_token_budget(self, out: SchedulerOutput) -> None:
        """A step computes at most max_num_batched_tokens tokens. Running requests go first (a decode needs
        1, an unfinished prompt the rest of it), then waiting ones in order; each takes min(tokens it has
        left, budget left), so a long prompt is cut into chunks and one step mixes chunks and decodes."""
        num_preempted = len(out.preempted)
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if len(out.preempted) == num_preempted:  # a step that had to preempt brings nobody back or in (V1)
            if self.swapped:  # swapped-out requests come back before any new prompt is admitted
                self._schedule_swapped(out, budget)
            else:
                self._schedule_waiting(out, budget)
        # A decode computes just the newest token, one the model generated; anything else is prefill work.
        decodes = [n == 1 and start >= seq.num_prompt_tokens
                   for seq, n, start in zip(out.seqs, out.num_scheduled_tokens, out.num_computed_tokens)]
        out.is_prefill = not all(decodes)
        self.stats.num_mixed_steps += out.is_prefill and any(decodes)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and num_seats(self.waiting[0]) <= self._num_free_seats():
            seq = self.waiting[0]
            # All of the prompt's blocks, though only a chunk may run now (V1 allocates per chunk):
            # simpler, and a prompt once started never stalls for memory halfway.
            if seq in out.preempted or not self.block_manager.allocate(seq):
                break
            self._admit(seq)
            budget -= self._schedule_chunk(seq, budget, out)

    # ---- vLLM V0 priority scheduling (scheduling_policy="priority") -----------------------------------
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

    # ---- preemption: recompute (the default) or swap (preemption_mode="swap", vLLM V0) ----------------
    def preempt(self, seq: Sequence, out: SchedulerOutput, swap: bool = True) -> None:
        """Take the KV blocks of seq and of the other running sequences of its request back. Swap mode copies
        their KV to the host pool, to come back later; recompute (also the fallback when the host pool is
        full) drops it: they wait and prefill all their tokens again."""
        group = [s for s in seq.group if s is seq or s.status == SequenceStatus.RUNNING]
        for s in group:
            if s in self.running:
                self.running.remove(s)
        self.stats.num_preemptions += 1
        out.preempted += group
        host = self.host_block_manager
        swap = swap and host is not None and host.num_free_blocks >= len({b for s in group for b in s.block_table})
        if swap:
            out.blocks_to_swap_out += self.block_manager.swap_out(group, host)
            self.stats.num_swapped_out += 1
        for s in reversed(group):  # to the front of their queue, in order
            if not swap:
                self.block_manager.deallocate(s)
            s.status = SequenceStatus.SWAPPED if swap else SequenceStatus.WAITING
            self._enqueue(self.swapped if swap else self.waiting, s, front=True)

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

    # ---- after the forward ----------------------------------------------------------------------------
    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is, returning its blocks: it was aborted or failed, or it finished
        (also while preempted, when the step that sampled its last token was in flight)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            self.block_manager.deallocate(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.host_block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED

    def postprocess(self, out: SchedulerOutput, token_ids: list[int]) -> list[Sequence]:
        """Take in a step's sampled tokens (one per sequence that samples, in batch order): append each to its
        sequence and finish those that are done. Returns the sequences that got a token. A sequence that
        finished while the step was in flight (async scheduling, or an abort) has its extra token dropped."""
        sampled = iter(token_ids)
        updated = []
        for seq, start, num_tokens, do_sample, forks in zip(out.seqs, out.num_computed_tokens,
                                                            out.num_scheduled_tokens, out.do_sample, out.forks):
            token_id = next(sampled) if do_sample else None
            fork_token_ids = [next(sampled) for _ in forks]
            if seq.is_finished:
                continue
            if seq.status == SequenceStatus.RUNNING:  # (a preempted one no longer holds these blocks)
                self.block_manager.hash_blocks(seq, start, start + num_tokens)  # their KV is written now
            if not do_sample:  # a prompt chunk short of the end: nothing to sample yet
                self.stats.num_chunked_prefills += 1
                continue
            seq.num_output_placeholders -= 1
            for child in forks:
                self._fork(seq, child, start + num_tokens)
            for s, t in zip([seq, *forks], [token_id, *fork_token_ids]):
                s.append_token(t)
                self.stats.num_generated_tokens += 1
                s.finish_reason = self._finish_reason(s, t)
                if s.finish_reason is not None:
                    self.abort(s)
                updated.append(s)
        return updated

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

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.sampling_params
        # (Before min_tokens the model runner masks EOS and the stop tokens, so they never come up here.)
        if (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
            return "stop"
        if seq.num_completion_tokens >= params.max_tokens:
            return "length"
        return None
