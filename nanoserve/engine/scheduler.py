"""The scheduler: who runs each step. nano-vllm's policy (prefill first, then decode, LIFO
preemption by recompute) with vLLM V1's token budget (enable_chunked_prefill); swap and priority
(nanoserve/scheduling/) subclass it."""
from dataclasses import dataclass, field
from itertools import islice

from nanoserve.config import Config
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.sequence import RequestQueue, Sequence, SequenceStatus, num_seats
from nanoserve.engine.stats import SchedulerStats


@dataclass(slots=True)
class ScheduledSequence:
    """One row of a step's plan: seq computes num_tokens tokens from position start (its
    num_computed_tokens before the step), and samples if that reaches its end."""

    seq: Sequence
    start: int
    num_tokens: int
    do_sample: bool
    # n > 1: the request's other sequences, sampled from seq's row, then forked from it
    forks: list[Sequence]


@dataclass
class SchedulerOutput:
    """One step's plan (vLLM's name): a row per scheduled sequence, in batch order. Block copies run
    before the forward, reads of the device pool (swap-outs, offloads) first: a block they free may
    be a destination. Fields past blocks_to_copy are the chapters'."""

    rows: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Block moves, each a pair: copy-on-write copies (source, destination).
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    is_prefill: bool = False  # computes prompt tokens (with chunked prefill: anything but decodes)

    @property
    def seqs(self) -> list[Sequence]:
        return [row.seq for row in self.rows]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(row.num_tokens for row in self.rows)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        start = seq.num_computed_tokens
        end = start + num_tokens
        do_sample = end == len(seq)
        # n > 1: the prompt's first token is sampled n times, and the request's other sequences fork
        # from this one.
        forks = seq.group[1:] if do_sample and end == seq.num_prompt_tokens else []
        self.rows.append(ScheduledSequence(seq, start, num_tokens, do_sample, forks))

    def is_decode(self, row: ScheduledSequence) -> bool:
        """row computes only its newest generated token, no prefill work."""
        return row.num_tokens == 1 and row.start >= row.seq.num_prompt_tokens

    def draws(self, row: ScheduledSequence) -> bool:
        """Does the sampler draw row's tokens? Every row that samples, in the core (a chapter's
        request may pick its own from the logits)."""
        return row.do_sample

    def num_sampled_tokens(self, row: ScheduledSequence) -> int:
        """The tokens the step samples for row: one if it reaches its end, and one per fork."""
        return self.draws(row) + len(row.forks)


class Scheduler:
    output_class = SchedulerOutput  # the plan's record (a chapter may add its own fields)

    def __init__(self, config: Config, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.block_manager, self.eos_token_ids = block_manager, set(config.eos_token_ids)
        self.waiting, self.running = self.new_queue(), self.new_queue()
        self.stats = SchedulerStats()

    def new_queue(self) -> RequestQueue:
        """A queue of sequences: first come, first served (a chapter may sort it)."""
        return RequestQueue()

    def add(self, seq: Sequence) -> None:
        self.waiting.add(seq)

    def queues(self) -> dict[str, RequestQueue]:
        """Every queue a sequence may be in, by name
        (what the trace, the metrics and the dashboard show)."""
        return {"waiting": self.waiting, "running": self.running}

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> SchedulerOutput:
        """Plan the next step. Once planned it counts as done (V1): its sampled token is a
        placeholder till then."""
        self.stats.num_steps += 1
        out = self.output_class()
        self._plan(out)
        self.stats.num_prefill_steps += out.is_prefill
        for row in out.rows:
            row.seq.num_computed_tokens += row.num_tokens
            row.seq.num_output_placeholders += row.do_sample
        return out

    def _plan(self, out: SchedulerOutput) -> None:
        if not self.enable_chunked_prefill:
            # Prefill: whole waiting prompts in order; if any was admitted, the step is theirs
            # alone (nano-vllm).
            self._schedule_waiting(out, self.max_num_batched_tokens)
            out.is_prefill = bool(out.rows)
            if out.is_prefill:
                return
        # Decode (with chunked prefill, V1: running, then waiting requests, in one token budget).
        num_preempted = len(out.preempted)
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if len(out.preempted) == num_preempted:  # a step that had to preempt brings nobody in (V1)
            self._schedule_after_running(out, budget)
        if self.enable_chunked_prefill:
            decodes = [out.is_decode(row) for row in out.rows]
            out.is_prefill = not all(decodes)
            self.stats.num_mixed_steps += out.is_prefill and any(decodes)

    def _schedule_after_running(self, out: SchedulerOutput, budget: int) -> None:
        """Who joins the running ones: with chunked prefill, waiting prompts (swap: swapped
        requests first)."""
        if self.enable_chunked_prefill:
            self._schedule_waiting(out, budget)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting prompts in order, whole (a cached prefix costs no budget) or, with chunked
        prefill, a chunk."""
        while budget > 0 and (seq := self._next_waiting(out)) is not None:
            # Whole prompts: what it computes past its cached prefix must fit the budget.
            max_new_tokens = None if self.enable_chunked_prefill else budget
            if (seq in out.preempted  # one this very step preempted waits: its KV may be in flight
                    or not self.block_manager.allocate(seq, max_new_tokens)):
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.add(seq)
            self.stats.num_prompt_tokens += len(seq)
            self.stats.num_cached_tokens += seq.num_cached_tokens
            budget -= self._schedule_chunk(seq, budget, out)

    def _next_waiting(self, out: SchedulerOutput) -> Sequence | None:
        """The first waiting sequence that may join this step, if it has seats; one that may not
        keeps its place, and those behind it may go."""
        seq = next((s for s in self.waiting if self.can_admit(s, out)), None)
        return seq if seq is not None and num_seats(seq) <= self.num_free_seats() else None

    def can_admit(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """May waiting seq join the step planned so far (seats aside)? In the core, any may (a
        chapter may hold one back, e.g. LoRA's max_loras adapters a step)."""
        return True

    def num_free_seats(self) -> int:  # (seats include the forks to come)
        return self.max_num_seqs - sum(map(num_seats, self.running))

    def _schedule_chunk(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        num_tokens = min(len(seq) - seq.num_computed_tokens, budget)
        # Blocks for its chunk (and its newest token), if needed.
        out.blocks_to_copy += self.block_manager.may_append(seq, num_tokens)
        out.add(seq, num_tokens)
        return num_tokens

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running requests in order, n sequences together; out of blocks, the newest is
        preempted (LIFO)."""
        scheduled: list[Sequence] = []
        while self.running and budget > 0:
            group = self.running.pop_group()
            if not self.can_schedule(group):  # it sits this step out
                scheduled += group
                continue
            while (sum(map(self.block_manager.num_new_blocks, group))
                   > self.block_manager.num_free_blocks):
                if not self.running:  # nobody else to take from: it waits for memory itself
                    self.preempt(group[0], out)
                    break
                self.preempt(self.running.pop(), out)
            else:
                for seq in group:
                    budget -= self._schedule_chunk(seq, budget, out) if budget > 0 else 0
                scheduled += group
        # Keep the order for the next step: scheduled ones first, then those the budget left out.
        self.running.extendleft(reversed(scheduled))
        return budget

    def can_schedule(self, group: list[Sequence]) -> bool:
        """May a running request's sequences compute this step? Always, in the core (a chapter may
        hold a group back, e.g. while a token it needs is in flight)."""
        return True

    def preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Make room: seq's request stops running
        (here by recompute; the swap chapter copies its KV out)."""
        self._preempt_by_recompute(seq, out)

    def _preempt_by_recompute(self, seq: Sequence, out: SchedulerOutput) -> None:
        """seq's request gives its KV blocks back and waits at the front, to prefill again."""
        for s in reversed(self._take_running(seq, out)):
            self.block_manager.deallocate(s)
            s.status = SequenceStatus.WAITING
            self.waiting.add(s, front=True)

    def _take_running(self, seq: Sequence, out: SchedulerOutput) -> list[Sequence]:
        group = [s for s in seq.group if s is seq or s.status == SequenceStatus.RUNNING]
        for s in group:
            if s in self.running:
                self.running.remove(s)
        self.stats.num_preemptions += 1
        out.preempted += group
        return group

    def postprocess(self, out: SchedulerOutput, token_ids: list[int]) -> list[Sequence]:
        """Take a step's tokens in (1 each, n for a forking prompt, none where none was drawn)."""
        sampled, updated = iter(token_ids), []
        for row in out.rows:
            new_token_ids = list(islice(sampled, out.num_sampled_tokens(row)))
            if row.seq.is_finished:
                continue
            if not row.do_sample:  # a prompt chunk short of the end: nothing to sample yet
                self.stats.num_chunked_prefills += 1
                self.hash_blocks(row, row.start + row.num_tokens)
                continue
            row.seq.num_output_placeholders -= 1
            updated += self.accept_tokens(out, row, new_token_ids)
        return updated

    def accept_tokens(self, out: SchedulerOutput, row: ScheduledSequence,
                      token_ids: list[int]) -> list[Sequence]:
        """Take in the tokens row sampled, one for its sequence and one per fork; returns each
        sequence that got one."""
        seq = row.seq
        self.hash_blocks(row, row.start + row.num_tokens)
        for child in row.forks:
            self._fork(seq, child, row.start + row.num_tokens)
        for s, token_id in zip([seq, *row.forks], token_ids):
            self.append_tokens(s, [token_id])
            if s.finish_reason is not None:
                self.finish(s)
        return [seq, *row.forks][: len(token_ids)]

    def hash_blocks(self, row: ScheduledSequence, end: int) -> None:
        """The KV of row's tokens up to end is written now: hash its full blocks (the prefix cache
        may hand them out). A sequence preempted while the step ran lost these blocks."""
        if row.seq.status == SequenceStatus.RUNNING:
            self.block_manager.hash_blocks(row.seq, row.start, end)

    def append_tokens(self, seq: Sequence, token_ids: list[int]) -> None:
        """Append one by one, checking EOS, stop tokens and max_tokens; a finish drops the rest."""
        params = seq.sampling_params
        for token_id in token_ids:
            seq.token_ids.append(token_id)
            self.stats.num_generated_tokens += 1
            is_eos = token_id in self.eos_token_ids and not params.ignore_eos
            if is_eos or token_id in params.stop_token_ids:
                seq.finish_reason = "stop"
            elif seq.num_completion_tokens >= params.max_tokens:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                break

    def home(self, seq: Sequence) -> tuple[RequestQueue, BlockManager | None]:
        """Where seq is: its queue, and the pool holding its blocks (none while it waits)."""
        return ((self.running, self.block_manager) if seq.status == SequenceStatus.RUNNING
                else (self.waiting, None))

    def _fork(self, parent: Sequence, child: Sequence, num_computed_tokens: int) -> None:
        """child starts as a copy of parent (early vLLM's fork), sharing its KV blocks if any."""
        queue, pool = self.home(parent)
        if pool is not None:
            pool.fork(parent, child)
            child.num_computed_tokens = num_computed_tokens
        child.status = parent.status
        queue.insert(queue.index(parent) + child.index, child)  # (siblings stay side by side)

    def finish(self, seq: Sequence) -> None:
        """Take seq out for good, its blocks freed (finished, stopped, aborted or failed)."""
        if not seq.is_finished:
            queue, pool = self.home(seq)
            if seq in queue:
                queue.remove(seq)
                if pool is not None:
                    pool.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
