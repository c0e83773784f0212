"""Scheduler unit tests: the model is replaced by fake sampled tokens; queues and blocks are exact."""
import pytest

from conftest import make_scheduler
from nanoserve.config import Config
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.sampling_params import SamplingParams

BS = 4
EOS = 2
TOKEN = 7  # a fake sampled token that is not EOS


@pytest.fixture
def make(tiny_models):
    def make(num_blocks=32, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64) -> Scheduler:
        config = Config(tiny_models["qwen3"], block_size=BS, num_kvcache_blocks=num_blocks, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len)
        return make_scheduler(config, BlockManager(num_blocks, BS))
    return make


def add(scheduler: Scheduler, seq_id: int, num_tokens: int, **params) -> Sequence:
    """A prompt of distinct tokens (no prefix sharing between sequences)."""
    seq = Sequence(seq_id, [100 + 10 * seq_id + i for i in range(num_tokens)], SamplingParams(**params), BS)
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler, token_id: int = TOKEN) -> tuple[list[int], bool]:
    """One engine step with every scheduled sequence sampling token_id. Returns (batch ids, is_prefill)."""
    out = scheduler.schedule()
    scheduler.postprocess(out, [token_id] * len(out.seqs))
    return ids(out.seqs), out.is_prefill


def ids(seqs) -> list[int]:
    return [seq.seq_id for seq in seqs]


def queues(scheduler: Scheduler) -> tuple[list[int], list[int]]:
    return ids(scheduler.waiting), ids(scheduler.running)


def all_free(scheduler: Scheduler) -> bool:
    bm = scheduler.block_manager
    return bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_prefill_comes_before_decode(make):
    s = make()
    add(s, 0, 5)
    add(s, 1, 5)
    assert step(s) == ([0, 1], True)
    assert step(s) == ([0, 1], False)
    add(s, 2, 5)
    assert step(s) == ([2], True)  # the newcomer is prefilled while 0 and 1 wait
    assert step(s) == ([0, 1, 2], False)
    assert s.stats.num_steps == 4 and s.stats.num_prefill_steps == 2


def test_prefill_admission_is_capped_by_max_num_seqs(make):
    s = make(max_num_seqs=2)
    for i in range(3):
        add(s, i, 5)
    assert step(s) == ([0, 1], True)
    assert queues(s) == ([2], [0, 1])
    assert step(s) == ([0, 1], False)  # no seat for 2: decode instead


def test_prefill_admission_is_capped_by_max_num_batched_tokens(make):
    s = make(max_num_batched_tokens=16, max_model_len=16)
    add(s, 0, 10)
    add(s, 1, 10)
    add(s, 2, 5)
    assert step(s) == ([0], True)  # 10 + 10 > 16; 2 does not jump ahead of 1
    assert step(s) == ([1, 2], True)
    assert step(s) == ([0, 1, 2], False)


def test_prefill_budget_counts_only_the_tokens_past_the_cached_prefix(make):
    s = make(max_num_batched_tokens=16, max_model_len=16)
    prefix = list(range(100, 108))
    s.add(Sequence(0, prefix + [1, 2, 3, 4], SamplingParams(max_tokens=1), BS))
    step(s)  # its blocks are cached now
    seqs = [Sequence(i, prefix + [10 * i] * 4, SamplingParams(max_tokens=1), BS) for i in (1, 2, 3)]
    for seq in seqs:
        s.add(seq)
    out = s.schedule()  # 3 x 12 tokens would not fit the budget of 16; 3 x 4 computed tokens do
    assert ids(out.seqs) == [1, 2, 3] and [r.num_tokens for r in out.rows] == [4, 4, 4]
    assert [seq.num_cached_tokens for seq in seqs] == [8, 8, 8]


def test_preemption_takes_the_newest_running_sequence(make):
    s = make(num_blocks=6)
    a, b, c = add(s, 0, 8), add(s, 1, 5), add(s, 2, 5)  # 2 blocks each: the pool is full
    assert step(s) == ([0, 1, 2], True)
    assert [a.block_table, b.block_table, c.block_table] == [[0, 1], [2, 3], [4, 5]]
    add(s, 3, 3)  # needs a block: cannot be prefilled
    assert step(s) == ([0, 1], False)  # a needs a 3rd block: c, the newest, gives its blocks up
    assert queues(s) == ([2, 3], [0, 1])  # the victim is at the front of waiting
    assert c.status == SequenceStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert a.block_table == [0, 1, 5]
    assert len(c) == 6  # it keeps its generated token, to recompute it
    assert s.stats.num_preemptions == 1


def test_sequence_preempts_itself_when_earlier_ones_took_the_blocks(make):
    s = make(num_blocks=5)
    a, b, c = add(s, 0, 4), add(s, 1, 4), add(s, 2, 4)
    assert step(s) == ([0, 1, 2], True)  # 3 blocks used, 2 free; each now needs a 2nd block
    assert step(s) == ([0, 1], False)
    assert queues(s) == ([2], [0, 1])
    assert [a.block_table, b.block_table, c.block_table] == [[0, 3], [1, 4], []]
    assert s.block_manager.num_free_blocks == 1  # c's block came back


def test_finish_on_eos(make):
    s = make()
    seq = add(s, 0, 5)
    step(s)
    step(s, EOS)
    assert (seq.finish_reason, seq.completion_token_ids, seq.status) == ("stop", [TOKEN, EOS], SequenceStatus.FINISHED)
    assert queues(s) == ([], []) and all_free(s)


def test_ignore_eos_runs_to_max_tokens(make):
    s = make()
    seq = add(s, 0, 5, ignore_eos=True, max_tokens=3)
    for _ in range(3):
        step(s, EOS)
    assert (seq.finish_reason, seq.completion_token_ids) == ("length", [EOS] * 3)
    assert s.is_finished() and all_free(s)


def test_finish_on_max_tokens(make):
    s = make()
    seq = add(s, 0, 5, max_tokens=3)
    step(s)
    step(s)
    assert seq.finish_reason is None and queues(s) == ([], [0])
    step(s)
    assert (seq.finish_reason, seq.num_completion_tokens) == ("length", 3)
    assert s.is_finished() and all_free(s)


def test_finish_on_stop_token_id(make):
    s = make()
    seq = add(s, 0, 5, stop_token_ids=[9])
    step(s)
    step(s, 9)
    assert (seq.finish_reason, seq.completion_token_ids) == ("stop", [TOKEN, 9])
    assert s.is_finished() and all_free(s)


def test_stats_and_blocks_in_a_small_preempting_scenario(make):
    s = make(num_blocks=5)
    a, b = add(s, 0, 8, max_tokens=5), add(s, 1, 8, max_tokens=5)
    batches = []
    while not s.is_finished():
        batches.append(step(s))
    assert batches == [
        ([0, 1], True),  # blocks a [0, 1], b [2, 3]; 1 free
        ([0], False),  # a takes block 4; b has nobody to preempt but itself
        ([0], False), ([0], False), ([0], False),  # b cannot come back: it needs 3 blocks, 2 are free
        ([1], True),  # a finished; b recomputes, its freed blocks 2 and 3 still cached
        ([1], False), ([1], False), ([1], False),
    ]
    assert (a.finish_reason, b.finish_reason) == ("length", "length")
    assert b.num_cached_tokens == 8
    assert s.stats.num_preemptions == 1
    assert s.stats.num_prompt_tokens == 8 + 8 + 9  # b is admitted twice, the second time with 9 tokens
    assert s.stats.num_cached_tokens == 8
    assert s.stats.num_generated_tokens == 10
    assert all_free(s)


def test_abort_frees_running_and_waiting_sequences(make):
    s = make(num_blocks=3)
    a = add(s, 0, 9)
    b = add(s, 1, 5)  # does not fit next to a
    assert step(s) == ([0], True)
    assert queues(s) == ([1], [0])
    s.finish(a)
    assert queues(s) == ([1], []) and all_free(s) and a.status == SequenceStatus.FINISHED
    s.finish(b)
    assert s.is_finished() and all_free(s) and b.status == SequenceStatus.FINISHED
