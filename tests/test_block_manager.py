"""BlockManager unit tests: exact block ids, ref counts and prefix-cache hits (no model but in the last test)."""
import torch

from conftest import make_scheduler
from nanoserve.config import Config
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.sequence import Sequence, compute_hash
from nanoserve.sampling_params import SamplingParams

BS = 4


def seq(seq_id: int, token_ids, **params) -> Sequence:
    return Sequence(seq_id, list(token_ids), SamplingParams(**params), BS)


def allocated(bm: BlockManager, seq_id: int, token_ids) -> Sequence:
    s = seq(seq_id, token_ids)
    assert bm.allocate(s)
    return s


def computed(bm: BlockManager, s: Sequence) -> Sequence:
    """What postprocess does after a forward: all tokens are computed, full blocks get registered."""
    start, s.num_computed_tokens = s.num_computed_tokens, len(s)
    bm.hash_blocks(s, start, len(s))
    return s


def refs(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


def free(bm: BlockManager) -> list[int]:
    return list(bm.free_block_ids)


def state(bm: BlockManager):
    """Everything allocate may change."""
    return refs(bm), free(bm), dict(bm.hash_to_block_id), [(b.hash, list(b.token_ids)) for b in bm.blocks]


def decode_token(bm: BlockManager, s: Sequence, token_id: int) -> None:
    """What postprocess + the next decode schedule do: append the sampled token, reserve its slot."""
    computed(bm, s)
    s.append_token(token_id)
    assert bm.num_new_blocks(s) <= bm.num_free_blocks
    bm.may_append(s)


def test_allocate_takes_free_blocks_in_order():
    bm = BlockManager(8, BS)
    a = allocated(bm, 0, range(10))  # 3 blocks
    b = allocated(bm, 1, range(100, 105))  # 2 blocks
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4])
    assert refs(bm) == [1, 1, 1, 1, 1, 0, 0, 0]
    assert free(bm) == [5, 6, 7]
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 0)


def test_deallocate_returns_blocks_tail_first():
    bm = BlockManager(8, BS)
    a = allocated(bm, 0, range(10))
    allocated(bm, 1, range(100, 105))
    bm.deallocate(a)
    assert free(bm) == [5, 6, 7, 2, 1, 0]
    assert refs(bm) == [0, 0, 0, 1, 1, 0, 0, 0]
    assert (a.block_table, a.num_computed_tokens) == ([], 0)


def test_prefix_sharing_reuses_full_blocks():
    bm = BlockManager(8, BS)
    a = computed(bm, allocated(bm, 0, range(10)))
    b = allocated(bm, 1, [*range(8), 50, 51, 52])
    assert b.block_table == [0, 1, 3]
    assert refs(bm) == [2, 2, 1, 1, 0, 0, 0, 0]
    assert b.num_cached_tokens == b.num_computed_tokens == 2 * BS
    assert free(bm) == [4, 5, 6, 7]
    bm.deallocate(a)  # the shared blocks stay with b
    assert refs(bm) == [1, 1, 0, 1, 0, 0, 0, 0]
    assert free(bm) == [4, 5, 6, 7, 2]


def test_chained_hash_same_block_after_other_prefix_is_not_shared():
    bm = BlockManager(16, BS)
    computed(bm, allocated(bm, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    b = computed(bm, allocated(bm, 1, [9, 9, 9, 9, 5, 6, 7, 8, 9]))  # block 1 has a's tokens, after another block 0
    assert (b.block_table, b.num_cached_tokens) == ([3, 4, 5], 0)
    c = allocated(bm, 2, [1, 2, 3, 4, 9, 9, 9, 9, 5])  # same block 0 only
    assert (c.block_table, c.num_cached_tokens) == ([0, 6, 7], BS)
    assert refs(bm)[:8] == [2, 1, 1, 1, 1, 1, 1, 1]


def test_fully_cached_prompt_still_computes_its_last_block():
    """nano-vllm bug (a): a prompt of whole blocks, all cached, would have no token left to compute."""
    bm = BlockManager(8, BS)
    a = computed(bm, allocated(bm, 0, range(8)))
    b = allocated(bm, 1, range(8))
    assert b.num_cached_tokens == BS < len(b)
    assert (a.block_table, b.block_table) == ([0, 1], [0, 2])
    assert refs(bm)[:3] == [2, 1, 1]


def test_freed_cached_block_is_still_a_hit_until_reused():
    bm = BlockManager(6, BS)
    a = computed(bm, allocated(bm, 0, range(9)))
    bm.deallocate(a)
    assert free(bm) == [3, 4, 5, 2, 1, 0]
    b = allocated(bm, 1, [*range(8), 99])
    assert (b.block_table, b.num_cached_tokens) == ([0, 1, 3], 2 * BS)
    assert refs(bm) == [1, 1, 0, 1, 0, 0]  # 0 -> 1 for the hits
    assert free(bm) == [4, 5, 2]  # the hits left the free queue


def test_reused_block_does_not_serve_its_stale_hash():
    """nano-vllm bug (b): a freed block handed out for other tokens must drop its old hash."""
    bm = BlockManager(4, BS)
    a = computed(bm, allocated(bm, 0, range(9)))  # [0, 1, 2]
    stale = compute_hash(list(range(4, 8)), bm.blocks[0].hash)  # a's block 1
    assert bm.hash_to_block_id[stale] == 1
    bm.deallocate(a)
    assert free(bm) == [3, 2, 1, 0]
    b = computed(bm, allocated(bm, 1, range(100, 112)))  # 3 full blocks: takes 3, 2 and a's cached block 1
    assert b.block_table == [3, 2, 1]
    assert stale not in bm.hash_to_block_id
    bm.deallocate(b)
    c = allocated(bm, 2, range(9))
    assert (c.block_table, c.num_cached_tokens) == ([0, 1, 2], BS)  # block 0 hits, block 1 does not
    assert all(bm.blocks[i].hash == h for h, i in bm.hash_to_block_id.items())


def test_same_prefix_twice_in_one_prefill_batch(tiny_models):
    """nano-vllm bug (c): two sequences with one prefix in one batch. Neither may hit blocks whose KV
    the batch is still computing; once it is computed, a third one shares them."""
    config = Config(tiny_models["qwen3"], block_size=BS, num_kvcache_blocks=10, max_num_batched_tokens=64,
                    max_model_len=64)
    bm = BlockManager(10, BS)
    scheduler = make_scheduler(config, bm)
    a, b, c = seq(0, range(10)), seq(1, [*range(8), 7, 7]), seq(2, [*range(8), 9])
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    assert out.is_prefill and out.seqs == [a, b]
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4, 5])
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 0)
    scheduler.postprocess(out, [100, 101])
    scheduler.add(c)
    out = scheduler.schedule()
    assert (out.seqs, out.is_prefill) == ([c], True)
    assert c.block_table[:2] in ([0, 1], [3, 4]) and c.num_cached_tokens == 2 * BS
    assert refs(bm)[:6] == ([2, 2, 1, 1, 1, 1] if c.block_table[0] == 0 else [1, 1, 1, 2, 2, 1])
    assert scheduler.stats.num_cached_tokens == 2 * BS


def test_failed_allocate_changes_nothing():
    """nano-vllm bug (d): allocate is all or nothing."""
    bm = BlockManager(4, BS)
    a = computed(bm, allocated(bm, 0, range(9)))
    bm.deallocate(a)  # blocks 0, 1 cached and free
    allocated(bm, 1, [100] * 5)  # takes 3, 2
    assert free(bm) == [1, 0]
    before = state(bm)
    b = seq(2, [*range(8), 5])  # would hit 0 and 1, but taking them uses the only two free blocks
    assert not bm.allocate(b)
    assert state(bm) == before
    assert (b.block_table, b.num_cached_tokens, b.num_computed_tokens) == ([], 0, 0)


def test_append_allocates_exactly_when_the_last_block_is_full():
    bm = BlockManager(2, BS)
    s = allocated(bm, 0, range(3))
    decode_token(bm, s, 40)  # 4 tokens: the new token still fits block 0, which becomes full
    assert s.block_table == [0] and free(bm) == [1]
    assert bm.hash_to_block_id == {}  # token 40's KV is not computed yet
    decode_token(bm, s, 41)  # 5th token: a new block; token 40 was computed, so block 0 is registered
    assert bm.hash_to_block_id[compute_hash([0, 1, 2, 40], -1)] == 0
    assert s.block_table == [0, 1] and free(bm) == []
    assert refs(bm) == [1, 1]
    for token_id in (42, 43, 44):  # no free block needed while block 1 has room
        decode_token(bm, s, token_id)
        assert s.block_table == [0, 1]
    computed(bm, s)  # token 44 computed: block 1 is full and registered
    assert bm.hash_to_block_id[compute_hash([41, 42, 43, 44], bm.blocks[0].hash)] == 1
    s.append_token(45)  # 9 tokens: a third block is needed and none is free
    assert not bm.num_new_blocks(s) <= bm.num_free_blocks


def test_may_append_does_nothing_before_a_block_fills():
    bm = BlockManager(4, BS)
    s = computed(bm, allocated(bm, 0, range(5)))
    before = state(bm)
    decode_token(bm, s, 9)  # 6 tokens: block 1 has room, it is not full
    assert state(bm) == before


def test_prefix_caching_disabled_never_shares():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = allocated(bm, 0, range(9))
    b = allocated(bm, 1, range(9))
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4, 5])
    assert b.num_cached_tokens == 0
    assert bm.hash_to_block_id == {}
    bm.deallocate(a)
    c = allocated(bm, 2, range(9))
    assert (c.block_table, c.num_cached_tokens) == ([6, 7, 2], 0)


# ---- fork and copy-on-write (early vLLM: parallel sampling shares a prompt's blocks) ------------

def forked(bm: BlockManager, prompt, num_children: int) -> list[Sequence]:
    """A computed prompt and children forked from it: all of them share its blocks."""
    parent = computed(bm, allocated(bm, 0, prompt))
    children = [seq(i, prompt) for i in range(1, num_children + 1)]
    for child in children:
        bm.fork(parent, child)
        child.num_computed_tokens = len(prompt)
    return [parent, *children]


def test_copy_on_write_copies_the_shared_partly_filled_block_once_per_writer():
    bm = BlockManager(8, BS)
    family = forked(bm, range(6), 3)  # blocks [0, 1]; block 1 holds 2 tokens and has room for more
    assert [s.block_table for s in family] == [[0, 1]] * 4
    assert refs(bm) == [4, 4, 0, 0, 0, 0, 0, 0]
    copies = []
    for i, s in enumerate(family):  # each appends its own token: they diverge into block 1's next slot
        s.append_token(50 + i)
        assert bm.num_new_blocks(s) <= bm.num_free_blocks
        copies.append(bm.may_append(s))
    assert copies == [[(1, 2)], [(1, 3)], [(1, 4)], []]  # the last holder of block 1 writes in place
    assert [s.block_table for s in family] == [[0, 2], [0, 3], [0, 4], [0, 1]]
    assert refs(bm) == [4, 1, 1, 1, 1, 0, 0, 0]
    for s in family:  # the next tokens go into private blocks: no more copies
        decode_token(bm, s, 60)
    assert refs(bm) == [4, 1, 1, 1, 1, 0, 0, 0] and free(bm) == [5, 6, 7]
    for s in family:
        bm.deallocate(s)
    assert refs(bm) == [0] * 8 and sorted(free(bm)) == list(range(8))  # the books balance


def test_fork_of_a_full_last_block_needs_new_blocks_not_copies():
    bm = BlockManager(8, BS)
    family = forked(bm, range(8), 2)
    for i, s in enumerate(family):
        s.append_token(50 + i)
        assert bm.may_append(s) == []
    assert [s.block_table for s in family] == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert refs(bm) == [3, 3, 1, 1, 1, 0, 0, 0]


def test_copy_on_write_needs_a_free_block():
    bm = BlockManager(2, BS)
    parent, child = forked(bm, range(6), 1)
    child.append_token(9)
    assert not bm.num_new_blocks(child) <= bm.num_free_blocks  # block 1 is shared and no block is free for the copy
    bm.deallocate(parent)
    assert bm.num_new_blocks(child) <= bm.num_free_blocks
    assert bm.may_append(child) == []  # child holds block 1 alone now


def test_model_runner_copies_blocks_before_the_forward(tiny_models):
    """The copy-on-write pairs ride in SchedulerOutput.blocks_to_copy, through the swap copies' mechanism."""
    from nanoserve import LLM
    from nanoserve.engine.scheduler import SchedulerOutput

    engine = LLM(tiny_models["qwen3"], block_size=BS, num_kvcache_blocks=4).engine
    runner = engine.model_runner
    runner.kv_cache[:, :, 1] = torch.randn_like(runner.kv_cache[:, :, 1])
    before = runner.kv_cache.clone()
    assert engine.executor.execute_model(SchedulerOutput(blocks_to_copy=[(1, 3)]), None).tolist() == []
    assert torch.equal(runner.kv_cache[:, :, 3], before[:, :, 1])
    assert torch.equal(runner.kv_cache[:, :, :3], before[:, :, :3])  # nothing else changed
