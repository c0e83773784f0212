"""The SlidingWindowBlockManager's books (nanoserve/sliding_window/block_manager.py): exact block ids on small cases,
then randomized traffic under every scheduling option with the stand-in model of test_scheduling_random.py. No
block leaks or is freed twice, every token reads its own KV back to the edge of its window, and a decoding
sequence holds at most ceil(window / block_size) + 1 blocks."""
import random
from collections import Counter

import pytest
from test_scheduling_random import drive, random_config, random_requests

from conftest import make_scheduler
from nanoserve.config import make_config
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.sampling_params import SamplingParams
from nanoserve.scheduling.swap import move_blocks
from nanoserve.sliding_window import NULL_BLOCK, SlidingWindowBlockManager
from nanoserve.utils.math import cdiv

NUM_CASES = 100  # per prefix-caching setting


def test_blocks_behind_the_window_go_back_in_order():
    """Window 6, blocks of 4: after computing 12 tokens the next token (position 12) sees 7..12, so block 0
    (tokens 0..3) is freed and block 1 (4..7) is kept."""
    bm = SlidingWindowBlockManager(8, 4, sliding_window=6)
    assert bm.num_blocks == bm.num_free_blocks == 7 and list(bm.free_block_ids) == [1, 2, 3, 4, 5, 6, 7]
    seq = Sequence(0, list(range(10, 22)), SamplingParams(), 4)
    assert bm.allocate(seq) and seq.block_table == [1, 2, 3]
    seq.num_computed_tokens = 12
    bm.hash_blocks(seq, 0, 12)
    assert seq.block_table == [NULL_BLOCK, 2, 3] and list(bm.free_block_ids) == [4, 5, 6, 7, 1]
    assert bm.blocks[1].ref_count == 0 and bm.blocks[1].hash != -1  # freed, still a prefix-cache entry
    seq.append_token(22)
    assert bm.may_append(seq) == [] and seq.block_table == [NULL_BLOCK, 2, 3, 4]
    seq.num_computed_tokens = 12  # (the next token still sees 7..12: nothing more to free)
    bm.hash_blocks(seq, 12, 12)
    assert seq.block_table == [NULL_BLOCK, 2, 3, 4]
    seq.num_computed_tokens = 13  # the next token (13) sees 8..13: block 1 (4..7) goes too
    bm.hash_blocks(seq, 12, 13)
    assert seq.block_table == [NULL_BLOCK, NULL_BLOCK, 3, 4] and bm.num_freed_behind_window == 2
    bm.deallocate(seq)
    assert bm.num_free_blocks == 7 and bm.blocks[NULL_BLOCK].ref_count == 1


def test_a_prefix_hit_needs_only_the_blocks_the_window_reads():
    """vLLM V1's rule: blocks 1 and 2 of a cached prompt were handed to someone else; a new prompt with the same 16
    first tokens still hits all 16, since its token 16 reads 13..16 only: block 3 is all the window needs."""
    bm = SlidingWindowBlockManager(6, 4, sliding_window=4)
    first = Sequence(0, list(range(10, 27)), SamplingParams(), 4)  # 17 tokens: blocks 0..3 full
    assert bm.allocate(first) and first.block_table == [1, 2, 3, 4, 5]
    first.num_computed_tokens = 17
    bm.hash_blocks(first, 0, 17)
    assert first.block_table == [NULL_BLOCK] * 3 + [4, 5]  # the next token (17) sees 14..17
    bm.deallocate(first)
    thief = Sequence(1, [500] * 8, SamplingParams(), 4)  # takes the two blocks the free queue evicts first
    assert bm.allocate(thief) and thief.block_table == [3, 2]
    second = Sequence(2, list(range(10, 27)) + [99], SamplingParams(), 4)
    # Blocks 0 and 3 are cached, 1 and 2 gone: a hit of 4 blocks needs block 3 only (window 4: 1 block back).
    assert bm.allocate(second)
    assert second.block_table[:4] == [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 4] and second.num_computed_tokens == 16


def test_swap_moves_only_live_blocks():
    """scheduling/swap.py's move_blocks: the null entries stay null in the host pool and back."""
    bm = SlidingWindowBlockManager(8, 4, sliding_window=4)
    host = SlidingWindowBlockManager(4, 4, enable_prefix_caching=False, sliding_window=4)
    seq = Sequence(0, list(range(10, 22)), SamplingParams(), 4)
    bm.allocate(seq)
    seq.num_computed_tokens = 12
    bm.hash_blocks(seq, 0, 12)
    assert seq.block_table == [NULL_BLOCK, NULL_BLOCK, 3]
    assert move_blocks([seq], bm, host) == [(3, 1)] and seq.block_table == [NULL_BLOCK, NULL_BLOCK, 1]
    assert bm.num_free_blocks == 7 and host.num_free_blocks == 2
    seq.append_token(22)
    assert move_blocks([seq], host, bm) == [(1, 4)] and seq.block_table == [NULL_BLOCK, NULL_BLOCK, 4]
    assert host.num_free_blocks == 3


def random_case(rng: random.Random, model: str, prefix_caching: bool):
    config = random_config(rng, model, (8, 48), enable_prefix_caching=prefix_caching)
    block_size = config.block_size
    window = rng.randint(1, 3 * block_size + 1)
    requests, largest, priorities = random_requests(rng, config)
    # Often too small for all (+1: the null block); the swap pool may have no room at all.
    bm = SlidingWindowBlockManager(rng.randint(largest, 2 * largest) + 1, block_size, prefix_caching,
                                   sliding_window=window)
    host = (SlidingWindowBlockManager(rng.randint(0, 2 * largest) + 1, block_size, False, sliding_window=window)
            if config.scheduler_config.preemption_mode == "swap" else None)
    scheduler = make_scheduler(config, bm, host)
    scheduler.priorities.update(priorities)
    return config, window, requests, scheduler


def write_and_check_kv(kv: dict, out: SchedulerOutput, block_size: int, window: int) -> None:
    """The batch writes its new tokens, then every token it computed must find its own KV in the slots of its
    window: positions p - window + 1 .. p (never in the null block)."""
    written = {}
    for seq, start, n in ((r.seq, r.start, r.num_tokens) for r in out.rows):
        for p in range(start, start + n):
            slot = (seq.block_table[p // block_size], p % block_size)
            assert slot not in written and slot[0] != NULL_BLOCK
            written[slot] = tuple(seq.token_ids[: p + 1])
    kv.update(written)
    for seq, start in ((r.seq, r.start) for r in out.rows):
        for p in range(max(start - window + 1, 0), seq.num_computed_tokens):
            block_id = seq.block_table[p // block_size]
            assert block_id != NULL_BLOCK and kv.get((block_id, p % block_size)) == tuple(seq.token_ids[: p + 1])


def check_books(scheduler: Scheduler, window: int) -> None:
    """Reference counts equal the (non-null) table entries; the free queue is the blocks nobody holds; a sequence
    past its prompt holds at most ceil(window / block_size) + 1 blocks."""
    for pool, holders in ((scheduler.block_manager, scheduler.running), (getattr(scheduler, "host_block_manager", None),
                                                                        getattr(scheduler, "swapped", []))):
        if pool is None:
            continue
        count = Counter(b for seq in holders for b in seq.block_table if b != NULL_BLOCK)
        assert pool.blocks[NULL_BLOCK].ref_count == 1
        assert [b.ref_count for b in pool.blocks[1:]] == [count[b.block_id] for b in pool.blocks[1:]]
        assert sorted(pool.free_block_ids) == [b.block_id for b in pool.blocks[1:] if b.ref_count == 0]
    bm = scheduler.block_manager
    assert all(bm.blocks[i].hash == h for h, i in bm.hash_to_block_id.items())
    assert all(seq.block_table == [] and seq.num_computed_tokens == 0 for seq in scheduler.waiting)
    for seq in scheduler.running:
        if seq.num_computed_tokens >= len(seq) - 1:  # decoding: its prompt (or recomputed context) is in the cache
            assert sum(b != NULL_BLOCK for b in seq.block_table) <= cdiv(window, bm.block_size) + 1
    assert all(seq.status == SequenceStatus.RUNNING for seq in scheduler.running)


def run_case(model: str, seed: int, prefix_caching: bool) -> None:
    config, window, requests, scheduler = random_case(random.Random(seed), model, prefix_caching)
    drive(config, requests, scheduler, lambda kv, out: write_and_check_kv(kv, out, config.block_size, window),
          lambda: check_books(scheduler, window))
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # with nobody left, every block is free


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_random_traffic_keeps_the_books(tiny_models, prefix_caching):
    for seed in range(NUM_CASES):
        try:
            run_case(tiny_models["qwen3"], seed, prefix_caching)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}, prefix_caching={prefix_caching}") from e



# ---- long requests: admitted by their window, prompts allocated chunk by chunk -----------------------------------
def long_case(rng: random.Random, model: str, prefix_caching: bool):
    """Chunked prefill with a small budget, requests up to several times the pool, a pool that fits one
    window-and-chunk of the largest or a few; recompute or swap preemption."""
    block_size, window, budget = rng.choice([1, 2, 4]), rng.randint(1, 24), rng.randint(2, 16)
    config = make_config(model, dict(
        block_size=block_size, max_num_seqs=rng.randint(1, 6), max_model_len=rng.randint(40, 120),
        max_num_batched_tokens=budget, enable_chunked_prefill=True, enable_prefix_caching=prefix_caching,
        scheduling_policy=rng.choice(["fcfs", "priority"]), preemption_mode=rng.choice(["recompute", "swap"])))
    peak = cdiv(window - 1 + budget, block_size) + 1  # one sequence's most, at once
    bm = SlidingWindowBlockManager(rng.randint(peak // 2, 3 * peak) + 1, block_size, prefix_caching,
                                   sliding_window=window, max_num_batched_tokens=budget)
    host = (SlidingWindowBlockManager(rng.randint(0, 2 * peak) + 1, block_size, False, sliding_window=window,
                                      max_num_batched_tokens=budget)
            if config.scheduler_config.preemption_mode == "swap" else None)
    prefix = [rng.randint(3, 9) for _ in range(rng.randint(0, config.max_model_len // 2))]
    requests, refused, priorities = [], 0, {}
    for seq_id in range(rng.randint(1, 8)):
        prompt = (prefix if rng.random() < 0.5 else []) + [rng.randint(3, 9) for _ in range(rng.randint(1, 40))]
        prompt = prompt[: config.max_model_len - 1]
        room = config.max_model_len - len(prompt)
        params = SamplingParams(max_tokens=rng.randint(1, room), ignore_eos=rng.random() < 0.5,
                                n=min(rng.choice([1, 1, 2]), config.max_num_seqs))
        try:  # refused now, as EngineCore.add_request would, or admitted and bound to finish
            bm.check_fits(len(prompt), params.max_tokens, params.n)
        except ValueError as error:
            assert f"sliding_window {window}" in str(error) and f"up to {budget} tokens" in str(error)
            assert f"the pool has {bm.num_blocks}" in str(error)
            refused += 1
            continue
        priority = rng.randint(0, 3) if config.scheduler_config.scheduling_policy == "priority" else 0
        group = [Sequence(4 * seq_id + i, prompt, params, block_size, str(seq_id), index=i)
                 for i in range(params.n)]
        priorities[str(seq_id)] = priority
        for seq in group:
            seq.group = group
        requests.append((rng.randint(0, 10), group[0]))
    scheduler = make_scheduler(config, bm, host)
    scheduler.priorities.update(priorities)
    return config, window, sorted(requests, key=lambda r: r[0]), refused, scheduler


def check_peak(out: SchedulerOutput, scheduler: Scheduler) -> None:
    """Right after planning (the step's blocks all taken, before anything is freed): no sequence holds more
    than its window and a chunk."""
    bm = scheduler.block_manager
    for seq in scheduler.running:
        bound = bm.max_blocks_per_seq(seq.num_prompt_tokens + seq.sampling_params.max_tokens)
        assert sum(b != NULL_BLOCK for b in seq.block_table) <= bound


def run_long_case(model: str, seed: int, prefix_caching: bool) -> tuple[int, int, Scheduler]:
    """One case of long_case, driven to its end; returns its requests longer than the pool and its refusals."""
    config, window, requests, refused, scheduler = long_case(random.Random(seed), model, prefix_caching)
    bm = scheduler.block_manager
    num_long = sum(cdiv(len(s) + s.sampling_params.max_tokens, config.block_size) > bm.num_blocks
                   for _, s in requests)

    def write_and_check(kv: dict, out: SchedulerOutput) -> None:
        check_peak(out, scheduler)
        write_and_check_kv(kv, out, config.block_size, window)

    drive(config, requests, scheduler, write_and_check, lambda: check_books(scheduler, window))
    assert bm.num_free_blocks == bm.num_blocks
    return num_long, refused, scheduler


def test_long_requests_keep_the_books(tiny_models):
    """Requests longer than the pool under a window: every one ends (drive's 10,000 steps), or is refused when
    added; no leak, no double free (the reference counts equal the tables after every step), every token reads
    its own KV across its window, and no sequence ever holds more than its bound."""
    num_long = num_refused = num_preempted = num_chunked = 0
    for seed in range(1000, 1000 + 2 * NUM_CASES):
        prefix_caching = seed % 2 == 0
        try:
            long, refused, scheduler = run_long_case(tiny_models["qwen3"], seed, prefix_caching)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}, prefix_caching={prefix_caching}") from e
        num_long, num_refused = num_long + long, num_refused + refused
        num_preempted += scheduler.stats.num_preemptions
        num_chunked += scheduler.stats.num_chunked_prefills
    # The cases do what they are for: requests the pool could not hold whole, refusals, preemptions, chunks.
    assert num_long > 50 and num_refused > 20 and num_preempted > 50 and num_chunked > 500
