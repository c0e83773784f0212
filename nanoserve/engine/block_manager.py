from collections import deque

from nanoserve.engine.seams import Seams
from nanoserve.engine.sequence import Sequence


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1  # -1: not a full, computed block, so not shareable
        self.token_ids: list[int] = []


class BlockManager:
    """A pool of KV blocks shared by reference counting. Prefix caching: a prompt reuses full
    computed blocks by chained hash; a freed block keeps its hash until handed out again (its KV
    may go to seams.kv_cache_tier)."""

    # A block that stands in a table for KV nobody needs any more (vLLM's): none here.
    null_block: int | None = None

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 seams: Seams | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.seams = Seams() if seams is None else seams  # the engine's: its kv_cache_tier, if any
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # left end is evicted first

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def allocate_block(self) -> int:
        """A free block for new tokens: the least recently freed one;
        its cached hash, if any, is forgotten."""
        block_id = self.free_block_ids.popleft()
        self.blocks[block_id].ref_count = 1
        self.uncache([block_id], offload=True)
        return block_id

    def uncache(self, block_ids: list[int] | set[int], offload: bool = False) -> None:
        """Take blocks out of the prefix cache: handed out anew (offload: KV to the second tier
        first) or miscopied."""
        for block in (self.blocks[b] for b in block_ids):
            if self.hash_to_block_id.get(block.hash) == block.block_id:
                del self.hash_to_block_id[block.hash]
                if offload and self.seams.kv_cache_tier is not None:
                    self.seams.kv_cache_tier.offload(block.block_id, block.hash, block.token_ids)
            block.hash, block.token_ids = -1, []

    def _cached_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Block ids of seq's longest cached prefix (token-checked),
        then hashes of the second tier's next blocks."""
        hit_ids, tier_hashes, tier = [], [], self.seams.kv_cache_tier
        # A request for prompt_logprobs computes its whole prompt: cached tokens would get no
        # logits (vLLM V1).
        if not self.enable_prefix_caching or seq.prompt_logprobs is not None:
            return hit_ids, tier_hashes
        # (The last token is always computed: it needs logits.)
        for i, prefix_hash in enumerate(seq.block_hashes[: (len(seq) - 1) // self.block_size]):
            block_id = self.cached_block_id(prefix_hash, seq.block(i))
            if not tier_hashes and block_id is not None:
                hit_ids.append(block_id)
            elif tier is not None and tier.lookup(prefix_hash, seq.block(i)):
                tier_hashes.append(prefix_hash)
            else:
                break
        return hit_ids, tier_hashes

    def num_offloaded_blocks(self) -> tuple[int, int]:
        """The second tier's books (the step records show them): its blocks holding an evicted
        cached block's KV, and all its blocks; (0, 0) without a tier."""
        tier = self.seams.kv_cache_tier
        return (0, 0) if tier is None else (len(tier.cached), tier.num_blocks)

    def num_skipped_blocks(self) -> int:
        """Blocks handed back from running sequences' tables so far, null_block in their place
        (vLLM's skipped blocks: those behind a window). None here: a sequence holds its blocks."""
        return 0

    def cached_block_id(self, block_hash: int, token_ids: list[int]) -> int | None:
        """The block holding the KV of token_ids under block_hash,
        if cached (its tokens checked too)."""
        block_id = self.hash_to_block_id.get(block_hash)
        is_hit = block_id is not None and self.blocks[block_id].token_ids == token_ids
        return block_id if is_hit else None

    def check_fits(self, num_prompt_tokens: int, max_tokens: int, n: int) -> None:
        """Refuse a request whose blocks never fit: the prompt's full blocks are shared, and each
        of the n sequences fills the rest on its own."""
        bs = self.block_size
        num_blocks = num_prompt_tokens // bs + n * -(-(num_prompt_tokens % bs + max_tokens) // bs)
        if num_blocks > self.num_blocks:
            raise ValueError(f"prompt + max_tokens needs {num_blocks} KV blocks but "
                             f"num_kvcache_blocks is {self.num_blocks} (block_size {bs})")

    def can_allocate(self, seq: Sequence, hit_ids: list[int] | None = None) -> bool:
        hit_ids = self._cached_prefix(seq)[0] if hit_ids is None else hit_ids
        # A cached block nobody holds sits in the free queue, so taking it costs a free block too.
        num_held_hits = sum(self.blocks[b].ref_count > 0 for b in hit_ids)
        need = self.num_table_blocks(seq, len(hit_ids) * self.block_size)
        return need - num_held_hits <= self.num_free_blocks

    def allocate(self, seq: Sequence, max_new_tokens: int | None = None) -> bool:
        """Give seq's prompt its blocks, reusing cached ones (and loading tier hits). False changes
        no state: the blocks do not fit, or more than max_new_tokens are left to compute past the
        cached prefix."""
        hit_ids, tier_hashes = self._cached_prefix(seq)
        num_new_tokens = len(seq) - (len(hit_ids) + len(tier_hashes)) * self.block_size
        over_budget = max_new_tokens is not None and num_new_tokens > max_new_tokens
        if over_budget or not self.can_allocate(seq, hit_ids):
            return False
        for block_id in hit_ids:
            if self.blocks[block_id].ref_count == 0:  # nobody held it: out of the free queue
                self.free_block_ids.remove(block_id)
            self.blocks[block_id].ref_count += 1
        for i, block_hash in enumerate(tier_hashes, len(hit_ids)):
            block_id = self.allocate_block()
            self.cache_block(block_id, block_hash, seq.block(i))
            self.seams.kv_cache_tier.load(block_hash, block_id)
            hit_ids.append(block_id)
        num_new = self.num_table_blocks(seq, len(hit_ids) * self.block_size) - len(hit_ids)
        seq.block_table = hit_ids + [self.allocate_block() for _ in range(num_new)]
        seq.num_cached_tokens = seq.num_computed_tokens = len(hit_ids) * self.block_size
        # More of the prompt's KV, computed by another engine (kv_transfer/).
        if self.seams.kv_connector is not None:
            self.seams.kv_connector.update_state_after_alloc(seq)
        return True

    def hash_blocks(self, seq: Sequence, start: int, end: int) -> None:
        """Register the blocks tokens start..end filled, after the forward: earlier, a hit could
        read unwritten KV."""
        first, last = start // self.block_size, end // self.block_size
        if not self.enable_prefix_caching or first == last:  # (most decode steps fill no block)
            return
        hashes = seq.block_hashes  # (full blocks of known tokens only)
        for i in range(first, min(last, len(hashes))):
            self.cache_block(seq.block_table[i], hashes[i], seq.block(i))

    def cache_block(self, block_id: int, block_hash: int, token_ids: list[int]) -> None:
        """block_id holds the KV of token_ids, named by block_hash: a later prompt may hit it."""
        block = self.blocks[block_id]
        block.hash, block.token_ids = block_hash, token_ids
        self.hash_to_block_id[block_hash] = block_id

    def num_table_blocks(self, seq: Sequence, start: int,
                         num_new_tokens: int | None = None) -> int:
        """seq's table length for num_new_tokens from start: here a block per token it has."""
        return seq.num_blocks

    def num_new_blocks(self, seq: Sequence) -> int:
        """Free blocks seq's uncomputed tokens take, a private copy of a shared last block included
        (copy-on-write)."""
        return seq.num_blocks - len(seq.block_table) + self.copies_last_block(seq)

    def copies_last_block(self, seq: Sequence) -> bool:
        """Copy-on-write: seq's new tokens land in its last block,
        and a forked sibling shares that block."""
        lands_in_last = seq.num_computed_tokens < len(seq.block_table) * self.block_size
        return lands_in_last and self.blocks[seq.block_table[-1]].ref_count > 1

    def may_append(self, seq: Sequence, num_new_tokens: int | None = None) -> list[tuple[int, int]]:
        """Reserve slots for the step's num_new_tokens (once num_new_blocks fit); returns the
        copy-on-write pair, if any."""
        copies = []
        # A forked sibling must not see these tokens: seq gets a copy of its own.
        if self.copies_last_block(seq):
            src = seq.block_table[-1]
            self.free([src])
            seq.block_table[-1] = self.allocate_block()
            copies.append((src, seq.block_table[-1]))
        num_blocks = self.num_table_blocks(seq, seq.num_computed_tokens, num_new_tokens)
        seq.block_table += [self.allocate_block() for _ in range(num_blocks - len(seq.block_table))]
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        child.block_table = list(parent.block_table)
        self.share(child.block_table)

    def share(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self.blocks[block_id].ref_count += 1

    def free(self, block_ids: list[int]) -> None:
        # The tail first: the left end goes first, so shared prefixes last.
        for block_id in reversed(block_ids):
            self.blocks[block_id].ref_count -= 1
            if self.blocks[block_id].ref_count == 0:
                self.free_block_ids.append(block_id)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Free seq's blocks past num_tokens (rejected lookahead):
        unhashed, to the front of the free queue."""
        keep = -(-num_tokens // self.block_size)  # ceiling division
        tail, seq.block_table = seq.block_table[keep:], seq.block_table[:keep]
        for block_id in tail:
            self.blocks[block_id].ref_count -= 1
        self.free_block_ids.extendleft(reversed([b for b in tail if self.blocks[b].ref_count == 0]))

    def deallocate(self, seq: Sequence) -> None:
        self.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
