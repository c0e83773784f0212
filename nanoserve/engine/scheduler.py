"""The scheduler: who runs in each step. nano-vllm's policy is `schedule()` read top to bottom; vLLM's switches
join it where they differ: enable_chunked_prefill (V1's token budget), scheduling_policy="priority" (a sorted
RequestQueue) and preemption_mode="swap" (V0), a request's n sequences (V0's sequence group), and the tokens a
step in flight is still sampling (async scheduling's placeholders). `postprocess` takes a step's tokens in."""
from nanoserve.config import Config
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.scheduler_output import PLACEHOLDER_TOKEN_ID, SchedulerOutput, SchedulerStats
from nanoserve.engine.seams import Seams
from nanoserve.engine.sequence import RequestQueue, Sequence, SequenceStatus, num_seats, priority_key
from nanoserve.utils.math import cdiv


class Scheduler:
    def __init__(self, config: Config, block_manager: BlockManager, host_block_manager: BlockManager | None = None,
                 seams: Seams | None = None):
        self.max_num_seqs, self.max_num_batched_tokens = config.max_num_seqs, config.max_num_batched_tokens
        self.pipeline_depth = config.pipeline_parallel_size if config.async_scheduling else 1  # batches in flight
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.eos_token_ids = set(config.eos_token_ids)
        self.block_manager = block_manager
        self.host_block_manager = host_block_manager  # the swap pool, in host memory (preemption_mode="swap")
        self.seams = Seams() if seams is None else seams  # the engine's: needs_newest_token, admits
        self.waiting, self.running, self.swapped = (RequestQueue(config.scheduling_policy) for _ in range(3))
        self.stats = SchedulerStats()

    def add(self, seq: Sequence) -> None:
        self.waiting.add(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running and not self.swapped

    def schedule(self) -> SchedulerOutput:
        """Plan the next step."""
        self.stats.num_steps += 1
        out = SchedulerOutput()
        if self.waiting.by_priority:  # an urgent newcomer takes blocks from less urgent requests
            self._preempt_for_priority(out)
        if self.enable_chunked_prefill:  # vLLM V1: one token budget, prefill chunks mixed with decodes
            self._schedule_token_budget(out)
            return self._commit(out)
        # Prefill: admit waiting prompts in order, whole, while seats, blocks and budget last (swapped ones first: V0).
        num_batched_tokens = 0
        while not self.swapped and (seq := self._next_waiting(out)) is not None:
            num_new_tokens = self.block_manager.num_new_tokens(seq)  # a cached prefix costs no budget
            over_budget = num_batched_tokens + num_new_tokens > self.max_num_batched_tokens
            if over_budget or seq in out.preempted or not self.block_manager.allocate(seq):
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
        """The plan counts as done (V1): a step planned before this one is back starts where it ends (async)."""
        self.stats.num_prefill_steps += out.is_prefill
        out.blocks_to_offload, out.blocks_to_load = self.block_manager.take_tier_copies()  # the second tier's
        if self.seams.kv_connector is not None:  # the loads and saves of KV from or for another engine (kv_transfer/)
            out.kv_connector_metadata = self.seams.kv_connector.build_connector_meta(out)
        for seq, num_tokens, do_sample in zip(out.seqs, out.num_scheduled_tokens, out.do_sample):
            seq.num_computed_tokens += num_tokens
            seq.num_output_placeholders += do_sample
        return out

    def _next_waiting(self, out: SchedulerOutput) -> Sequence | None:
        """The first waiting sequence the admission seams let join (seams.py: LoRA's max_loras), if it has seats."""
        seq = next((s for s in self.waiting if all(admits(s, self.running) for admits in self.seams.admits)), None)
        return seq if seq is not None and num_seats(seq) <= self._num_free_seats(out) else None

    def _admit(self, seq: Sequence) -> None:
        """seq got its blocks: it runs. (One this very step preempted waits: its KV may be in flight.)"""
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.add(seq)
        self.stats.num_prompt_tokens += len(seq)
        self.stats.num_cached_tokens += seq.num_cached_tokens

    def _schedule_chunk(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Schedule as many of seq's uncomputed tokens as the budget allows; returns how many."""
        num_tokens = min(len(seq) - seq.num_computed_tokens, budget)
        del seq.spec_token_ids[max(num_tokens - 1, 0) :]  # lookahead tokens past the token budget are dropped
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
            group = self.running.pop_group()
            if self._sits_out(group):  # async scheduling: a token it needs is still in flight
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

    def _sits_out(self, group: list[Sequence]) -> bool:
        """Async scheduling: a group whose newest token is in flight waits for it when a feature needs that token to
        plan (a grammar's next mask, drafts proposed from it), or with pipeline stages, where its batch could not
        enter the first stage before the one in flight left the last (V1's scheduled_req_ids; docs/parallelism.md)."""
        in_flight = [s for s in group if s.num_output_placeholders]
        return bool(in_flight) and (self.pipeline_depth > 1 or any(
            needs(s) for needs in self.seams.needs_newest_token for s in in_flight))

    def _num_free_seats(self, out: SchedulerOutput | None = None) -> int:
        """max_num_seqs less the running sequences and those that will fork from them. With P pipeline stages in
        flight a step admits at most 1/P of the requests (`out`: this step's so far), leaving some for the others."""
        free = self.max_num_seqs - sum(map(num_seats, self.running))
        if out is not None and self.pipeline_depth > 1:
            share = cdiv(sum(map(num_seats, [*self.running, *self.waiting])), self.pipeline_depth)
            free = min(free, share - sum(map(num_seats, out.seqs)))
        return free

    def preempt(self, seq: Sequence, out: SchedulerOutput, swap: bool = True) -> None:
        """Take the KV blocks of seq and of its request's other running sequences back. Swap copies their KV to the
        host pool, to come back later; recompute (also when the host pool is full) drops it: they prefill again."""
        group = [s for s in seq.group if s is seq or s.status == SequenceStatus.RUNNING]
        for s in group:
            if s in self.running:
                self.running.remove(s)
        self.stats.num_preemptions += 1
        out.preempted += group
        swap = swap and self._swap_out(group, out)
        for s in reversed(group):  # to the front of their queue, in order
            s.spec_token_ids = []  # (lookahead tokens are proposed for running sequences only)
            if not swap:
                self.block_manager.deallocate(s)
            s.status = SequenceStatus.SWAPPED if swap else SequenceStatus.WAITING
            (self.swapped if swap else self.waiting).add(s, front=True)

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """While the most urgent waiting request lacks blocks or a seat, less urgent running ones give theirs up,
        least urgent first. They recompute: a swapped victim comes back before new ones and takes its blocks back."""
        if not self.waiting or self.swapped:
            return
        seq = self.waiting[0]
        while (self.running and priority_key(self.running[-1]) > priority_key(seq) and (
                num_seats(seq) > self._num_free_seats() or not self.block_manager.can_allocate(seq))):
            self.preempt(self.running.pop(), out, swap=False)
            self.stats.num_priority_preemptions += 1

    # ---- swap (preemption_mode="swap"): a second BlockManager, over the host pool ----------------------
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
            group = self.swapped.pop_group()
            if sum(map(num_seats, group)) > self._num_free_seats() or not self.block_manager.can_swap_in(group):
                self.swapped.extendleft(reversed(group))
                break
            out.blocks_to_swap_in += self.block_manager.swap_in(group, self.host_block_manager)
            self.stats.num_swapped_in += 1
            for seq in group:
                seq.status = SequenceStatus.RUNNING
                self.running.add(seq)
                budget -= self._schedule_chunk(seq, budget, out) if budget > 0 else 0

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
        while budget > 0 and (seq := self._next_waiting(out)) is not None:
            # All of the prompt's blocks, though only a chunk may run now (simpler than V1's per chunk, never stalls).
            if seq in out.preempted or not self.block_manager.allocate(seq):
                break
            self._admit(seq)
            budget -= self._schedule_chunk(seq, budget, out)

    # ---- after the forward ----------------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, token_ids: list[int]) -> list[Sequence]:
        """Take in a step's sampled tokens, in batch order: one per sequence that samples, n for a prompt that forks,
        1 + k for one that verified k lookahead tokens (its emitted run, then PLACEHOLDER_TOKEN_IDs), none where the
        request picks its own (raw_logits). Returns each sequence once per token it got; one that finished while
        the step was in flight (async scheduling, an abort) drops its tokens."""
        sampled = iter(token_ids)
        updated = []
        for seq, start, num_tokens, do_sample, forks in zip(out.seqs, out.num_computed_tokens,
                                                            out.num_scheduled_tokens, out.do_sample, out.forks):
            lookahead = out.scheduled_spec_decode_tokens.get(seq.seq_id, [])
            num_drawn = 0 if seq.raw_logits else do_sample + len(forks) + len(lookahead)
            new_token_ids = [next(sampled) for _ in range(num_drawn)]
            if seq.is_finished:
                continue
            if seq.status == SequenceStatus.RUNNING and not lookahead:  # (a preempted one lost these blocks)
                self.block_manager.hash_blocks(seq, start, start + num_tokens)  # their KV is written now
            if not do_sample:  # a prompt chunk short of the end: nothing to sample yet
                self.stats.num_chunked_prefills += 1
                continue
            seq.num_output_placeholders -= 1
            if lookahead:
                updated += self._accept_run(out, seq, start, lookahead, new_token_ids)
                continue
            for child in forks:
                self._fork(seq, child, start + num_tokens)
            for s, token_id in zip([seq, *forks], new_token_ids):
                self._append_tokens(s, [token_id])
                updated.append(s)
                if s.finish_reason is not None:
                    self.finish(s)
        return updated

    def _accept_run(self, out: SchedulerOutput, seq: Sequence, start: int, lookahead: list[int],
                    row: list[int]) -> list[Sequence]:
        """seq computed its newest token and k lookahead tokens (seed 001's lookahead slots: speculative decoding's
        drafts), and a + 1 tokens were emitted. The KV of the k - a rejected ones is wrong for what follows: roll
        num_computed_tokens back over it, hash only blocks full of verified KV, give the blocks past them back."""
        emitted = [t for t in row if t != PLACEHOLDER_TOKEN_ID]
        # Preempted while the step ran (async scheduling): swapped, its blocks are in the host pool; else it has none.
        pool = {SequenceStatus.RUNNING: self.block_manager,
                SequenceStatus.SWAPPED: self.host_block_manager}.get(seq.status)
        seq.num_computed_tokens -= len(lookahead) + 1 - len(emitted) if pool is not None else 0
        seq.spec_token_ids = []
        self.stats.spec_decoding.observe(len(lookahead), len(emitted) - 1)
        out.num_accepted_tokens[seq.seq_id] = len(emitted) - 1  # (the step's record shows it)
        self._append_tokens(seq, emitted)
        verified = min(seq.num_computed_tokens, len(seq.token_ids))  # (the last emitted token has no KV yet)
        if pool is self.block_manager:
            pool.hash_blocks(seq, start, verified)
        if seq.finish_reason is not None:
            self.finish(seq)
        elif pool is not None:
            pool.truncate(seq, verified)
        return [seq] * (len(seq.token_ids) - start - 1)  # once per token it got

    def _append_tokens(self, seq: Sequence, token_ids: list[int]) -> None:
        """Append one at a time, each checked for EOS, the stop tokens and max_tokens; a finish drops the rest
        (the caller frees the blocks). Before min_tokens the sampler rules EOS and the stop tokens out."""
        params = seq.sampling_params
        for token_id in token_ids:
            seq.append_token(token_id)
            self.stats.num_generated_tokens += 1
            if (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
                seq.finish_reason = "stop"
            elif seq.num_completion_tokens >= params.max_tokens:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                break

    def _fork(self, parent: Sequence, child: Sequence, num_computed_tokens: int) -> None:
        """child, another sequence of parent's request, starts as a copy of it (early vLLM's fork): it shares
        its KV blocks, wherever they are (none if it was preempted to recompute), and joins its queue."""
        pool = {SequenceStatus.RUNNING: self.block_manager, SequenceStatus.SWAPPED: self.host_block_manager}
        if parent.status in pool:
            pool[parent.status].fork(parent, child)
            child.num_computed_tokens = num_computed_tokens
        child.status = parent.status
        queue = {SequenceStatus.RUNNING: self.running, SequenceStatus.SWAPPED: self.swapped,
                 SequenceStatus.WAITING: self.waiting}[parent.status]
        queue.insert(queue.index(parent) + child.index, child)  # the request's sequences stay side by side

    def finish(self, seq: Sequence) -> None:
        """Take seq out for good, its blocks freed: it finished (maybe while preempted), stopped, aborted or failed."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            self.block_manager.deallocate(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.host_block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
