"""Randomized: multi-turn conversations (each turn re-sends its history) under random scheduler options, pool and
host tier sizes, with the stand-in model and KV cache of test_scheduling_random.py and the host tier of
nanoserve/kv_offload/. At every step: no block leaks, every sequence reads only its own KV (so a block copied back
holds what it should), no hash points at two blocks of a tier, every cached block on either tier holds the KV its
hash names, and the host tier's books add up. Outputs equal the unconstrained run; the tier served blocks back."""
import random

import pytest
from test_scheduling_random import check_books, check_step, next_token, random_config, unconstrained, write_and_check_kv

from conftest import make_scheduler
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.sequence import Sequence, compute_hash
from nanoserve.kv_offload import HostKVTier, HostTierBlockManager, HostTierSchedulerOutput
from nanoserve.sampling_params import SamplingParams

NUM_CASES = 120


def move_kv(kv: dict, swap_kv: dict, host_kv: dict, out: HostTierSchedulerOutput, block_size: int) -> None:
    """The copies the executor has the model runners make (Executor.copy_kv_out, then copy_kv_in), in its order:
    reads of the device pool first."""
    for mapping, src, dst in ((out.blocks_to_swap_out, kv, swap_kv), (out.blocks_to_offload, kv, host_kv),
                              (out.blocks_to_swap_in, swap_kv, kv), (out.blocks_to_load, host_kv, kv),
                              (out.blocks_to_copy, kv, kv)):
        assert len({dst_block for _, dst_block in mapping}) == len(mapping), "two copies into one block"
        for src_block, dst_block in mapping:
            for offset in range(block_size):
                dst[dst_block, offset] = src.get((src_block, offset))


def holds(kv: dict, block_id: int, block_hash: int, token_ids: list[int], block_size: int) -> bool:
    """Does the stand-in block hold the KV of the full block `token_ids` whose chained hash is block_hash?"""
    prefix = kv.get((block_id, block_size - 1))
    if prefix is None or list(prefix[-block_size:]) != token_ids:
        return False
    h = -1
    for i in range(0, len(prefix), block_size):
        h = compute_hash(list(prefix[i : i + block_size]), h)
    return h == block_hash and all(kv.get((block_id, o)) == prefix[: len(prefix) - block_size + o + 1]
                                   for o in range(block_size))


def check_tiers(bm: BlockManager, tier: HostKVTier, kv: dict, host_kv: dict, block_size: int) -> None:
    for block_hash, block_id in bm.hash_to_block_id.items():
        assert holds(kv, block_id, block_hash, bm.blocks[block_id].token_ids, block_size)
    host_ids = [host_id for host_id, _ in tier.cached.values()]
    assert len(set(host_ids)) == len(host_ids), "a host block under two hashes"
    assert sorted(host_ids + tier.free_block_ids) == list(range(tier.num_blocks))
    for block_hash, (host_id, token_ids) in tier.cached.items():
        assert holds(host_kv, host_id, block_hash, token_ids, block_size)
    assert not tier.blocks_to_offload and not tier.blocks_to_load and not tier.pinned  # all taken by the plan


def run_case(model: str, seed: int) -> tuple[int, int]:
    rng = random.Random(seed)
    config = random_config(rng, model, (12, 40), kv_offloading_size=1.0)  # (on; sized below)
    block_size, max_model_len = config.block_size, config.max_model_len
    largest = 2 * -(-max_model_len // block_size)  # a request of n=2 at max_model_len, as check_request allows
    bm = HostTierBlockManager(rng.randint(largest, 2 * largest), block_size, True)
    tier = bm.host_tier = HostKVTier(rng.randint(1, 3 * largest), None)  # (as HostTierEngineCore does)
    swapping = config.scheduler_config.preemption_mode == "swap"
    swap = BlockManager(rng.randint(0, largest), block_size, False) if swapping else None
    scheduler = make_scheduler(config, bm, swap)
    tier.stats = scheduler.stats
    system = [rng.randint(3, 9) for _ in range(rng.randint(0, 3 * block_size))]
    # Each conversation: its history, the step its next turn arrives, the sequences of the turn in flight.
    convs = [[list(system), rng.randint(0, 5), None] for _ in range(rng.randint(1, 6))]
    expected, seqs, seq_id = [], [], 0
    kv, swap_kv, host_kv = {}, {}, {}
    for t in range(10_000):
        for conv in convs:
            history, arrival, group = conv
            if group is not None and all(s.is_finished for s in group):
                history += group[0].completion_token_ids
                conv[1], conv[2] = t + rng.randint(0, 3), None
            elif group is None and arrival <= t:
                prompt = history + [rng.randint(3, 9) for _ in range(rng.randint(1, 4))]
                if len(prompt) >= max_model_len - 1:
                    conv[1] = 10**9  # the conversation is over
                    continue
                n = min(rng.choice([1, 1, 1, 2]), config.max_num_seqs)
                params = SamplingParams(max_tokens=rng.randint(1, min(6, max_model_len - len(prompt))), n=n,
                                        ignore_eos=rng.random() < 0.5)
                priority = rng.randint(0, 3) if config.scheduler_config.scheduling_policy == "priority" else 0
                group = [Sequence(seq_id + i, prompt, params, block_size, str(seq_id), index=i)
                         for i in range(n)]
                scheduler.priorities[str(seq_id)] = priority
                seq_id += n
                for s in group:
                    s.group = group
                    expected.append(unconstrained(s.token_ids, params, s.index))
                seqs += group
                conv[1], conv[2] = arrival, group
                scheduler.add(group[0])
        if scheduler.is_finished():
            if all(conv[1] == 10**9 for conv in convs):
                break
            continue
        out = scheduler.schedule()  # (HostTierScheduler.schedule: the tier's copies join the plan)
        check_step(out, config)
        move_kv(kv, swap_kv, host_kv, out, block_size)
        write_and_check_kv(kv, out, block_size)
        scheduler.postprocess(out, [next_token(s.token_ids, s.index) for seq, do_sample, forks in
                                    ((r.seq, r.do_sample, r.forks) for r in out.rows) if do_sample
                                    for s in [seq, *forks]])
        check_books(scheduler)
        check_tiers(bm, tier, kv, host_kv, block_size)
    else:
        pytest.fail("conversations still going after 10000 steps")
    assert [s.completion_token_ids for s in seqs] == expected
    assert bm.num_free_blocks == bm.num_blocks
    return scheduler.stats.num_loaded_blocks, scheduler.stats.num_offloaded_blocks


def test_random_multi_turn_traffic(tiny_models):
    loaded = offloaded = 0
    for seed in range(NUM_CASES):
        try:
            n_loaded, n_offloaded = run_case(tiny_models["qwen3"], seed)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}") from e
        loaded, offloaded = loaded + n_loaded, offloaded + n_offloaded
    assert loaded > 100 and offloaded > 100  # the tier was exercised, not just present
