"""Swap preemption (preemption_mode="swap"; vLLM v0.6.3's scheduler, early vLLM's block manager): a
preempted request's KV blocks are copied to a pool in host memory instead of being dropped, and
copied back when there is room, so it goes on where it stopped instead of prefilling again.

The host pool has its own BlockManager (the same books: ref counts, so blocks a request's sequences
share move once and stay shared) over a tensor each rank allocates (host_kv_pool.py:
kv_pools["swap_space"]). SwapScheduler is the core's Scheduler with a third queue, `swapped`: a
request whose KV the host pool cannot take recomputes as in the core; swapped requests come back
before any new prompt is admitted (V0's _schedule_swapped).
"""
from collections.abc import Callable
from dataclasses import dataclass, field

from nanoserve.config import Config
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.core import EngineCore
from nanoserve.engine.model_runner import Executor
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.sequence import RequestQueue, Sequence, SequenceStatus, num_seats
from nanoserve.host_kv_pool import allocate_host_pool, copy_host_blocks


def move_blocks(seqs: list[Sequence], src: BlockManager,
                dst: BlockManager) -> list[tuple[int, int]]:
    """Move the blocks of seqs from pool src to pool dst; a block they share moves once and stays
    shared; the null block (sliding_window/: in place of blocks freed behind the window) stays the
    null block. Returns the (src block, dst block) pairs whose KV the model runners copy before the
    forward."""
    null = {} if src.null_block is None else {src.null_block: dst.null_block}
    mapping: dict[int, int] = dict(null)
    for seq in seqs:
        for block_id in seq.block_table:
            if block_id in mapping:
                dst.share([mapping[block_id]])
            else:
                mapping[block_id] = dst.allocate_block()
        src.free(seq.block_table)
        seq.block_table = [mapping[b] for b in seq.block_table]
    return [(s, d) for s, d in mapping.items() if s not in null]


def live_blocks(seqs: list[Sequence], pool: BlockManager) -> set[int]:
    """The blocks seqs hold in pool (its null block is none of them)."""
    return {b for seq in seqs for b in seq.block_table} - {pool.null_block}


@dataclass
class SwapSchedulerOutput(SchedulerOutput):
    """The plan, with the step's swaps: (device block, host block) out, (host block, device block)
    in."""

    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)


class SwapScheduler(Scheduler):
    """The scheduler with preemption_mode="swap"; with "recompute", the core's."""

    output_class = SwapSchedulerOutput
    host_block_manager: BlockManager  # the swap pool's books, in host memory (SwapEngineCore's)

    def __init__(self, config: Config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.swap = config.scheduler_config.preemption_mode == "swap"
        self.swapped: RequestQueue = self.new_queue()

    def is_finished(self) -> bool:
        return super().is_finished() and not self.swapped

    def queues(self) -> dict[str, RequestQueue]:
        return {**super().queues(), "swapped": self.swapped} if self.swap else super().queues()

    def _next_waiting(self, out: SchedulerOutput) -> Sequence | None:
        """No new prompt while a request is swapped out (V0): it comes back first."""
        return None if self.swapped else super()._next_waiting(out)

    def _schedule_after_running(self, out: SchedulerOutput, budget: int) -> None:
        if self.swapped:
            self._schedule_swapped(out, budget)
        else:
            super()._schedule_after_running(out, budget)

    def preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Copy the KV of seq's request to the host pool, if it has room; else recompute (the core's
        preempt)."""
        group = [s for s in seq.group if s is seq or s.status == SequenceStatus.RUNNING]
        if not self.swap or (self.host_block_manager.num_free_blocks
                             < len(live_blocks(group, self.block_manager))):
            return super().preempt(seq, out)
        self._take_running(seq, out)
        out.blocks_to_swap_out += move_blocks(group, self.block_manager, self.host_block_manager)
        self.stats.num_swapped_out += 1
        for s in reversed(group):
            # to the front of the swapped queue, in order; they keep num_computed_tokens
            s.status = SequenceStatus.SWAPPED
            self.swapped.add(s, front=True)

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> None:
        """Swap requests back in, first in line first, while their blocks fit; they go on where they
        stopped."""
        while self.swapped and budget > 0:
            group = self.swapped.pop_group()
            if sum(map(num_seats, group)) > self.num_free_seats() or not self._can_swap_in(group):
                self.swapped.extendleft(reversed(group))
                break
            out.blocks_to_swap_in += move_blocks(group, self.host_block_manager, self.block_manager)
            for seq in group:
                # full blocks rejoin the prefix cache at once: their copies run before the forward
                self.block_manager.hash_blocks(seq, 0, seq.num_computed_tokens)
            self.stats.num_swapped_in += 1
            for seq in group:
                seq.status = SequenceStatus.RUNNING
                self.running.add(seq)
                budget -= self._schedule_chunk(seq, budget, out) if budget > 0 else 0

    def _can_swap_in(self, seqs: list[Sequence]) -> bool:
        """Room for the swapped-out blocks of seqs, plus a block for each newest token that needs
        one (in a group of several, each may need a copy of a shared last block)?"""
        bm = self.block_manager  # (a prompt's next chunk only, where it allocates chunk by chunk)
        num_new = sum(max(bm.num_table_blocks(seq, seq.num_computed_tokens) - len(seq.block_table),
                          len(seqs) > 1) for seq in seqs)
        num_swapped = len(live_blocks(seqs, self.host_block_manager))
        return num_swapped + num_new <= self.block_manager.num_free_blocks

    def home(self, seq: Sequence):
        if seq.status == SequenceStatus.SWAPPED:
            return self.swapped, self.host_block_manager
        return super().home(seq)


class SwapExecutor(Executor):
    """Runs the step's swaps on every rank before the forward: swap-outs read the device pool,
    swap-ins write it."""

    def copy_kv_out(self, out: SwapSchedulerOutput) -> None:
        if out.blocks_to_swap_out:
            self.call("apply", copy_host_blocks, out.blocks_to_swap_out, "device", "swap_space")
        super().copy_kv_out(out)

    def copy_kv_in(self, out: SwapSchedulerOutput) -> None:
        if out.blocks_to_swap_in:
            self.call("apply", copy_host_blocks, out.blocks_to_swap_in, "swap_space", "device")
        super().copy_kv_in(out)


class SwapEngineCore(EngineCore):
    """With preemption_mode="swap", every rank allocates its host pool (swap_space GiB), and the
    scheduler keeps its books in a pool of the device pool's class (the window's too)."""

    def __init__(self, config: Config, *,
                 block_manager_class: Callable[..., BlockManager] = BlockManager, **parts):
        super().__init__(config, block_manager_class=block_manager_class, **parts)
        if config.scheduler_config.preemption_mode != "swap":
            return
        try:  # a host pool too small for a block ends the engine's workers now
            num_blocks = self.executor.call("apply", allocate_host_pool, "swap_space",
                                            config.scheduler_config.swap_space)
            self.scheduler.host_block_manager = block_manager_class(
                num_blocks, config.block_size, enable_prefix_caching=False)
        except BaseException:
            self.shutdown()
            raise
