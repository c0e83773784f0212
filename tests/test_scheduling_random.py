"""Randomized: every combination of the scheduling options under random arrivals, lengths, priorities, pool
sizes and n (parallel sampling), with a stand-in model whose next token depends on the whole prefix. Every
request finishes, no step exceeds its token or sequence budget, every sequence reads only its own KV (through
swaps and copy-on-write too), no block leaks or goes below zero references, and each output equals the
sequence's run with memory to spare."""
import random
import zlib
from array import array
from collections import Counter

import pytest

from conftest import make_scheduler
from nanoserve.config import Config, make_config
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.sampling_params import SamplingParams

EOS = 2
NUM_CASES = 150  # per prefix-caching setting


def next_token(token_ids: list[int], index: int = 0) -> int:
    """The stand-in model: a deterministic function of the whole prefix, EOS (2) one time in eight; the n
    sequences of a request (index) sample differently."""
    return 2 + zlib.crc32(array("q", token_ids + [index]).tobytes()) % 8


def unconstrained(prompt: list[int], params: SamplingParams, index: int) -> list[int]:
    """The sequence's output when it has the model and the memory to itself."""
    tokens = list(prompt)
    while True:
        tokens.append(next_token(tokens, index))
        t = tokens[-1]
        if (t == EOS and not params.ignore_eos) or t in params.stop_token_ids or \
                len(tokens) - len(prompt) == params.max_tokens:
            return tokens[len(prompt):]


def random_config(rng: random.Random, model: str, max_model_lens: tuple[int, int], **options) -> Config:
    """Random scheduler options (block size, lengths, budget, chunked prefill, policy, preemption mode)."""
    block_size = rng.choice([1, 2, 4])
    max_model_len = rng.randint(*max_model_lens)
    chunked = rng.random() < 0.5
    return make_config(model, dict(
        block_size=block_size, max_num_seqs=rng.randint(1, 6), max_model_len=max_model_len,
        max_num_batched_tokens=rng.randint(1 if chunked else max_model_len, 2 * max_model_len),
        enable_chunked_prefill=chunked, scheduling_policy=rng.choice(["fcfs", "priority"]),
        preemption_mode=rng.choice(["recompute", "swap"]), **options))


def random_requests(rng: random.Random, config: Config
                    ) -> tuple[list[tuple[int, Sequence]], int, dict[str, int]]:
    """1-12 requests (arrival step, first sequence) with shared prefixes, n up to 3; the most blocks one of
    them can need (check_request's count), for sizing a pool that is often too small for all; and their
    priorities (request id -> priority, for the priority chapter's books)."""
    block_size, max_model_len = config.block_size, config.max_model_len
    prefixes = [[rng.randint(3, 9) for _ in range(rng.randint(0, 3 * block_size))] for _ in range(3)]
    requests, priorities = [], {}
    for seq_id in range(rng.randint(1, 12)):
        prompt = (rng.choice(prefixes) + [rng.randint(3, 9) for _ in range(rng.randint(1, 8))])[: max_model_len - 1]
        room = max_model_len - len(prompt)
        n = min(rng.choice([1, 1, 2, 3]), config.max_num_seqs)
        params = SamplingParams(max_tokens=rng.randint(-(-room // 2), room), ignore_eos=rng.random() < 0.5,
                                stop_token_ids=rng.choice([[], [3]]), n=n)
        priority = rng.randint(0, 3) if config.scheduler_config.scheduling_policy == "priority" else 0
        group = [Sequence(4 * seq_id + i, prompt, params, block_size, str(seq_id), index=i) for i in range(n)]
        priorities[str(seq_id)] = priority
        for seq in group:
            seq.group = group
        requests.append((rng.randint(0, 10), group[0]))
    largest = max(len(seq) // block_size + seq.sampling_params.n * -(-(len(seq) % block_size +  # as check_request
                  seq.sampling_params.max_tokens) // block_size) for _, seq in requests)
    return sorted(requests, key=lambda r: r[0]), largest, priorities


def random_case(rng: random.Random, model: str, prefix_caching: bool):
    config = random_config(rng, model, (4, 32), enable_prefix_caching=prefix_caching)
    requests, largest, priorities = random_requests(rng, config)
    block_size = config.block_size
    bm = BlockManager(rng.randint(largest, 2 * largest), block_size, prefix_caching)  # often too small for all
    swapping = config.scheduler_config.preemption_mode == "swap"
    host = BlockManager(rng.randint(0, 2 * largest), block_size, False) if swapping else None
    scheduler = make_scheduler(config, bm, host)
    scheduler.priorities.update(priorities)
    return config, requests, scheduler


def check_step(out: SchedulerOutput, config: Config) -> None:
    assert len(out.seqs) <= config.max_num_seqs
    for seq, start, n in ((r.seq, r.start, r.num_tokens) for r in out.rows):
        assert 1 <= n and start + n == seq.num_computed_tokens <= len(seq)
        assert len(seq.block_table) * config.block_size >= start + n
    if config.enable_chunked_prefill or out.is_prefill:
        assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
    else:  # nano-vllm's decode steps are bounded by max_num_seqs
        assert all(r.num_tokens == 1 for r in out.rows)


def move_kv(kv: dict, host_kv: dict, out: SchedulerOutput, block_size: int) -> None:
    """Stand-in KV cache (slot -> the token prefix whose KV it holds): the copies the model runner makes."""
    for mapping, src, dst in ((out.blocks_to_swap_out, kv, host_kv), (out.blocks_to_swap_in, host_kv, kv),
                              (out.blocks_to_copy, kv, kv)):
        for src_block, dst_block in mapping:
            for offset in range(block_size):
                dst[dst_block, offset] = src.get((src_block, offset))


def write_and_check_kv(kv: dict, out: SchedulerOutput, block_size: int) -> None:
    """The batch writes its new tokens (all of them before anyone reads, as the model does); then each
    sequence's context, up to the end of its chunk, must be its own."""
    written = {}
    for seq, start, n in ((r.seq, r.start, r.num_tokens) for r in out.rows):
        for p in range(start, start + n):
            slot = (seq.block_table[p // block_size], p % block_size)
            assert slot not in written, "two sequences write one KV slot in one step"
            written[slot] = tuple(seq.token_ids[: p + 1])
    kv.update(written)
    for seq in out.seqs:
        for p in range(seq.num_computed_tokens):
            assert kv.get((seq.block_table[p // block_size], p % block_size)) == tuple(seq.token_ids[: p + 1])


def check_books(scheduler: Scheduler) -> None:
    for pool, holders in ((scheduler.block_manager, scheduler.running), (getattr(scheduler, "host_block_manager", None),
                                                                        getattr(scheduler, "swapped", []))):
        if pool is None:
            continue
        count = Counter(b for seq in holders for b in seq.block_table)
        assert [b.ref_count for b in pool.blocks] == [count[b.block_id] for b in pool.blocks]  # so never < 0
        assert sorted(pool.free_block_ids) == [b.block_id for b in pool.blocks if b.ref_count == 0]
    bm = scheduler.block_manager
    assert all(bm.blocks[i].hash == h for h, i in bm.hash_to_block_id.items())
    for queue, status in ((scheduler.waiting, SequenceStatus.WAITING), (scheduler.running, SequenceStatus.RUNNING),
                          (getattr(scheduler, "swapped", []), SequenceStatus.SWAPPED)):
        assert all(seq.status == status for seq in queue)
    assert all(seq.block_table == [] and seq.num_computed_tokens == 0 for seq in scheduler.waiting)
    assert len(scheduler.running) <= scheduler.max_num_seqs


def drive(config, requests: list, scheduler: Scheduler, write_and_check, check_books) -> None:
    """Step scheduler through requests (arrival step, first sequence) with fake sampled tokens, moving and writing
    the stand-in KV (write_and_check(kv, out)) and checking the books (check_books()) after every step; every
    sequence must end with the tokens an unconstrained run gives it."""
    seqs = [seq for _, first in requests for seq in first.group]
    expected = [unconstrained(seq.token_ids, seq.sampling_params, seq.index) for seq in seqs]
    kv: dict = {}
    host_kv: dict = {}
    for t in range(10_000):
        while requests and requests[0][0] <= t:
            scheduler.add(requests.pop(0)[1])
        if scheduler.is_finished():
            if not requests:
                break
            continue
        out = scheduler.schedule()
        check_step(out, config)
        move_kv(kv, host_kv, out, config.block_size)
        write_and_check(kv, out)
        scheduler.postprocess(out, [next_token(s.token_ids, s.index) for seq, do_sample, forks in
                                    ((r.seq, r.do_sample, r.forks) for r in out.rows) if do_sample
                                    for s in [seq, *forks]])
        check_books()
    else:
        pytest.fail("requests still unfinished after 10000 steps")
    assert all(seq.is_finished for seq in seqs)
    assert [seq.completion_token_ids for seq in seqs] == expected


def run_case(model: str, seed: int, prefix_caching: bool) -> None:
    config, requests, scheduler = random_case(random.Random(seed), model, prefix_caching)
    drive(config, requests, scheduler, lambda kv, out: write_and_check_kv(kv, out, config.block_size),
          lambda: check_books(scheduler))  # at the end, with nobody left, every block is free


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_random_traffic_under_every_option(tiny_models, prefix_caching):
    for seed in range(NUM_CASES):
        try:
            run_case(tiny_models["qwen3"], seed, prefix_caching)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}, prefix_caching={prefix_caching}") from e
