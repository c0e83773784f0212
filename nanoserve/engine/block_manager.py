from collections import deque

import numpy as np
import xxhash

from nanoserve.engine.seams import Seams
from nanoserve.engine.sequence import Sequence


def compute_hash(token_ids: list[int], prefix_hash: int) -> int:
    """A block's hash covers its own tokens and, through prefix_hash, every token before it."""
    h = xxhash.xxh64()
    if prefix_hash != -1:
        h.update(prefix_hash.to_bytes(8, "little"))
    h.update(np.array(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


def hash_root(seq: Sequence) -> int:
    """The hash seq's first block chains from: -1, or its LoRA adapter's (the same tokens, other KV)."""
    return -1 if seq.lora_request is None else seq.lora_request.hash_root


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1  # -1: not a full, computed block, so not shareable
        self.token_ids: list[int] = []


class BlockManager:
    """A fixed pool of KV blocks, shared between sequences by reference counting.

    Prefix caching: a full block is registered under its chained hash once its KV is computed, and a later prompt
    with the same prefix reuses it instead of recomputing it. A freed block keeps its hash, so it can still be hit
    until it is handed out for other tokens (then, with a second tier, seams.kv_cache_tier, its KV moves there).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 seams: Seams | None = None):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.seams = Seams() if seams is None else seams  # the engine's: its kv_cache_tier, if any
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # left end is evicted first

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def _take_free_block(self, block_id: int) -> Block:
        block = self.blocks[block_id]
        self.free_block_ids.remove(block_id)
        block.ref_count = 1
        return block

    def allocate_block(self) -> int:
        """A free block for new tokens: the least recently freed one; its cached hash, if any, is forgotten."""
        block = self._take_free_block(self.free_block_ids[0])
        self._uncache(block, offload=True)
        return block.block_id

    def _uncache(self, block: Block, offload: bool) -> None:
        """block's hash stops pointing at it; offload: its KV goes to the second tier first, if there is one."""
        if self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]
            if offload and self.seams.kv_cache_tier is not None:
                self.seams.kv_cache_tier.offload(block.block_id, block.hash, block.token_ids)
        block.hash, block.token_ids = -1, []

    def _cached_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Block ids holding the longest cached prefix of seq, verified token by token; then the hashes of the
        blocks after it that the second tier holds (kv_cache_tier), to copy back."""
        hit_ids, tier_hashes, tier = [], [], self.seams.kv_cache_tier
        # A request for prompt_logprobs computes its whole prompt: cached tokens would get no logits (vLLM V1).
        if not self.enable_prefix_caching or seq.prompt_logprobs is not None:
            return hit_ids, tier_hashes
        prefix_hash = hash_root(seq)
        for i in range((len(seq) - 1) // self.block_size):  # the last token is always computed: it needs logits
            token_ids = seq.block(i)
            prefix_hash = compute_hash(token_ids, prefix_hash)
            block_id = self.hash_to_block_id.get(prefix_hash)
            if not tier_hashes and block_id is not None and self.blocks[block_id].token_ids == token_ids:
                hit_ids.append(block_id)
            elif tier is not None and tier.lookup(prefix_hash, token_ids):
                tier_hashes.append(prefix_hash)
            else:
                break
        return hit_ids, tier_hashes

    def _num_blocks_needed(self, seq: Sequence, hit_ids: list[int]) -> int:
        # A cached block nobody holds sits in the free queue, so taking it costs a free block too.
        return seq.num_blocks - sum(self.blocks[b].ref_count > 0 for b in hit_ids)

    def num_new_tokens(self, seq: Sequence) -> int:
        """How many of seq's tokens allocate(seq) would leave to compute: those past its cached prefix."""
        return len(seq) - sum(map(len, self._cached_prefix(seq))) * self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        return self._num_blocks_needed(seq, self._cached_prefix(seq)[0]) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> bool:
        """Give seq's prompt its blocks, reusing cached ones (a block the second tier holds comes back into a fresh
        block, cached at once: its copy runs before the forward). All or nothing: False changes no state."""
        hit_ids, tier_hashes = self._cached_prefix(seq)
        if self._num_blocks_needed(seq, hit_ids) > self.num_free_blocks:
            return False
        for block_id in hit_ids:
            if self.blocks[block_id].ref_count > 0:
                self.blocks[block_id].ref_count += 1
            else:
                self._take_free_block(block_id)
        for i, block_hash in enumerate(tier_hashes, len(hit_ids)):
            block = self.blocks[self.allocate_block()]
            block.hash, block.token_ids = block_hash, seq.block(i)
            self.hash_to_block_id[block_hash] = block.block_id
            self.seams.kv_cache_tier.load(block_hash, block.block_id)
            hit_ids.append(block.block_id)
        seq.block_table = hit_ids + [self.allocate_block() for _ in range(seq.num_blocks - len(hit_ids))]
        seq.num_cached_tokens = seq.num_computed_tokens = len(hit_ids) * self.block_size
        if self.seams.kv_connector is not None:  # more of the prompt's KV, computed by another engine (kv_transfer/)
            self.seams.kv_connector.update_state_after_alloc(seq)
        return True

    def uncache(self, block_ids: set[int]) -> None:
        """Take blocks out of the prefix cache: their KV is not what their hash says (a copy into them failed)."""
        for block_id in block_ids:
            self._uncache(self.blocks[block_id], offload=False)

    def hash_blocks(self, seq: Sequence, start: int, end: int) -> None:
        """Register the blocks that became full of computed KV as seq's tokens start..end were computed. Only after
        the forward: a block registered earlier could be hit while its KV is still unwritten."""
        if not self.enable_prefix_caching:
            return
        for i in range(start // self.block_size, end // self.block_size):
            block = self.blocks[seq.block_table[i]]
            prefix_hash = self.blocks[seq.block_table[i - 1]].hash if i > 0 else hash_root(seq)
            block.token_ids = seq.block(i)
            block.hash = compute_hash(block.token_ids, prefix_hash)
            self.hash_to_block_id[block.hash] = block.block_id

    def num_new_blocks(self, seq: Sequence) -> int:
        """Free blocks seq takes before this step writes its uncomputed tokens: one per block they spill into,
        plus a private copy of a last block a forked sibling shares, if they land in it (copy-on-write)."""
        shared = bool(seq.block_table) and self.blocks[seq.block_table[-1]].ref_count > 1
        lands_in_last = seq.num_computed_tokens < len(seq.block_table) * self.block_size
        return seq.num_blocks - len(seq.block_table) + (shared and lands_in_last)

    def may_append(self, seq: Sequence) -> list[tuple[int, int]]:
        """Reserve slots for the tokens this step computes (when num_new_blocks fit). Returns the (source,
        destination) block pair to copy first when the last block was shared, else []."""
        copies = []
        if self.num_new_blocks(seq) > seq.num_blocks - len(seq.block_table):  # the last block is shared
            # Copy-on-write: a forked sibling shares the partly filled last block and must not see these tokens.
            # Write into a private copy; the siblings keep the original.
            src = seq.block_table[-1]
            self.free([src])
            seq.block_table[-1] = self.allocate_block()
            copies.append((src, seq.block_table[-1]))
        seq.block_table += [self.allocate_block() for _ in range(seq.num_blocks - len(seq.block_table))]
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child starts as a copy of parent: it shares all its blocks (one more reference each)."""
        child.block_table = list(parent.block_table)
        self.share(child.block_table)

    def share(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self.blocks[block_id].ref_count += 1

    def free(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):  # the tail first: the left end goes first, so shared prefixes last
            self.blocks[block_id].ref_count -= 1
            if self.blocks[block_id].ref_count == 0:
                self.free_block_ids.append(block_id)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back seq's blocks past its first num_tokens tokens (speculative rollback: rejected lookahead
        tokens'). Never hashed, they go to the front of the free queue, before any block the cache can still hit."""
        keep = -(-num_tokens // self.block_size)  # ceiling division
        tail, seq.block_table = seq.block_table[keep:], seq.block_table[:keep]
        for block_id in tail:
            self.blocks[block_id].ref_count -= 1
        self.free_block_ids.extendleft(reversed([b for b in tail if self.blocks[b].ref_count == 0]))

    def deallocate(self, seq: Sequence) -> None:
        self.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
