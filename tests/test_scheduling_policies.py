"""The three switchable policies, step by step: the model is replaced by fake sampled tokens, and each test
asserts the exact batches (sequence id, tokens scheduled), queues and block moves (docs/scheduling.md)."""
import pytest

from conftest import make_scheduler
from nanoserve import LLM, SamplingParams
from nanoserve.config import make_config
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.sequence import Sequence, SequenceStatus

BS = 4
TOKEN = 7  # a fake sampled token that is not EOS


@pytest.fixture
def make(tiny_models):
    def make(num_blocks=32, num_host_blocks=0, max_num_seqs=8, max_num_batched_tokens=64, **options) -> Scheduler:
        config = make_config(tiny_models["qwen3"], dict(
            block_size=BS, num_kvcache_blocks=num_blocks, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=64, **options))
        host = BlockManager(num_host_blocks, BS, enable_prefix_caching=False) if num_host_blocks else None
        return make_scheduler(config, BlockManager(num_blocks, BS), host)
    return make


def add(scheduler: Scheduler, seq_id: int, num_tokens: int, priority: int = 0, **params) -> Sequence:
    """A prompt of distinct tokens (no prefix sharing between sequences)."""
    seq = Sequence(seq_id, [100 + 10 * seq_id + i for i in range(num_tokens)], SamplingParams(**params), BS,
                   request_id=str(seq_id))
    scheduler.priorities[seq.request_id] = priority  # (the priority chapter's books: EngineCore.add_request)
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler) -> SchedulerOutput:
    """One engine step: every sequence that reaches its end samples TOKEN."""
    out = scheduler.schedule()
    num_sampled = sum(r.do_sample + len(r.forks) for r in out.rows)  # n > 1: forks too
    scheduler.postprocess(out, [TOKEN] * num_sampled)
    return out


def batch(out: SchedulerOutput) -> list[tuple[int, int]]:
    return [(r.seq.seq_id, r.num_tokens) for r in out.rows]


def ids(seqs) -> list[int]:
    return [seq.seq_id for seq in seqs]


def all_free(scheduler: Scheduler) -> bool:
    host = getattr(scheduler, "host_block_manager", None)  # the swap chapter's pool
    pools = [scheduler.block_manager] + ([host] if host else [])
    return all(bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks) for bm in pools)


def run_to_end(scheduler: Scheduler) -> list[list[tuple[int, int]]]:
    batches = []
    while not scheduler.is_finished():
        batches.append(batch(step(scheduler)))
    return batches


# ---- token budget, chunked prefill (vLLM V1) ------------------------------------------------------------

def test_token_budget_article_example(make):
    """The article's figure: budget 10, prompts of 3, 5 and 12 tokens arriving in that order."""
    s = make(enable_chunked_prefill=True, max_num_batched_tokens=10)
    r1, r2, r3 = add(s, 1, 3), add(s, 2, 5), add(s, 3, 12)
    out = s.schedule()
    assert batch(out) == [(1, 3), (2, 5), (3, 2)]  # R3 gets the 2 tokens left of the budget
    assert [r.do_sample for r in out.rows] == [True, True, False]  # R3's chunk stops short of its prompt's end
    s.postprocess(out, [TOKEN, TOKEN])
    assert [r.num_completion_tokens for r in (r1, r2, r3)] == [1, 1, 0]
    assert batch(step(s)) == [(1, 1), (2, 1), (3, 8)]  # two decodes and a chunk in one step
    assert r3.num_computed_tokens == 10 and r3.num_completion_tokens == 0
    assert batch(step(s)) == [(1, 1), (2, 1), (3, 2)]  # R3's last chunk: its prefill is done, it samples
    assert r3.num_completion_tokens == 1
    assert batch(step(s)) == [(1, 1), (2, 1), (3, 1)]  # three decodes
    assert (s.stats.num_chunked_prefills, s.stats.num_mixed_steps, s.stats.num_prefill_steps) == (2, 2, 3)


def test_token_budget_caps_decodes_too_and_keeps_running_first(make):
    s = make(enable_chunked_prefill=True, max_num_batched_tokens=4)
    for i in range(3):
        add(s, i, 2)
    assert batch(step(s)) == [(0, 2), (1, 2)]
    add(s, 3, 6)
    assert batch(step(s)) == [(0, 1), (1, 1), (2, 2)]  # running first; 2 is admitted with what is left
    assert batch(step(s)) == [(0, 1), (1, 1), (2, 1), (3, 1)]  # 3 gets one token: a chunk of its prompt
    assert batch(step(s)) == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert s.stats.num_chunked_prefills == 2


def test_token_budget_preempts_from_the_tail_and_admits_nobody_that_step(make):
    s = make(num_blocks=5, enable_chunked_prefill=True, max_num_batched_tokens=10)
    a, b, c = add(s, 0, 4), add(s, 1, 4), add(s, 2, 10)  # 1 + 1 + 3 blocks: the pool is full
    assert batch(step(s)) == [(0, 4), (1, 4), (2, 2)]
    assert (a.block_table, b.block_table, c.block_table) == ([0], [1], [2, 3, 4])
    out = step(s)  # a and b need a 2nd block: c, at the tail, is preempted in the middle of its prompt
    assert batch(out) == [(0, 1), (1, 1)] and out.preempted == [c]
    assert (c.status, c.block_table, c.num_computed_tokens) == (SequenceStatus.WAITING, [], 0)
    assert (a.block_table, b.block_table) == ([0, 4], [1, 3])
    assert batch(step(s)) == [(0, 1), (1, 1)]  # c needs 3 blocks, 1 is free: it waits
    assert s.stats.num_preemptions == 1


def test_chunked_prefill_registers_only_computed_blocks(make):
    s = make(enable_chunked_prefill=True, max_num_batched_tokens=10)
    prompt = list(range(100, 116))
    s.add(a := Sequence(0, prompt, SamplingParams(), BS))
    assert batch(step(s)) == [(0, 10)]  # tokens 0-9: blocks 0 and 1 are full, block 2 only half
    s.add(b := Sequence(1, prompt, SamplingParams(), BS))
    assert batch(step(s)) == [(0, 6), (1, 4)]
    assert b.num_cached_tokens == 2 * BS and b.block_table[:2] == a.block_table[:2]  # not block 2
    s.add(c := Sequence(2, prompt, SamplingParams(), BS))
    step(s)
    assert c.num_cached_tokens == 3 * BS  # a finished its prompt: blocks 0-2 (the last token is always computed)


# ---- priority (vLLM V0) -----------------------------------------------------------------------------------

@pytest.mark.parametrize("policy, order", [("fcfs", [0, 1, 2, 3]), ("priority", [1, 3, 2, 0])])
def test_admission_order(make, policy, order):
    s = make(max_num_seqs=1, scheduling_policy=policy)
    for seq_id, priority in enumerate([2, 0, 1, 0] if policy == "priority" else [0] * 4):
        add(s, seq_id, 5, priority, max_tokens=1)
    assert ids(s.waiting) == order  # lower priority value first; 1 and 3 tie, 1 arrived first
    assert run_to_end(s) == [[(i, 5)] for i in order]


@pytest.mark.parametrize("policy, priorities, victim", [
    ("fcfs", [0, 0, 0], 2),  # the newest
    ("priority", [1, 1, 0], 1),  # the lowest priority (largest value), the later arrival of the two
    ("priority", [0, 5, 0], 1),
])
def test_victim_choice(make, policy, priorities, victim):
    s = make(num_blocks=6, scheduling_policy=policy)
    seqs = [add(s, 0, 8, priorities[0]), add(s, 1, 5, priorities[1]), add(s, 2, 5, priorities[2])]
    step(s)  # 2 blocks each: the pool is full, and sequence 0 needs a 3rd block for its next token
    out = step(s)
    assert out.preempted == [seqs[victim]]
    assert sorted(ids(out.seqs)) == sorted({0, 1, 2} - {victim})


@pytest.mark.parametrize("chunked", [False, True])
def test_urgent_waiting_request_preempts_a_lower_priority_one(make, chunked):
    s = make(num_blocks=4, scheduling_policy="priority", enable_chunked_prefill=chunked, preemption_mode="swap",
             num_host_blocks=8)
    low = add(s, 0, 12, priority=5, max_tokens=2)  # 3 blocks
    assert batch(step(s)) == [(0, 12)]
    urgent = add(s, 1, 8, priority=0, max_tokens=2)  # needs 2 blocks, 1 is free
    out = step(s)
    assert out.preempted == [low] and not out.blocks_to_swap_out  # recomputed, not swapped
    assert batch(out) == [(1, 8)] and urgent.block_table == [3, 2]  # in the same step
    assert (ids(s.running), ids(s.waiting)) == ([1], [0])  # the victim queues behind the newcomer
    assert s.stats.num_priority_preemptions == 1
    # low recomputes its 13 tokens but the first 4: its block 0 is still in the prefix cache.
    assert run_to_end(s) == [[(1, 1)], [(0, 9)]] and low.num_cached_tokens == BS
    assert all_free(s)


@pytest.mark.parametrize("chunked", [False, True])
def test_urgent_waiting_request_preempts_for_a_seat(make, chunked):
    """Blocks are plenty; what the urgent request lacks is a seat (max_num_seqs) (vLLM V0's budget check)."""
    s = make(max_num_seqs=1, scheduling_policy="priority", enable_chunked_prefill=chunked)
    low = add(s, 0, 6, priority=5, max_tokens=3)
    assert batch(step(s)) == [(0, 6)]
    add(s, 1, 5, priority=0, max_tokens=2)
    out = step(s)
    assert out.preempted == [low] and batch(out) == [(1, 5)]
    assert (ids(s.running), ids(s.waiting)) == ([1], [0])
    add(s, 2, 5, priority=5, max_tokens=1)  # not more urgent than anyone running: it waits its turn
    # low recomputes its 7 tokens but its cached first block; then 2, whose priority ties with low's.
    assert run_to_end(s) == [[(1, 1)], [(0, 3)], [(0, 1)], [(2, 5)]]
    assert s.stats.num_priority_preemptions == 1 and all_free(s)


def test_equal_priority_does_not_preempt(make):
    s = make(num_blocks=4, scheduling_policy="priority")
    add(s, 0, 12, priority=1)
    step(s)
    add(s, 1, 8, priority=1)
    out = step(s)
    assert batch(out) == [(0, 1)] and not out.preempted


# ---- swap preemption (vLLM V0, early vLLM) ----------------------------------------------------------------

def test_swap_out_and_in_moves_exact_blocks(make):
    s = make(num_blocks=6, num_host_blocks=4, preemption_mode="swap")
    a, b, c = add(s, 0, 8, max_tokens=2), add(s, 1, 5, max_tokens=3), add(s, 2, 5, max_tokens=3)
    assert batch(step(s)) == [(0, 8), (1, 5), (2, 5)]
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1], [2, 3], [4, 5])
    out = s.schedule()  # a needs a 3rd block: c, the newest, is swapped out
    assert batch(out) == [(0, 1), (1, 1)] and out.preempted == [c]
    assert out.blocks_to_swap_out == [(4, 0), (5, 1)] and out.blocks_to_swap_in == []
    assert (c.status, c.block_table, c.num_computed_tokens, len(c)) == (SequenceStatus.SWAPPED, [0, 1], 5, 6)
    assert ids(s.swapped) == [2] and s.host_block_manager.num_free_blocks == 2
    assert a.block_table == [0, 1, 5]  # c's block 5 came free first
    s.postprocess(out, [TOKEN, TOKEN])  # a reaches max_tokens: its blocks are free again
    add(s, 3, 3, max_tokens=3)  # a newcomer does not pass the swapped request
    out = step(s)
    assert batch(out) == [(1, 1), (2, 1)]  # b decodes; c is swapped back in and decodes in the same step
    assert out.blocks_to_swap_in == [(0, 4), (1, 5)] and c.block_table == [4, 5]
    assert c.status == SequenceStatus.RUNNING and ids(s.waiting) == [3]
    assert s.host_block_manager.num_free_blocks == 4  # the swap pool is empty again
    assert b.is_finished
    assert run_to_end(s) == [[(3, 3)], [(2, 1), (3, 1)], [(3, 1)]]
    assert (s.stats.num_swapped_out, s.stats.num_swapped_in, s.stats.num_preemptions) == (1, 1, 1)
    assert [len(x.completion_token_ids) for x in (a, b, c)] == [2, 3, 3]
    assert all_free(s)


def test_swapped_in_blocks_rejoin_the_prefix_cache(make):
    s = make(num_blocks=6, num_host_blocks=4, preemption_mode="swap")
    add(s, 0, 8, max_tokens=2), add(s, 1, 5, max_tokens=3)
    c = add(s, 2, 5, max_tokens=3)
    step(s)
    step(s)  # c is swapped out; its device blocks 4 and 5 are handed out again
    out = step(s)
    assert out.blocks_to_swap_in == [(0, 4), (1, 5)]  # as in the test above
    d = Sequence(3, c.token_ids[:BS] + [1, 2, 3], SamplingParams(max_tokens=1), BS)
    s.add(d)  # a later prompt that starts with c's first block
    out = s.schedule()
    assert batch(out) == [(3, 3)]  # only its last 3 tokens are computed
    assert d.num_cached_tokens == BS and d.block_table[0] == c.block_table[0] == 4
    assert s.block_manager.blocks[4].ref_count == 2
    s.postprocess(out, [TOKEN])
    run_to_end(s)
    assert all_free(s)


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full(make):
    s = make(num_blocks=6, num_host_blocks=1, preemption_mode="swap")
    add(s, 0, 8)
    add(s, 1, 5)
    c = add(s, 2, 5)
    step(s)
    out = step(s)
    assert out.preempted == [c] and not out.blocks_to_swap_out  # c needs 2 host blocks, there is 1
    assert (c.status, c.block_table, c.num_computed_tokens) == (SequenceStatus.WAITING, [], 0)
    assert (s.stats.num_preemptions, s.stats.num_swapped_out) == (1, 0)


def test_swap_with_chunked_prefill_resumes_mid_prompt(make):
    s = make(num_blocks=5, num_host_blocks=8, preemption_mode="swap", enable_chunked_prefill=True,
             max_num_batched_tokens=10)
    a, b, c = add(s, 0, 4, max_tokens=2), add(s, 1, 4, max_tokens=2), add(s, 2, 10, max_tokens=2)
    step(s)
    out = step(s)  # as in the recompute test above, but c keeps its 2 computed tokens in host memory
    assert out.preempted == [c] and out.blocks_to_swap_out == [(2, 0), (3, 1), (4, 2)]
    assert (c.status, c.num_computed_tokens) == (SequenceStatus.SWAPPED, 2)
    assert a.is_finished and b.is_finished
    out = step(s)
    assert out.blocks_to_swap_in == [(0, 2), (1, 4), (2, 0)]
    assert batch(out) == [(2, 8)]  # the rest of its prompt, not all of it
    assert run_to_end(s) == [[(2, 1)]] and all_free(s)


def test_abort_frees_a_swapped_request(make):
    s = make(num_blocks=6, num_host_blocks=4, preemption_mode="swap")
    add(s, 0, 8)
    add(s, 1, 5)
    c = add(s, 2, 5)
    step(s)
    step(s)
    assert c.status == SequenceStatus.SWAPPED
    s.finish(c)
    assert not s.swapped and s.host_block_manager.num_free_blocks == 4 and c.is_finished


# ---- options and their errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("options, words", [
    (dict(scheduling_policy="lifo"), ["scheduling_policy", "fcfs", "priority"]),
    (dict(preemption_mode="drop"), ["preemption_mode", "recompute", "swap"]),
    (dict(swap_space=-1.0), ["swap_space", ">= 0"]),
    (dict(preemption_mode="swap", swap_space=0), ["preemption_mode='swap'", "swap_space > 0"]),
    (dict(max_num_batched_tokens=16, max_model_len=64), ["max_num_batched_tokens", "enable_chunked_prefill"]),
])
def test_bad_scheduling_options(tiny_models, options, words):
    with pytest.raises(ValueError) as e:
        make_config(tiny_models["qwen3"], options)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_swap_space_too_small_for_one_block(tiny_models):
    with pytest.raises(ValueError, match="swap_space .* too small for one KV block"):
        LLM(tiny_models["qwen3"], num_kvcache_blocks=8, block_size=4, preemption_mode="swap", swap_space=1e-9)


def test_priority_argument(tiny_models):
    fcfs = LLM(tiny_models["qwen3"], num_kvcache_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        fcfs.generate([[5, 6]], use_tqdm=False, priority=[1])
    llm = LLM(tiny_models["qwen3"], num_kvcache_blocks=8, block_size=4, scheduling_policy="priority")
    with pytest.raises(ValueError, match="priority: got 1 for 2 prompts"):
        llm.generate([[5, 6], [7, 8]], use_tqdm=False, priority=[1])
    assert len(llm.generate([[5, 6], [7, 8]], use_tqdm=False, priority=[1, -1])) == 2
