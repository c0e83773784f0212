"""engine/model_runner.py without a model: a hand-made plan becomes exactly these tensors, with the core's plain
loops and with the persistent input batch (nanoserve/persistent_batch.py, a chapter), which build the same."""
import random

import pytest
import torch
from test_reading_guide import files_run
from test_scheduling_random import next_token, random_case

from conftest import make_scheduler
from nanoserve import LLM
from nanoserve.beam_search.scheduler import BeamSchedulerOutput
from nanoserve.chapters import ChaptersInputBuilder, ChaptersSchedulerOutput
from nanoserve.engine.model_runner import InputBuilder
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.engine.sequence import Sequence
from nanoserve.logprobs import LogprobsInputBuilder
from nanoserve.persistent_batch import InputBatch
from nanoserve.sampling_params import SamplingParams
from nanoserve.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID
from nanoserve.speculative_config import SpeculativeConfig

BS, VOCAB, EOS = 4, 100, 2
BUILDERS = ["plain", "persistent"]


def builder(kind: str, block_size: int = BS, cls: type[InputBuilder] | None = None) -> InputBuilder:
    """The core's InputBuilder, with its plain loops, or the persistent batch's subclass of it (or cls)."""
    cls = cls or (InputBatch if kind == "persistent" else InputBuilder)
    return cls(block_size=block_size, vocab_size=VOCAB, eos_token_ids=[EOS], device=torch.device("cpu"))


def make(seq_id: int, prompt: list[int], block_table: list[int], **params) -> Sequence:
    seq = Sequence(seq_id, prompt, SamplingParams(**params), BS)
    seq.block_table = block_table
    return seq


def plan(*rows: tuple[Sequence, int], out: SchedulerOutput | None = None) -> SchedulerOutput:
    """What Scheduler.schedule does with its picks: add each, then count the plan as done."""
    out = SchedulerOutput() if out is None else out
    for seq, num_tokens in rows:
        out.add(seq, num_tokens)
    for row in out.rows:
        row.seq.num_computed_tokens += row.num_tokens
        row.seq.num_output_placeholders += row.do_sample
    return out


@pytest.mark.parametrize("kind", BUILDERS)
def test_a_mixed_batch_becomes_exactly_these_inputs(kind):
    # a: a whole prompt of 6, n = 2 (its fork samples from the same row); b: a decode with a repetition penalty
    # and min_tokens; c: the first chunk of a 10-token prompt (samples nothing); d: async scheduling's decode of
    # a token the step before is still sampling (a placeholder: the persistent batch's alone, which async
    # scheduling always uses; the plain loops get a, b and c, and each expected list below without d's part).
    a = make(0, [10, 11, 12, 13, 14, 15], [3, 7], n=2, temperature=0.5, top_k=5)
    a2 = Sequence(1, a.token_ids, a.sampling_params, BS, index=1)
    a.group = a2.group = [a, a2]
    b = make(2, [20, 21, 22, 23, 24], [1, 4], temperature=0, repetition_penalty=1.25, min_tokens=3,
             stop_token_ids=[7])
    b.append_token(25)
    b.num_computed_tokens = 5
    c = make(3, list(range(30, 40)), [5, 6, 8], temperature=0)
    d = make(4, [40, 41, 42], [9], temperature=0, min_tokens=2)
    d.num_computed_tokens, d.num_output_placeholders = 3, 1
    with_d = kind == "persistent"
    out = plan((a, 6), (b, 1), (c, 4), *[(d, 1)] * with_d)
    assert [s.num_outputs_in_flight for s in (a, b, d)] == [0, 0, with_d]

    def cut(expected: list) -> list:  # without d's part
        return expected if with_d else expected[:-1]

    inputs = builder(kind).prepare_inputs(out)
    assert inputs.input_ids.tolist() == cut([10, 11, 12, 13, 14, 15, 25, 30, 31, 32, 33, 0])
    assert inputs.positions.tolist() == cut([0, 1, 2, 3, 4, 5, 5, 0, 1, 2, 3, 3])
    # slot = block_table[p // 4] * 4 + p % 4
    assert inputs.meta.slot_mapping.tolist() == cut([12, 13, 14, 15, 28, 29, 17, 20, 21, 22, 23, 39])
    assert inputs.meta.block_tables.tolist() == cut([[3, 7, -1], [1, 4, -1], [5, 6, 8], [9, -1, -1]])
    assert inputs.meta.context_lens.tolist() == cut([6, 6, 4, 4])
    assert inputs.meta.cu_seqlens_q.tolist() == cut([0, 6, 7, 11, 12])
    assert inputs.meta.cu_seqlens_k.tolist() == cut([0, 6, 12, 16, 20])
    assert (inputs.meta.max_seqlen_q, inputs.meta.max_seqlen_k) == (6, 6)
    assert inputs.logits_rows.tolist() == cut([5, 5, 6, 11])  # a and its fork, b, d; c's chunk samples nothing
    assert inputs.sample_seq_ids == cut([0, 1, 2, 4])
    # d's row 11 awaits the token seq 4 is still sampling
    assert getattr(inputs, "placeholders", []) == ([(11, 4)] if with_d else [])  # (the persistent batch's field)

    sampling = inputs.sampling
    assert sampling.temperatures.tolist() == cut([0.5, 0.5, 0.0, 0.0])
    assert sampling.top_ks.tolist() == cut([5, 5, 100, 100])
    assert sampling.top_ps is None and sampling.min_ps is None and sampling.generators == cut([None] * 4)
    rows, token_ids = sampling.min_tokens_mask  # b has 1 output token of 3, d 0 + 1 in flight of 2
    assert rows.tolist() == cut([2, 2, 3]) and token_ids.tolist() == cut([7, EOS, EOS])
    p = sampling.penalties  # one row asks for a penalty: every row gets its ids (the others' penalties are 0/1)
    assert p.output_token_ids.tolist() == cut([[VOCAB], [VOCAB], [25], [-1]])  # -1: the token in flight
    assert p.prompt_token_ids[2].tolist() == [20, 21, 22, 23, 24, VOCAB]
    assert p.repetition_penalties.tolist() == cut([1.0, 1.0, 1.25, 1.0])


@pytest.mark.parametrize("kind", BUILDERS)
def test_options_no_row_uses_are_none_and_everyone_preempted_is_no_batch(kind):
    assert builder(kind).prepare_inputs(SchedulerOutput()) is None
    seq = make(0, [5, 6, 7], [2], temperature=0, logprobs=1, prompt_logprobs=0)
    # the logprobs chapter's subclass (nanoserve/logprobs.py), on the core's builder or in the composite
    cls = ChaptersInputBuilder if kind == "persistent" else LogprobsInputBuilder
    b = cls(block_size=BS, vocab_size=VOCAB, eos_token_ids=[EOS], device=torch.device("cpu"))
    inputs = b.prepare_inputs(plan((seq, 3), out=ChaptersSchedulerOutput()))
    s = inputs.sampling
    assert (s.temperatures, s.top_ks, s.top_ps, s.min_ps, s.penalties, s.min_tokens_mask) == (None,) * 6
    # logits rows: the sampled row first, then the prompt rows (position p scores token p + 1)
    assert inputs.logits_rows.tolist() == [2, 0, 1]
    assert inputs.logprobs_places == [(seq, None, 0), (seq, 1, 1), (seq, 2, 2)]


def as_lists(inputs) -> dict:
    """Every tensor of a ModelInput as lists (None stays None), the sampling options' too."""
    s, m = inputs.sampling, inputs.meta
    tensors = dict(input_ids=inputs.input_ids, positions=inputs.positions, logits_rows=inputs.logits_rows,
                   slot_mapping=m.slot_mapping, block_tables=m.block_tables, context_lens=m.context_lens,
                   cu_seqlens_q=m.cu_seqlens_q, cu_seqlens_k=m.cu_seqlens_k, temperatures=s.temperatures,
                   top_ks=s.top_ks, top_ps=s.top_ps, min_ps=s.min_ps,
                   min_tokens_mask=None if s.min_tokens_mask is None else torch.stack(s.min_tokens_mask))
    if s.penalties is not None:
        tensors.update(vars(s.penalties))
    lists = {name: None if t is None else (t.dtype, t.tolist()) for name, t in tensors.items()}
    return lists | dict(max_seqlen=(m.max_seqlen_q, m.max_seqlen_k), sample_seq_ids=inputs.sample_seq_ids,
                        placeholders=getattr(inputs, "placeholders", []))


@pytest.mark.parametrize("seed", range(40))
def test_persistent_rows_equal_a_fresh_build_through_random_traffic(tiny_models, seed):
    """Random arrivals, chunked prefill, preemption (recompute and swap), copy-on-write forks (n > 1), prefix
    caching, lookahead tokens with random rollbacks (every other case) and finishing (test_scheduling_random's
    cases), with random sampling options per request: one persistent batch kept across the steps builds exactly
    what a new one builds each step, and what the core's plain loops build."""
    rng = random.Random(seed)
    config, requests, scheduler = random_case(rng, tiny_models["qwen3"], prefix_caching=seed % 2 == 0)
    for _, first in requests:
        p = first.sampling_params
        p.temperature, p.top_k, p.top_p = rng.choice([0.0, 0.7, 1e-50]), rng.choice([-1, 3]), rng.choice([1.0, 0.9])
        p.min_p, p.min_tokens = rng.choice([0.0, 0.1]), rng.choice([0, 0, 2])
        p.presence_penalty, p.repetition_penalty = rng.choice([0.0, 0.0, 0.5]), rng.choice([1.0, 1.0, 1.2])

    kept, num_steps = builder("persistent", config.block_size), 0
    if seed % 2 == 1:  # speculative decoding's scheduler, its proposer replaced by random drafts
        config.speculative_config = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
        scheduler = make_scheduler(config, scheduler.block_manager, getattr(scheduler, "host_block_manager", None))

        def propose_drafts() -> None:  # as the proposer sets them: for decoding sequences
            for seq in scheduler.running:
                if seq.num_computed_tokens == len(seq.token_ids) - 1:
                    seq.spec_token_ids = [rng.randint(3, 9) for _ in range(rng.randint(0, 3))]

        scheduler.propose_drafts = propose_drafts
    for t in range(10_000):
        while requests and requests[0][0] <= t:
            scheduler.add(requests.pop(0)[1])
        if scheduler.is_finished():
            if not requests:
                break
            continue
        out = scheduler.schedule()
        if out.seqs:
            inputs = as_lists(kept.prepare_inputs(out))
            assert inputs == as_lists(builder("persistent", config.block_size).prepare_inputs(out)), f"step {t}"
            assert inputs == as_lists(builder("plain", config.block_size).prepare_inputs(out)), f"step {t}"
            num_steps += 1
        token_ids = []
        for seq, do_sample, forks in ((r.seq, r.do_sample, r.forks) for r in out.rows):
            drafts = getattr(out, "scheduled_spec_decode_tokens", {})
            lookahead = drafts.get(seq.seq_id, []) if do_sample else []
            if lookahead:  # a random accepted run, then the verifier's token; placeholders for the rejected rest
                run = lookahead[: rng.randint(0, len(lookahead))]
                rejected = [PLACEHOLDER_TOKEN_ID] * (len(lookahead) - len(run))
                token_ids += run + [next_token(seq.token_ids + run)] + rejected
            elif do_sample:
                token_ids += [next_token(s.token_ids, s.index) for s in [seq, *forks]]
        scheduler.postprocess(out, token_ids)
    assert scheduler.is_finished() and num_steps > 0


@pytest.mark.parametrize("kind", BUILDERS)
def test_a_tiny_temperature_still_counts_as_used(kind):
    # 1e-50 is 0 in float32: the "no row uses it" test must see the value as given, as a list of floats would.
    kept = builder(kind)
    inputs = kept.prepare_inputs(plan((make(0, [5, 6], [1], temperature=0), 2), (make(1, [7], [2]), 1)))
    assert inputs.sampling.temperatures.tolist() == [0.0, 1.0]
    seq = make(2, [5, 6], [3], temperature=1e-50)
    assert kept.prepare_inputs(plan((seq, 2))).sampling.temperatures.tolist() == [0.0]


@pytest.mark.parametrize("kind", BUILDERS)
def test_lookahead_tokens_are_inputs_and_each_gets_a_sampling_row(kind):
    # a verifies 2 drafts after its newest token (rows 2, 3, 4: 1 + k sampling rows); b's request picks its own
    # tokens (a beam: nothing drawn), its row after the sampled ones, where the beam search's builder puts it.
    a = make(0, [10, 11, 12], [3, 6], temperature=0, presence_penalty=0.5)
    a.append_token(13)
    a.num_computed_tokens, a.spec_token_ids = 3, [14, 15]
    b = make(1, [20, 21], [5], temperature=0)
    # the beam search chapter's builder (beam_search/scheduler.py), over the core's or the persistent batch
    built = builder(kind, cls=ChaptersInputBuilder)
    built.persistent = kind == "persistent"
    out = plan((a, 3), (b, 2), out=BeamSchedulerOutput(beam_seq_ids={1}))
    inputs = built.prepare_inputs(out)
    assert inputs.input_ids.tolist() == [13, 14, 15, 20, 21]
    assert inputs.positions.tolist() == [3, 4, 5, 0, 1]
    assert inputs.meta.slot_mapping.tolist() == [15, 24, 25, 20, 21]
    assert inputs.logits_rows.tolist() == [0, 1, 2, 4] and out.beam_logits_rows == [3]
    assert inputs.sample_seq_ids == [0, 0, 0] and inputs.spec_decode_tokens == {0: [14, 15]}
    # row (a, j) counts a's first j drafts as output (penalties)
    assert inputs.sampling.penalties.output_token_ids.tolist() == [[13, VOCAB, VOCAB], [13, 14, VOCAB], [13, 14, 15]]


@pytest.mark.parametrize("options, joins", [({}, False), ({"async_scheduling": True}, True)])
def test_the_chapter_joins_with_async_scheduling_and_not_for_a_plain_request(tiny_models, options, joins):
    llm = LLM(tiny_models["qwen3"], **options)
    ran = files_run(lambda: llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False))
    assert ("nanoserve/persistent_batch.py" in ran) == joins == isinstance(llm.engine.input_builder, InputBatch)
