"""Sliding-window attention's block manager: a sequence gives back the blocks its window has left
behind.

A layer with a sliding window W computes the token at position p from the keys at positions
p - W + 1 .. p only (layers/attention.py). When every layer is windowed, a block whose tokens all
lie before the window of the next token to compute is read by no layer again: it goes back to the
pool, and its place in the block table holds the null block (vLLM V1's SlidingWindowManager), so
logical block i stays at index i for the model runner's slot arithmetic. Once its prompt is
computed, a sequence holds at most ceil(W / block_size) + 1 blocks, however long it runs. A freed
block keeps its hash, as any freed block: a later prompt can still hit it.

A prompt (or a context recomputed after a preemption) gets its blocks chunk by chunk, as
the scheduler computes it (vLLM V1's allocate_slots): a chunk of C tokens takes its blocks
once those behind its window are freed, so a sequence never holds more than
ceil((W - 1 + C) / block_size) + 1 blocks, and a request is admitted by that bound, not by
its length (vLLM V1's SlidingWindowSpec.max_memory_usage_bytes).
"""
from collections import deque

from nanoserve.config import Config
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.seams import Seams
from nanoserve.engine.sequence import Sequence
from nanoserve.utils.math import cdiv

# Never handed out and never written, so its KV stays zeros: the attention kernels may read it for a
# key before the window, and mask it out. Each pool (the device's, the swap pool) keeps its own
# block 0 for it.
NULL_BLOCK = 0


class SlidingWindowBlockManager(BlockManager):
    null_block = NULL_BLOCK

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 seams: Seams | None = None, *, sliding_window: int,
                 max_num_batched_tokens: int = Config.max_num_batched_tokens):
        super().__init__(num_blocks, block_size, enable_prefix_caching, seams)
        self.sliding_window = sliding_window
        self.max_num_batched_tokens = max_num_batched_tokens  # the largest chunk a step computes
        self.refused: deque[str] = deque(maxlen=16)  # the latest refusals' reasons (dashboard)
        self.num_refused = 0
        self.free_block_ids.remove(NULL_BLOCK)
        self.blocks[NULL_BLOCK].ref_count = 1  # pinned: the entries that name it are no references
        self.num_blocks -= 1  # the null block is no block of the pool's
        self.num_freed_behind_window = 0  # blocks handed back so far (the step records show it)

    def num_skipped_blocks(self) -> int:
        return self.num_freed_behind_window

    def first_needed_block(self, seq: Sequence) -> int:
        """The next token to compute sits at num_computed_tokens and sees back to
        num_computed_tokens - W + 1: no layer reads the blocks before this one again."""
        first = max(seq.num_computed_tokens - self.sliding_window + 1, 0) // self.block_size
        return min(first, len(seq.block_table))

    def free_behind_window(self, seq: Sequence) -> list[int]:
        """Give back seq's blocks behind its window; returns their ids."""
        n = self.first_needed_block(seq)
        behind = [b for b in seq.block_table[:n] if b != NULL_BLOCK]
        if behind:
            # a new list: the persistent batch rewrites the row of a sequence whose list changed
            seq.block_table = [NULL_BLOCK] * n + seq.block_table[n:]
            self.free(behind)
            self.num_freed_behind_window += len(behind)
        return behind

    def free(self, block_ids: list[int]) -> None:
        super().free([b for b in block_ids if b != NULL_BLOCK])

    def share(self, block_ids: list[int]) -> None:
        super().share([b for b in block_ids if b != NULL_BLOCK])

    def _cached_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """vLLM V1's rule for a window: a prefix of k blocks is a hit when the blocks the window of
        its first uncomputed token reads (the last ceil((W - 1) / block_size) of them) are cached;
        those before it may be gone, and are null blocks in the table. The longest such prefix; no
        second tier
        (window_block_manager refuses one)."""
        if not self.enable_prefix_caching or seq.prompt_logprobs is not None:
            return [], []
        # (the last token needs logits)
        hashes = seq.block_hashes[: (len(seq) - 1) // self.block_size]
        cached = [self.cached_block_id(h, seq.block(i)) for i, h in enumerate(hashes)]
        need = cdiv(self.sliding_window - 1, self.block_size)
        for num_hit in range(len(cached), 0, -1):
            window = cached[max(num_hit - need, 0) : num_hit]
            if None not in window:
                return [NULL_BLOCK] * (num_hit - len(window)) + window, []
        return [], []

    def allocate(self, seq: Sequence, max_new_tokens: int | None = None) -> bool:
        allocated = super().allocate(seq, max_new_tokens)
        # (the base class counted the null entries of a hit as references)
        self.blocks[NULL_BLOCK].ref_count = 1
        return allocated

    def hash_blocks(self, seq: Sequence, start: int, end: int) -> None:
        """The base class's registration; then, the KV of start..end being written, the blocks
        behind the window are freed."""
        super().hash_blocks(seq, start, end)
        self.free_behind_window(seq)

    def cache_block(self, block_id: int, block_hash: int, token_ids: list[int]) -> None:
        if block_id != NULL_BLOCK:  # (freed already: a window shorter than a block)
            super().cache_block(block_id, block_hash, token_ids)

    def num_table_blocks(self, seq: Sequence, start: int, num_new_tokens: int | None = None) -> int:
        """Only up to the end of the next chunk (None: a whole budget's), not the whole prompt."""
        chunk = self.max_num_batched_tokens if num_new_tokens is None else num_new_tokens
        return cdiv(min(len(seq), start + chunk), self.block_size)

    def num_new_blocks(self, seq: Sequence) -> int:
        """The next chunk's blocks (and a copy of a shared last block), less those may_append frees
        first: behind the window, held by seq alone (under async scheduling, the step in flight has
        moved the window since they were last freed)."""
        behind = seq.block_table[: self.first_needed_block(seq)]
        num_freed = sum(b != NULL_BLOCK and self.blocks[b].ref_count == 1 for b in behind)
        num_new = self.num_table_blocks(seq, seq.num_computed_tokens) - len(seq.block_table)
        return max(num_new + self.copies_last_block(seq) - num_freed, 0)

    def may_append(self, seq: Sequence, num_new_tokens: int | None = None) -> list[tuple[int, int]]:
        self.free_behind_window(seq)  # first, so the blocks it gives back can take the new tokens
        return super().may_append(seq, num_new_tokens)

    def max_blocks_per_seq(self, num_tokens: int) -> int:
        """The most blocks a sequence of num_tokens holds at once: its window's W - 1 keys and a
        chunk (or all its tokens, if fewer), and one more where they straddle a block's edge."""
        window_and_chunk = self.sliding_window - 1 + self.max_num_batched_tokens
        return cdiv(min(window_and_chunk, num_tokens), self.block_size) + 1

    def check_fits(self, num_prompt_tokens: int, max_tokens: int, n: int) -> None:
        """A request fits if all its blocks do (the core's count), or if its n sequences'
        windows and chunks do at their peak; else it never will, and is refused now rather
        than wait forever."""
        try:
            super().check_fits(num_prompt_tokens, max_tokens, n)
        except ValueError:
            num_blocks = n * self.max_blocks_per_seq(num_prompt_tokens + max_tokens)
            if num_blocks > self.num_blocks:
                reason = (f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) "
                          f"never fits: with sliding_window {self.sliding_window} and prefill "
                          f"chunks of up to {self.max_num_batched_tokens} tokens "
                          f"(max_num_batched_tokens), {n} sequence(s) hold up to {num_blocks} KV "
                          f"blocks at once, but the pool has {self.num_blocks} "
                          f"(num_kvcache_blocks, block_size {self.block_size}); set "
                          "enable_chunked_prefill=True with a smaller max_num_batched_tokens, or "
                          "add blocks")
                self.refused.append(reason)
                self.num_refused += 1
                raise ValueError(reason) from None
