"""engine/input_batch.py without a model: a hand-made plan becomes exactly these tensors."""
import torch

from nanoserve.engine.input_batch import InputBuilder
from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.engine.sequence import Sequence
from nanoserve.sampling_params import SamplingParams

BS, VOCAB, EOS = 4, 100, 2


def make(seq_id: int, prompt: list[int], block_table: list[int], **params) -> Sequence:
    seq = Sequence(seq_id, prompt, SamplingParams(**params), BS)
    seq.block_table = block_table
    return seq


def plan(*rows: tuple[Sequence, int]) -> SchedulerOutput:
    """What Scheduler.schedule does with its picks: add each, then count the plan as done."""
    out = SchedulerOutput()
    for seq, num_tokens in rows:
        out.add(seq, num_tokens)
    for seq, num_tokens, do_sample in zip(out.seqs, out.num_scheduled_tokens, out.do_sample):
        seq.num_computed_tokens += num_tokens
        seq.num_output_placeholders += do_sample
    return out


def test_a_mixed_batch_becomes_exactly_these_inputs():
    # a: a whole prompt of 6, n = 2 (its fork samples from the same row); b: a decode with a repetition penalty
    # and min_tokens; c: the first chunk of a 10-token prompt (samples nothing); d: async scheduling's decode of
    # a token the step before is still sampling (a placeholder).
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
    out = plan((a, 6), (b, 1), (c, 4), (d, 1))
    assert [s.num_outputs_in_flight for s in (a, b, d)] == [0, 0, 1]

    inputs = InputBuilder(block_size=BS, vocab_size=VOCAB, eos_token_ids=[EOS],
                          device=torch.device("cpu")).prepare_inputs(out)
    assert inputs.input_ids.tolist() == [10, 11, 12, 13, 14, 15, 25, 30, 31, 32, 33, 0]
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4, 5, 5, 0, 1, 2, 3, 3]
    # slot = block_table[p // 4] * 4 + p % 4
    assert inputs.meta.slot_mapping.tolist() == [12, 13, 14, 15, 28, 29, 17, 20, 21, 22, 23, 39]
    assert inputs.meta.block_tables.tolist() == [[3, 7, -1], [1, 4, -1], [5, 6, 8], [9, -1, -1]]
    assert inputs.meta.context_lens.tolist() == [6, 6, 4, 4]
    assert inputs.meta.cu_seqlens_q.tolist() == [0, 6, 7, 11, 12]
    assert inputs.meta.cu_seqlens_k.tolist() == [0, 6, 12, 16, 20]
    assert (inputs.meta.max_seqlen_q, inputs.meta.max_seqlen_k) == (6, 6)
    assert inputs.logits_rows.tolist() == [5, 5, 6, 11]  # a and its fork, b, d; c's chunk samples nothing
    assert inputs.sample_seq_ids == [0, 1, 2, 4]
    assert (inputs.placeholder_rows, inputs.placeholder_seq_ids) == ([11], [4])
    assert inputs.logprobs == []

    sampling = inputs.sampling
    assert sampling.temperatures.tolist() == [0.5, 0.5, 0.0, 0.0] and sampling.top_ks.tolist() == [5, 5, 100, 100]
    assert sampling.top_ps is None and sampling.min_ps is None and sampling.generators == [None] * 4
    rows, token_ids = sampling.min_tokens_mask  # b has 1 output token of 3, d 0 + 1 in flight of 2
    assert rows.tolist() == [2, 2, 3] and token_ids.tolist() == [7, EOS, EOS]
    p = sampling.penalties  # one row asks for a penalty: every row gets its ids (the others' penalties are 0/1)
    assert p.output_token_ids.tolist() == [[VOCAB], [VOCAB], [25], [-1]]  # -1: the token in flight
    assert p.prompt_token_ids[2].tolist() == [20, 21, 22, 23, 24, VOCAB]
    assert p.repetition_penalties.tolist() == [1.0, 1.0, 1.25, 1.0]


def test_options_no_row_uses_are_none_and_everyone_preempted_is_no_batch():
    builder = InputBuilder(block_size=BS, vocab_size=VOCAB, eos_token_ids=[EOS], device=torch.device("cpu"))
    assert builder.prepare_inputs(SchedulerOutput()) is None
    seq = make(0, [5, 6, 7], [2], temperature=0, logprobs=1, prompt_logprobs=0)
    inputs = builder.prepare_inputs(plan((seq, 3)))
    s = inputs.sampling
    assert (s.temperatures, s.top_ks, s.top_ps, s.min_ps, s.penalties, s.min_tokens_mask) == (None,) * 6
    # logits rows: the sampled row first, then the prompt rows (position p scores token p + 1)
    assert inputs.logits_rows.tolist() == [2, 0, 1]
    assert inputs.logprobs == [(seq, None, 0), (seq, 1, 1), (seq, 2, 2)]
