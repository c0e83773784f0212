from collections import deque
from dataclasses import dataclass, field

from nanoserve.config import Config
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.engine.scheduler_policies import SchedulerPolicies, num_seats
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.engine.spec_decode.accounting import SpecDecodingStats, accept_tokens


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
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)  # speculative_config


class Scheduler(SchedulerPolicies):
    """Picks each step's batch. The default is nano-vllm's policy, `schedule()` read top to bottom: prefill
    whenever waiting prompts fit, else decode everything running, preempting the newest request when blocks
    run out. Three switches from vLLM hook in where they differ: enable_chunked_prefill (below),
    scheduling_policy="priority" and preemption_mode="swap" (engine/scheduler_policies.py)."""

    def __init__(self, config: Config, block_manager: BlockManager, host_block_manager: BlockManager | None = None):
        self.max_num_seqs, self.max_num_batched_tokens = config.max_num_seqs, config.max_num_batched_tokens
        self.pipeline_depth = config.pipeline_parallel_size if config.async_scheduling else 1  # batches in flight
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.scheduling_policy = config.scheduling_policy
        self.eos_token_ids = set(config.eos_token_ids)
        self.speculative_config = config.speculative_config
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
        if self.scheduling_policy == "priority":  # an urgent newcomer takes blocks from less urgent requests
            self._preempt_for_priority(out)
        if self.enable_chunked_prefill:  # vLLM V1: one token budget, prefill chunks mixed with decodes
            self._schedule_token_budget(out)
            return self._commit(out)
        # Prefill: admit waiting prompts in order, whole, while seats, blocks and the token budget last.
        # (Swapped-out requests come back before any new prompt is admitted, as in vLLM V0.)
        num_batched_tokens = 0
        while self.waiting and not self.swapped and num_seats(self.waiting[0]) <= self._num_free_seats(out):
            seq = self.waiting[0]
            num_new_tokens = self.block_manager.num_new_tokens(seq)  # a cached prefix costs no budget
            if num_batched_tokens + num_new_tokens > self.max_num_batched_tokens or seq in out.preempted:
                break
            if not self.block_manager.allocate(seq):
                break
            num_batched_tokens += num_new_tokens
            self._admit(seq)
            out.add(seq, len(seq) - seq.num_computed_tokens)
        out.is_prefill = bool(out.seqs)
        if not out.is_prefill:
            # Decode: a token for each running sequence; when blocks run out, the newest request gives its KV up.
            budget = self._schedule_running(out, self.max_num_batched_tokens)
            if self.swapped and not out.preempted:  # a step that had to preempt has no room to bring anyone back
                self._schedule_swapped(out, budget)
        return self._commit(out)

    def _commit(self, out: SchedulerOutput) -> SchedulerOutput:
        """The plan counts as done (vLLM V1): the next step, if planned before this one's output is back
        (async scheduling), starts where this one ends, with a placeholder for each token it samples."""
        self.stats.num_prefill_steps += out.is_prefill
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

    def _schedule_chunk(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Schedule as many of seq's uncomputed tokens as the budget allows; returns how many."""
        num_tokens = min(len(seq) - seq.num_computed_tokens, budget)
        del seq.spec_token_ids[max(num_tokens - 1, 0) :]  # drafts past the token budget are dropped
        out.blocks_to_copy += self.block_manager.may_append(seq)  # a new block for its newest token, if needed
        out.add(seq, num_tokens)
        return num_tokens

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Schedule the running requests in order, each taking min(tokens it has left, budget left); a
        request's sequences (n > 1) go together. When blocks run out, the tail of running gives up its KV
        first: the newest request (LIFO), so the oldest ones finish (under the priority policy the least
        urgent one); with nobody left behind it, the request itself. Returns the budget left."""
        scheduled: list[Sequence] = []
        while self.running and budget > 0:
            group = self._pop_group(self.running)
            if self._sits_out(group):  # async scheduling: its token is still in flight (grammar, pipeline stages)
                scheduled += group
                continue
            while sum(map(self.block_manager.num_new_blocks, group)) > self.block_manager.num_free_blocks:
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
        swap = swap and self._swap_out(group, out)
        for s in reversed(group):  # to the front of their queue, in order
            s.spec_token_ids = []  # (drafts are proposed for running sequences only)
            if not swap:
                self.block_manager.deallocate(s)
            s.status = SequenceStatus.SWAPPED if swap else SequenceStatus.WAITING
            self._enqueue(self.swapped if swap else self.waiting, s, front=True)

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
        decodes = [out.is_decode(i) for i in range(len(out.seqs))]
        out.is_prefill = not all(decodes)
        self.stats.num_mixed_steps += out.is_prefill and any(decodes)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and num_seats(self.waiting[0]) <= self._num_free_seats(out):
            seq = self.waiting[0]
            # All of the prompt's blocks, though only a chunk may run now (V1 allocates per chunk):
            # simpler, and a prompt once started never stalls for memory halfway.
            if seq in out.preempted or not self.block_manager.allocate(seq):
                break
            self._admit(seq)
            budget -= self._schedule_chunk(seq, budget, out)

    # ---- after the forward ----------------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, token_ids: list[int]) -> list[Sequence]:
        """Take in a step's sampled tokens (one per sequence that samples, n for a prompt that forks, none for a
        beam, in batch order). Returns the sequences that got a token. A sequence that finished while the step was
        in flight (async scheduling, or an abort) has its extra token dropped."""
        sampled = iter(token_ids)
        updated = []
        for seq, start, num_tokens, do_sample, forks in zip(out.seqs, out.num_computed_tokens,
                                                            out.num_scheduled_tokens, out.do_sample, out.forks):
            drafts = out.scheduled_spec_decode_tokens.get(seq.seq_id, [])
            num_drawn = 0 if seq.beam_search is not None else do_sample + len(forks) + len(drafts)  # (beams: below)
            new_token_ids = [next(sampled) for _ in range(num_drawn)]
            if seq.is_finished:
                continue
            if drafts:  # speculative decoding: a run of up to 1 + k tokens, then the rollback
                updated += accept_tokens(self, out, seq, start, drafts, new_token_ids)
                continue
            if seq.status == SequenceStatus.RUNNING:  # (a preempted one no longer holds these blocks)
                self.block_manager.hash_blocks(seq, start, start + num_tokens)  # their KV is written now
            if not do_sample:  # a prompt chunk short of the end: nothing to sample yet
                self.stats.num_chunked_prefills += 1
                continue
            seq.num_output_placeholders -= 1
            if seq.beam_search is not None:  # its beam search picks its token (engine/beam_scheduler.py)
                continue
            for child in forks:
                self._fork(seq, child, start + num_tokens)
            for s, token_id in zip([seq, *forks], new_token_ids):
                self._append_token(s, token_id)
                updated.append(s)
        return updated

    def _append_token(self, seq: Sequence, token_id: int) -> None:
        seq.append_token(token_id)
        self.stats.num_generated_tokens += 1
        seq.finish_reason = self._finish_reason(seq, token_id)
        if seq.finish_reason is not None:
            self.finish(seq)

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.sampling_params
        # (Before min_tokens the sampler rules out EOS and the stop tokens, so they never come up here.)
        if (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
            return "stop"
        if seq.num_completion_tokens >= params.max_tokens:
            return "length"
        return None

    def finish(self, seq: Sequence) -> None:
        """Take seq out of the scheduler for good, returning its blocks: it finished (also while preempted,
        when the step that sampled its last token was in flight), hit a stop string, was aborted or failed."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            self.block_manager.deallocate(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.host_block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
