"""Randomized: Scheduler + BlockManager under random traffic keep their books straight, and the engine's
output does not depend on how small the KV pool is (preemption recomputes exactly)."""
import random
from collections import Counter

import pytest

from conftest import random_prompts
from nanoserve import LLM, SamplingParams
from nanoserve.config import Config
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence

EOS = 2
NUM_CASES = 100  # per prefix-caching setting


def random_requests(rng: random.Random, max_model_len: int, block_size: int) -> list[tuple[int, Sequence]]:
    """(arrival step, sequence) pairs; prompts start with one of a few shared prefixes."""
    prefixes = [[rng.randint(3, 9) for _ in range(rng.randint(0, 3 * block_size))] for _ in range(3)]
    requests = []
    for seq_id in range(rng.randint(1, 12)):
        prompt = rng.choice(prefixes) + [rng.randint(3, 9) for _ in range(rng.randint(1, 8))]
        prompt = prompt[: max_model_len - 1]
        params = SamplingParams(max_tokens=rng.randint(1, max_model_len - len(prompt)),
                                ignore_eos=rng.random() < 0.3, stop_token_ids=rng.choice([[], [3]]))
        requests.append((rng.randint(0, 15), Sequence(seq_id, prompt, params, block_size)))
    return sorted(requests, key=lambda r: r[0])


def check_books(scheduler: Scheduler) -> None:
    bm = scheduler.block_manager
    holders = Counter(b for seq in scheduler.running for b in seq.block_table)
    assert [b.ref_count for b in bm.blocks] == [holders[b.block_id] for b in bm.blocks]
    assert len(set(bm.free_block_ids)) == len(bm.free_block_ids)
    assert set(bm.free_block_ids) == {b.block_id for b in bm.blocks if b.ref_count == 0}
    assert all(bm.blocks[i].hash == h for h, i in bm.hash_to_block_id.items())
    assert all(seq.block_table == [] for seq in scheduler.waiting)
    assert len(scheduler.running) <= scheduler.max_num_seqs


def write_and_check_kv(kv: dict, seqs: list[Sequence], block_size: int) -> None:
    """Stand-in KV cache: slot -> the token prefix whose KV it holds. The batch writes its new tokens
    (all of them, before anyone reads, as the model does), then each sequence's context must be its own."""
    written = {}
    for seq in seqs:
        for p in range(seq.num_computed_tokens, len(seq)):
            slot = (seq.block_table[p // block_size], p % block_size)
            assert slot not in written, "two sequences write one KV slot in one step"
            written[slot] = tuple(seq.token_ids[: p + 1])
    kv.update(written)
    for seq in seqs:
        for p in range(len(seq)):
            assert kv.get((seq.block_table[p // block_size], p % block_size)) == tuple(seq.token_ids[: p + 1])


def run_case(model: str, seed: int, prefix_caching: bool) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    max_model_len = rng.randint(4, 32)
    config = Config(model, block_size=block_size, max_num_seqs=rng.randint(1, 6), max_model_len=max_model_len,
                    max_num_batched_tokens=rng.randint(max_model_len, 2 * max_model_len))
    requests = random_requests(rng, max_model_len, block_size)
    largest = max(-(-(len(seq) + seq.sampling_params.max_tokens) // block_size) for _, seq in requests)
    bm = BlockManager(rng.randint(largest, 3 * largest), block_size, prefix_caching)
    scheduler = Scheduler(config, bm)
    kv: dict = {}
    for t in range(10_000):
        while requests and requests[0][0] <= t:
            scheduler.add(requests.pop(0)[1])
        if scheduler.is_finished():
            if not requests:
                break
            continue
        out = scheduler.schedule()
        seqs, is_prefill = out.seqs, out.is_prefill
        assert len(seqs) <= config.max_num_seqs
        assert all(len(seq.block_table) == seq.num_blocks for seq in seqs)
        assert all(seq.num_computed_tokens < len(seq) for seq in seqs)  # the last token's logits are needed
        if is_prefill:
            assert sum(len(seq) - seq.num_computed_tokens for seq in seqs) <= config.max_num_batched_tokens
        else:
            assert all(seq.num_computed_tokens == len(seq) - 1 for seq in seqs)
        write_and_check_kv(kv, seqs, block_size)
        scheduler.postprocess(out, [rng.choice([EOS, 3, 4, 5, 6, 7]) for _ in seqs])
        check_books(scheduler)
    else:
        pytest.fail(f"seed {seed}: requests still unfinished after 10000 steps")
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_random_traffic_keeps_the_books(tiny_models, prefix_caching):
    for seed in range(NUM_CASES):
        try:
            run_case(tiny_models["qwen3"], seed, prefix_caching)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}, prefix_caching={prefix_caching}") from e


@pytest.mark.parametrize("case", range(3))
def test_tiny_pool_gives_the_same_outputs_as_a_large_one(tiny_models, case):
    rng = random.Random(case)
    shared = random_prompts(1, seed=100 + case, low=8, high=9)[0]
    prompts = [shared[: rng.randint(0, 8)] + p for p in random_prompts(5, seed=case, low=1, high=16)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(4, 16)) for _ in prompts]
    arch = ["qwen3", "qwen2", "llama"][case]

    def generate(num_kvcache_blocks):
        llm = LLM(tiny_models[arch], block_size=4, num_kvcache_blocks=num_kvcache_blocks,
                  enable_prefix_caching=case != 2)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        return [o.outputs[0].token_ids for o in outputs], llm.stats.num_preemptions

    expected, preemptions = generate(256)
    assert preemptions == 0
    largest = max(-(-(len(p) + sp.max_tokens) // 4) for p, sp in zip(prompts, params))
    outputs, preemptions = generate(largest)
    assert preemptions > 0
    assert outputs == expected
