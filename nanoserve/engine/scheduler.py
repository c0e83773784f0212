from collections import deque
from dataclasses import dataclass

from nanoserve.config import Config
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerStats:
    """Counters a student can watch: `llm.stats`."""

    num_steps: int = 0
    num_prefill_steps: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0  # tokens admitted by prefills, cached or not (a preempted request counts again)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache instead of computed
    num_generated_tokens: int = 0


class Scheduler:
    """nano-vllm's policy: prefill whenever a waiting sequence fits, else decode everything running."""

    def __init__(self, config: Config, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.eos_token_ids = set(config.eos_token_ids)
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.stats = SchedulerStats()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Pick the next batch. Returns (sequences, is_prefill)."""
        self.stats.num_steps += 1
        scheduled = self._schedule_prefill()
        if scheduled:
            self.stats.num_prefill_steps += 1
            return scheduled, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        num_batched_tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if num_batched_tokens + len(seq) > self.max_num_batched_tokens:
                break
            if not self.block_manager.allocate(seq):
                break
            num_batched_tokens += len(seq) - seq.num_cached_tokens
            self.stats.num_prompt_tokens += len(seq)
            self.stats.num_cached_tokens += seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                # LIFO: the newest request gives up its KV first, so the oldest ones finish.
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)  # nobody else to take from: seq waits for memory itself
                    break
            else:
                self.block_manager.may_append(seq)
                scheduled.append(seq)
        # Keep the order for the next step: scheduled ones first, then those over max_num_seqs.
        self.running.extendleft(reversed(scheduled))
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop seq's KV and queue it first; its prefill will redo all tokens."""
        self.stats.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is, returning its blocks; a failed call must not leak KV."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Append each sampled token; finish and free the sequences that are done. Returns those."""
        finished = []
        for seq, token_id in zip(seqs, token_ids):
            start, seq.num_computed_tokens = seq.num_computed_tokens, len(seq)
            self.block_manager.hash_blocks(seq, start)  # their KV is written now: others may reuse it
            seq.append_token(token_id)
            self.stats.num_generated_tokens += 1
            seq.finish_reason = self._finish_reason(seq, token_id)
            if seq.finish_reason is not None:
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.sampling_params
        if (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
            return "stop"
        if seq.num_completion_tokens >= params.max_tokens:
            return "length"
        return None
