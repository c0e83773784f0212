"""The books of speculative decoding: slots for 1 + k tokens, rollback after a verification, and a prefix cache
that never serves an unverified token. Exact block ids, as tests/test_block_manager.py; then a randomized run."""
import random

import pytest

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.sequence import Sequence
from nanoserve.sampling_params import SamplingParams
from nanoserve.spec_decode.accounting import num_rejected_tokens, num_spec_tokens_allowed
from nanoserve.speculative_config import SpecDecodingStats

BS = 4


def prefilled(bm: BlockManager, seq_id: int, prompt: list[int], first_token: int) -> Sequence:
    """A request whose prompt was computed (full blocks registered) and whose first token was sampled."""
    s = Sequence(seq_id, prompt, SamplingParams(), BS)
    assert bm.allocate(s)
    start, s.num_computed_tokens = s.num_computed_tokens, len(s)
    bm.hash_blocks(s, start, len(s))
    s.append_token(first_token)
    return s


def verify(bm: BlockManager, s: Sequence, drafts: list[int], emitted: list[int],
           kv: dict | None = None) -> list[tuple[int, int]]:
    """One verification step, as the scheduler and postprocess will do it. (The drafts sit in token_ids while in
    flight; the engine will keep them in spec_token_ids, counted in len(seq) as vLLM's num_tokens_with_spec.)
    kv, if given, records which token's KV each slot holds: the forward writes all 1 + k."""
    start = s.num_computed_tokens  # the newest token, not computed yet
    s.token_ids += drafts
    assert bm.num_new_blocks(s) <= bm.num_free_blocks
    copies = bm.may_append(s)
    if kv is not None:
        for src, dst in copies:
            kv.update({(dst, i): kv.get((src, i)) for i in range(BS)})
        for p in range(start, len(s)):
            kv[s.block_table[p // BS], p % BS] = s.token_ids[p]
    s.num_computed_tokens = len(s)  # the plan counts all 1 + k as computed
    # The verdict: the accepted drafts and the target's own token. Roll back over the rejected drafts.
    assert emitted[:-1] == drafts[: len(emitted) - 1]
    del s.token_ids[start + 1 :]
    s.token_ids += emitted
    s.num_computed_tokens -= num_rejected_tokens(len(drafts), len(emitted))
    bm.hash_blocks(s, start, s.num_computed_tokens)  # only blocks full of verified tokens
    bm.truncate(s, s.num_computed_tokens)  # blocks past the verified KV held only rejected drafts
    return copies


def test_spec_tokens_allowed_stop_at_max_tokens():
    assert num_spec_tokens_allowed(5, num_output_tokens=0, max_tokens=100) == 5
    assert num_spec_tokens_allowed(5, num_output_tokens=96, max_tokens=100) == 3  # 3 drafts + 1 = the 4 left
    assert num_spec_tokens_allowed(5, num_output_tokens=99, max_tokens=100) == 0  # the last token: no drafts
    assert num_spec_tokens_allowed(5, num_output_tokens=100, max_tokens=100) == 0


def test_num_rejected_tokens():
    assert [num_rejected_tokens(3, n) for n in (1, 2, 3, 4)] == [3, 2, 1, 0]
    assert num_rejected_tokens(0, 1) == 0
    for bad in (0, 5):
        with pytest.raises(ValueError, match="emits 1 to 4 tokens"):
            num_rejected_tokens(3, bad)


def test_spec_decoding_stats():
    stats = SpecDecodingStats()
    assert (stats.acceptance_rate, stats.mean_acceptance_length, stats.acceptance_rate_per_pos) == (0.0, 0.0, [])
    stats.observe(3, 3)
    stats.observe(3, 1)
    stats.observe(2, 0)
    stats.observe(5, 2)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (4, 13, 6)
    assert stats.num_accepted_tokens_per_pos == [3, 2, 1, 0, 0]
    assert stats.acceptance_rate == 6 / 13
    assert stats.acceptance_rate_per_pos == [0.75, 0.5, 0.25, 0.0, 0.0]
    assert stats.mean_acceptance_length == 1 + 6 / 4


def test_slots_for_1_plus_k_tokens_and_rollback():
    bm = BlockManager(8, BS)
    s = prefilled(bm, 0, [0, 1, 2, 3, 4, 5], first_token=100)  # 7 tokens, 6 computed, blocks [0, 1]
    assert (s.block_table, bm.num_new_blocks(s)) == ([0, 1], 0)  # the newest token fits block 1
    s.token_ids += [101, 102, 103, 104]
    assert bm.num_new_blocks(s) == 1  # 1 + 4 tokens: positions 6..10, block 2 for 8..10
    del s.token_ids[7:]
    verify(bm, s, [101, 102, 103, 104], [101, 102, 50])  # 2 accepted, the 3rd replaced by 50
    assert s.token_ids == [0, 1, 2, 3, 4, 5, 100, 101, 102, 50]
    assert (s.num_computed_tokens, s.block_table) == (9, [0, 1, 2])  # rolled back by 2; block 2 holds 102
    assert bm.blocks[1].token_ids == [4, 5, 100, 101] and bm.blocks[1].hash != -1  # full of verified tokens
    assert bm.blocks[2].hash == -1  # 102 verified, 50 not computed yet
    assert list(bm.free_block_ids) == [3, 4, 5, 6, 7]

    # Seven drafts spill into two new blocks; the first is rejected: both blocks come straight back.
    s.token_ids += list(range(60, 67))
    assert bm.num_new_blocks(s) == 2
    del s.token_ids[10:]
    verify(bm, s, list(range(60, 67)), [70])
    assert (s.num_computed_tokens, s.block_table, len(s)) == (10, [0, 1, 2], 11)
    assert list(bm.free_block_ids) == [3, 4, 5, 6, 7]  # back in front: reused before any cached block
    assert [b.ref_count for b in bm.blocks] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert all(bm.blocks[b].hash == -1 for b in (2, 3, 4))

    # The prefix cache knows only verified tokens: a prompt that continues with the rejected drafts hits the
    # two verified blocks, not the block the drafts filled (positions 12..15 held 62..65).
    probe = Sequence(1, [0, 1, 2, 3, 4, 5, 100, 101, 102, 50, 60, 61, 62, 63, 64, 65, 66], SamplingParams(), BS)
    assert bm.allocate(probe)
    assert probe.num_cached_tokens == 2 * BS


def test_all_accepted_keeps_every_block_and_registers_full_ones():
    bm = BlockManager(8, BS)
    s = prefilled(bm, 0, [0, 1, 2], first_token=3)  # 4 tokens, block 0
    verify(bm, s, [4, 5, 6, 7], [4, 5, 6, 7, 8])  # all 4 accepted + the bonus 8
    assert (s.num_computed_tokens, s.block_table, len(s)) == (8, [0, 1], 9)
    assert [bm.blocks[b].token_ids for b in (0, 1)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert all(bm.blocks[b].hash != -1 for b in (0, 1))


def test_copy_on_write_then_spill_for_a_forked_sequence():
    """n > 1: a fork shares its parent's partly filled last block; drafts landing in it need a private copy, and
    those spilling past it a new block: two free blocks, one copy."""
    bm = BlockManager(8, BS)
    parent = prefilled(bm, 0, [0, 1, 2, 3, 4, 5], first_token=10)
    child = Sequence(1, [0, 1, 2, 3, 4, 5], SamplingParams(), BS)
    bm.fork(parent, child)
    child.num_computed_tokens = 6
    child.append_token(20)
    assert [b.ref_count for b in bm.blocks[:2]] == [2, 2]
    child.token_ids += [21, 22, 23]  # positions 6..9: block 1 (shared) and a new one
    assert bm.num_new_blocks(child) == 2
    del child.token_ids[7:]
    copies = verify(bm, child, [21, 22, 23], [21, 22, 23, 24])
    assert copies == [(1, 2)]
    assert (child.block_table, parent.block_table) == ([0, 2, 3], [0, 1])
    assert [b.ref_count for b in bm.blocks[:4]] == [2, 1, 1, 1]
    assert bm.num_new_blocks(parent) == 0  # the parent still writes block 1 alone


def test_num_new_blocks_counts_every_block_needed():
    bm = BlockManager(3, BS)
    s = prefilled(bm, 0, [0, 1, 2, 3], first_token=4)  # block 0 full; the newest token needs a block
    s.token_ids += list(range(5, 13))  # 13 tokens: 4 blocks, 3 new, 2 free
    assert (bm.num_new_blocks(s), bm.num_free_blocks, bm.num_new_blocks(s) <= bm.num_free_blocks) == (3, 2, False)
    del s.token_ids[-4:]  # 9 tokens: 3 blocks
    assert (bm.num_new_blocks(s), bm.num_new_blocks(s) <= bm.num_free_blocks) == (2, True)
    assert bm.may_append(s) == [] and s.block_table == [0, 1, 2] and bm.num_free_blocks == 0


@pytest.mark.parametrize("seed", range(8))
def test_random_accept_patterns_keep_the_books(seed):
    """Requests arrive, prefill (sharing prefixes), verify random drafts with random verdicts, get preempted when
    blocks run out, finish. After every step: each block's ref count equals the tables holding it, the free queue
    holds exactly the unreferenced blocks, a table covers exactly the computed tokens, every computed token's slot
    holds that token's KV, and every block the prefix cache can serve holds the KV of the tokens it is hashed
    under, never a rejected draft's."""
    rng = random.Random(seed)
    bm = BlockManager(24, BS)
    kv: dict[tuple[int, int], int] = {}  # (block, offset) -> the token whose KV the slot holds
    stems = [[rng.randrange(4) for _ in range(rng.randrange(1, 10))] for _ in range(3)]
    waiting: list[Sequence] = []
    running: list[Sequence] = []
    for step in range(150):
        if rng.random() < 0.3 or not running:
            waiting.append(Sequence(100 + step, rng.choice(stems) + [rng.randrange(4) for _ in range(rng.randrange(3))],
                                    SamplingParams(), BS))
        while waiting and bm.allocate(waiting[0]):  # prefill: compute the rest of the prompt, sample a token
            s = waiting.pop(0)
            for p in range(s.num_computed_tokens, len(s)):
                kv[s.block_table[p // BS], p % BS] = s.token_ids[p]
            start, s.num_computed_tokens = s.num_computed_tokens, len(s)
            bm.hash_blocks(s, start, len(s))
            s.append_token(rng.randrange(4))
            running.append(s)
        for s in list(running):
            k = rng.randrange(7)
            drafts = [rng.randrange(4) for _ in range(k)]
            s.token_ids += drafts
            fits = bm.num_new_blocks(s) <= bm.num_free_blocks
            del s.token_ids[len(s) - k :]
            if not fits:  # preempt by recompute: give the blocks back, prefill again later
                bm.deallocate(s)
                running.remove(s)
                waiting.insert(0, s)
                continue
            a = rng.randrange(k + 1)
            verify(bm, s, drafts, drafts[:a] + [rng.randrange(4)], kv)
            if rng.random() < 0.05:
                bm.deallocate(s)
                running.remove(s)

        refs = [0] * bm.num_blocks
        for s in running:
            assert len(s.block_table) == -(-s.num_computed_tokens // BS)
            for p in range(s.num_computed_tokens):
                assert kv[s.block_table[p // BS], p % BS] == s.token_ids[p]
            for b in s.block_table:
                refs[b] += 1
        assert [b.ref_count for b in bm.blocks] == refs
        assert sorted(bm.free_block_ids) == [b for b in range(bm.num_blocks) if refs[b] == 0]
        for h, b in bm.hash_to_block_id.items():
            block = bm.blocks[b]
            assert block.hash == h and [kv.get((b, i)) for i in range(BS)] == block.token_ids
