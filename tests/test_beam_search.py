"""Beam search's step (nanoserve/beam_search/search.py) against transformers' generate(num_beams=...).

The reference driver runs the step with a plain transformers forward over every beam's whole sequence (no KV
cache, no engine); its result must equal generate's token for token and in the returned order. The hand-made
steps check the fork/drop plan the engine will act on."""
import math
from dataclasses import replace
from itertools import count

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from conftest import ARCHS, random_prompts
from nanoserve.beam_search.search import BeamChild, BeamSearch, BeamStepOutput, Candidate, Hypothesis
from nanoserve.beam_search_params import BeamSearchParams
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.sequence import Sequence
from nanoserve.sampling_params import SamplingParams

WIDTHS = [1, 2, 4, 8]
LENGTH_PENALTIES = [0.5, 1.0, 2.0]
EARLY_STOPPINGS = [False, True, "never"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def hf_models(tiny_models) -> dict[str, AutoModelForCausalLM]:
    models = {}
    for arch, path in tiny_models.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # each run names its own EOS ids (none for ignore_eos)
        models[arch] = model
    return models


def reference_beam_search(model, prompt: list[int], params: BeamSearchParams,
                          eos_token_ids: list[int]) -> list[Hypothesis]:
    """BeamSearch driven by a plain forward that recomputes every live beam's whole sequence each step."""
    search = BeamSearch(params, eos_token_ids)
    while not search.done:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + beam.token_ids for beam in search.beams])).logits[:, -1]
        search.step(logits)
    return search.hypotheses


def hf_beam_search(model, prompt: list[int], params: BeamSearchParams, eos_token_ids: list[int],
                   **kwargs) -> tuple[list[list[int]], list[float] | None]:
    """transformers' generate: the returned sequences' generated tokens, best first, and their scores (none for
    beam_width 1, which generate runs as greedy search)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=params.beam_width,
                         num_return_sequences=params.beam_width, do_sample=False,
                         length_penalty=params.length_penalty, early_stopping=params.early_stopping,
                         max_new_tokens=params.max_tokens, eos_token_id=None if params.ignore_eos else eos_token_ids,
                         return_dict_in_generate=True, output_scores=True, **kwargs)
    generated = out.sequences[:, len(prompt):]
    if params.beam_width == 1:
        return [generated[0].tolist()], None
    # Rows are padded to the longest; beam_indices is -1 past each sequence's own end.
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    return [row[:n].tolist() for row, n in zip(generated, lengths)], out.sequences_scores.tolist()


def assert_equal_to_transformers(model, prompt, params, eos_token_ids, **kwargs) -> list[Hypothesis]:
    ours = reference_beam_search(model, prompt, params, eos_token_ids)
    token_ids, scores = hf_beam_search(model, prompt, params, eos_token_ids, **kwargs)
    assert [h.token_ids for h in ours] == token_ids
    if scores is not None:
        assert [h.score for h in ours] == pytest.approx(scores, abs=1e-4)
    assert all((h.finish_reason == "stop") == (h.token_ids[-1] in eos_token_ids) for h in ours)
    return ours


def eos_met_by(model, prompt: list[int], params: BeamSearchParams, positions: list[int]) -> list[int]:
    """EOS ids the search will meet: tokens of the best beam of the same search without EOS (a tiny random model
    rarely produces a fixed EOS id by itself)."""
    best = reference_beam_search(model, prompt, replace(params, ignore_eos=True), [])[0].token_ids
    return [best[i] for i in positions]


@pytest.mark.parametrize("beam_width", WIDTHS)
@pytest.mark.parametrize("arch", ARCHS)
def test_equals_transformers(hf_models, arch, beam_width):
    """Every length penalty x early_stopping rule with EOS stops (two EOS ids under "never", so 3 x beam_width
    candidates a step), and every length penalty without EOS, each on its own prompt of 5 to 40 tokens."""
    model = hf_models[arch]
    prompts = iter(random_prompts(12, seed=10 * ARCHS.index(arch) + beam_width, low=5, high=40))
    num_stops = 0
    for length_penalty in LENGTH_PENALTIES:
        assert_equal_to_transformers(model, next(prompts), BeamSearchParams(
            beam_width=beam_width, max_tokens=MAX_TOKENS, ignore_eos=True, length_penalty=length_penalty), [])
        for early_stopping in EARLY_STOPPINGS:
            prompt = next(prompts)
            params = BeamSearchParams(beam_width=beam_width, max_tokens=MAX_TOKENS, length_penalty=length_penalty,
                                      early_stopping=early_stopping)
            eos_token_ids = eos_met_by(model, prompt, params, [2, 4] if early_stopping == "never" else [2])
            hypotheses = assert_equal_to_transformers(model, prompt, params, eos_token_ids)
            num_stops += sum(h.finish_reason == "stop" for h in hypotheses)
    assert num_stops >= beam_width  # the EOS stops really happened


def test_early_stopping_rules_differ(hf_models):
    """True, False and "never" each change the result on some run, and transformers agrees on all of them."""
    model = hf_models["qwen3"]
    results = {}
    for i, prompt in enumerate(random_prompts(10, seed=3, low=5, high=40)[:2]):
        for position in (1, 2):
            for length_penalty in (1.0, 2.0):
                for early_stopping in EARLY_STOPPINGS:
                    params = BeamSearchParams(beam_width=2, max_tokens=10, length_penalty=length_penalty,
                                              early_stopping=early_stopping)
                    eos_token_ids = eos_met_by(model, prompt, params, [position])
                    hypotheses = assert_equal_to_transformers(model, prompt, params, eos_token_ids)
                    results[i, position, length_penalty, early_stopping] = [h.token_ids for h in hypotheses]
    runs = {key[:3] for key in results}
    assert any(results[run + (True,)] != results[run + (False,)] for run in runs)
    assert any(results[run + (False,)] != results[run + ("never",)] for run in runs)


class TemperatureLogprobs(LogitsProcessor):
    """transformers hands processors the log_softmax of the logits; this rescores them as log_softmax(logits / t)."""

    def __init__(self, temperature: float):
        self.temperature = temperature

    def __call__(self, input_ids, scores):
        return torch.log_softmax(scores / self.temperature, dim=-1)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature(hf_models, temperature):
    model = hf_models["qwen2"]
    prompt = random_prompts(1, seed=5, low=5, high=40)[0]
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, temperature=temperature)
    eos_token_ids = eos_met_by(model, prompt, params, [3])
    assert_equal_to_transformers(model, prompt, params, eos_token_ids,
                                 logits_processor=LogitsProcessorList([TemperatureLogprobs(temperature)]))


@pytest.mark.parametrize("early_stopping", EARLY_STOPPINGS)
def test_width_one_is_greedy(hf_models, early_stopping):
    """beam_width 1 is greedy decoding, stopping at the first EOS, whatever the length penalty and early_stopping."""
    model = hf_models["llama"]
    for seed, length_penalty in enumerate(LENGTH_PENALTIES):
        prompt = random_prompts(1, seed=seed, low=5, high=40)[0]
        greedy = []
        with torch.no_grad():
            for _ in range(MAX_TOKENS):
                greedy.append(model(torch.tensor([prompt + greedy])).logits[0, -1].argmax().item())
        eos = greedy[2]
        params = BeamSearchParams(beam_width=1, max_tokens=MAX_TOKENS, length_penalty=length_penalty,
                                  early_stopping=early_stopping)
        [hypothesis] = reference_beam_search(model, prompt, params, [eos])
        assert hypothesis.token_ids == greedy[: greedy.index(eos) + 1]
        assert hypothesis.finish_reason == "stop"
        [hypothesis] = reference_beam_search(model, prompt, replace(params, ignore_eos=True), [eos])
        assert hypothesis.token_ids == greedy and hypothesis.finish_reason == "length"


# ---- hand-made steps: the fork / drop plan ---------------------------------------------------------------------
EOS = 5
BS = 4  # block size of the block-books test


def logits(*probs: list[float]) -> torch.Tensor:
    """Logits whose log_softmax is log(probs): one row per live beam."""
    return torch.log(torch.tensor(probs))


# Width 2, EOS 5, max_tokens 3, a vocabulary of 6: the next-token probabilities of each live beam, step by step.
STEPS = [logits([0.04, 0.4, 0.3, 0.06, 0.05, 0.15]),
         logits([0.02, 0.03, 0.04, 0.25, 0.16, 0.5], [0.21, 0.2, 0.19, 0.18, 0.12, 0.10]),
         logits([0.5, 0.2, 0.1, 0.1, 0.05, 0.05], [0.05, 0.05, 0.05, 0.05, 0.1, 0.7])]


def test_step_plan_and_scores():
    """Width 2, EOS 5, max_tokens 3, vocabulary 6: k = 4 candidates a step."""
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=3), [EOS])
    assert search.num_candidates == 4
    # Step 1, the prompt's row. Candidates: 1 (.4), 2 (.3), EOS (.15), 3 (.06). The EOS ranks 3rd, below the
    # width: a spare, dropped. Both children come from the one parent: the second is a fork.
    out = search.step(STEPS[0])
    assert [(c.parent, c.token_id, c.is_fork) for c in out.children] == [(0, 1, False), (0, 2, True)]
    assert out.children[1].cumulative_logprob == pytest.approx(math.log(0.3))
    assert (out.finished, out.dropped, out.done, search.hypotheses) == ([], [], False, [])
    # Step 2. Beam 0 ([1], .4): EOS .2, 3 .1, 4 .064; beam 1 ([2], .3): at most .063. The EOS ranks first: a
    # hypothesis of length 2. Beam 0 has both children (one forked), beam 1 none: it is dropped.
    out = search.step(STEPS[1])
    assert [(c.parent, c.token_id, c.is_fork) for c in out.children] == [(0, 3, False), (0, 4, True)]
    assert out.finished == [Candidate(0, EOS, pytest.approx(math.log(0.2)))]
    assert (out.dropped, out.done) == ([1], False)
    assert [b.token_ids for b in search.beams] == [[1, 3], [1, 4]]
    assert search.hypotheses == [Hypothesis([1, EOS], pytest.approx(math.log(0.2)),
                                            pytest.approx(math.log(0.2) / 2), "stop")]
    # Step 3 reaches max_tokens: every candidate is finished, the best two (.05 and the EOS's .0448) are
    # hypotheses. With length_penalty 1, [1, 5] (-0.80) and [1, 3, 0] (-1.00) beat [1, 4, 5] (-1.04).
    out = search.step(STEPS[2])
    assert (out.children, out.dropped, out.done, search.beams) == ([], [0, 1], True, [])
    assert out.finished == [Candidate(0, 0, pytest.approx(math.log(0.05)))]
    assert [(h.token_ids, h.finish_reason) for h in search.hypotheses] == [([1, EOS], "stop"), ([1, 3, 0], "length")]
    assert search.hypotheses[1].score == pytest.approx(math.log(0.05) / 3)
    with pytest.raises(RuntimeError, match="done"):
        search.step(logits([0.5, 0.5]))


def test_length_penalty_reorders():
    """The same steps with length_penalty 2: longer hypotheses score higher, [1, 5] falls out."""
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=2.0), [EOS])
    search.step(STEPS[0])
    search.step(STEPS[1])
    out = search.step(STEPS[2])
    assert [h.token_ids for h in search.hypotheses] == [[1, 3, 0], [1, 4, EOS]]
    assert [h.score for h in search.hypotheses] == pytest.approx([math.log(0.05) / 9, math.log(0.0448) / 9])
    assert out.finished == [Candidate(0, 0, pytest.approx(math.log(0.05))),
                            Candidate(1, EOS, pytest.approx(math.log(0.0448)))]


def run_steps(early_stopping, length_penalty: float, steps: list[torch.Tensor], max_tokens: int) -> list[bool]:
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=max_tokens, length_penalty=length_penalty,
                                         early_stopping=early_stopping), [EOS])
    return [search.step(row).done for row in steps]


def test_early_stopping_true_versus_false():
    """After step 2 two hypotheses are held: [5] (-1.20) and [2, 5] (-1.13), and the best live beam [1, 0] scores
    ln .2 / 2 = -0.80 at its length. True stops; False goes on, since that beam could still beat -1.20."""
    steps = [logits([0.04, 0.4, 0.15, 0.06, 0.05, 0.3]),
             logits([0.5, 0.2, 0.1, 0.1, 0.05, 0.05], [0.05, 0.05, 0.05, 0.05, 0.1, 0.7])]
    assert run_steps(True, 1.0, steps, max_tokens=4) == [False, True]
    assert run_steps(False, 1.0, steps, max_tokens=4) == [False, False]


def test_early_stopping_never():
    """After step 2 the hypotheses are [1, 5] (ln .2 / 2) and [2, 5] (ln .18 / 2); the best live beam, [1, 0] at
    ln .052, cannot beat them at its length 2 (False stops), but could at max_tokens 4 ("never" goes on)."""
    steps = [logits([0.04, 0.4, 0.3, 0.06, 0.05, 0.15]),
             logits([0.13, 0.12, 0.11, 0.1, 0.04, 0.5], [0.14, 0.09, 0.08, 0.07, 0.02, 0.6])]
    assert run_steps(False, 1.0, steps, max_tokens=4) == [False, True]
    assert run_steps("never", 1.0, steps, max_tokens=4) == [False, False]
    assert run_steps("never", 0.0, steps, max_tokens=4) == [False, True]  # no penalty: length can't help


def test_ignore_eos_and_candidate_count():
    row = logits([0.04, 0.3, 0.15, 0.06, 0.05, 0.4])  # EOS is the best token
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=4), [EOS])
    out = search.step(row)
    assert [c.token_id for c in out.children] == [1, 2] and [h.token_ids for h in search.hypotheses] == [[EOS]]
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True), [EOS])
    out = search.step(row)
    assert [c.token_id for c in out.children] == [EOS, 1] and search.hypotheses == []
    assert search.num_candidates == 4
    assert BeamSearch(BeamSearchParams(beam_width=2, max_tokens=4), [EOS, 4]).num_candidates == 6


def test_temperature_scales_logits():
    row = torch.tensor([[1.0, 2.0, 4.0]])
    for temperature, divisor in ((0.0, 1.0), (1.0, 1.0), (0.5, 0.5), (3, 3.0)):
        search = BeamSearch(BeamSearchParams(beam_width=1, max_tokens=1, temperature=temperature), [])
        assert torch.equal(search.logprobs(row), torch.log_softmax(row / divisor, dim=-1))


def test_step_errors():
    search = BeamSearch(BeamSearchParams(beam_width=4, max_tokens=4), [EOS])
    with pytest.raises(ValueError, match="more than the 6 tokens"):
        search.step(torch.zeros(1, 6))  # 8 candidates from one row of 6
    with pytest.raises(ValueError, match="2 rows for 1 live beams"):
        search.step(torch.zeros(2, 64))


def test_beam_child_is_a_candidate():
    child = BeamChild(0, 7, -1.5, is_fork=True)
    assert isinstance(child, Candidate) and child.is_fork


# ---- BeamSearchParams: bad values are a ValueError naming the field --------------------------------------------
BAD = [("beam_width", v) for v in (0, -1, 1.5, True, "2", None)] + \
      [("max_tokens", v) for v in (0, -3, 2.0, False, "8")] + \
      [("ignore_eos", v) for v in (1, "yes", None)] + \
      [("temperature", v) for v in (-0.1, math.nan, math.inf, "1", True, None)] + \
      [("length_penalty", v) for v in (math.nan, math.inf, -math.inf, "1", None, False)] + \
      [("early_stopping", v) for v in ("always", 1, 0, None, "Never")]


@pytest.mark.parametrize("field,value", BAD)
def test_params_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 8, field: value})


def test_params_accepted():
    params = BeamSearchParams(beam_width=1, max_tokens=1, temperature=1, length_penalty=-1.0, early_stopping="never")
    assert (params.ignore_eos, params.temperature, params.early_stopping) == (False, 1, "never")
    assert BeamSearchParams(beam_width=3, max_tokens=5).early_stopping is False


# ---- the block books: the step's plan acted out on the BlockManager, as the engine will --------------------------
def act_out(bm: BlockManager, seqs: list[Sequence], out: BeamStepOutput,
            seq_ids) -> tuple[list[Sequence], list[tuple[int, int]]]:
    """Free the dropped beams; the first child of a parent takes over its sequence, the others fork from it
    (shared blocks) before anyone appends; then each appends its token and reserves its slot, copying the last
    block when it is shared (copy-on-write). Returns the new live sequences and the blocks to copy."""
    for i in out.dropped:
        bm.deallocate(seqs[i])
    children = []
    for child in out.children:
        parent = seqs[child.parent]
        if child.is_fork:
            fork = Sequence(next(seq_ids), parent.token_ids, parent.sampling_params, BS)
            bm.fork(parent, fork)
            children.append(fork)
        else:
            children.append(parent)
    copies = []
    for seq, child in zip(children, out.children):
        seq.append_token(child.token_id)
        assert bm.num_new_blocks(seq) <= bm.num_free_blocks
        copies += bm.may_append(seq)
    return children, copies


def test_block_books():
    """The hand-made steps on a prompt of 6 tokens in blocks of 4 (docs/beam_search.md draws this table)."""
    bm = BlockManager(8, BS)
    prompt = Sequence(0, list(range(10, 16)), SamplingParams(), BS)
    assert bm.allocate(prompt)
    search, seqs, seq_ids = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=3), [EOS]), [prompt], count(1)
    books = []
    for row in STEPS:
        seqs, copies = act_out(bm, seqs, search.step(row), seq_ids)
        books.append(([list(s.block_table) for s in seqs], [b.ref_count for b in bm.blocks], copies))
        for block in bm.blocks:  # every ref count is the number of block tables that hold the block
            assert block.ref_count == sum(s.block_table.count(block.block_id) for s in seqs)
    assert books == [
        ([[0, 2], [0, 1]], [2, 1, 1, 0, 0, 0, 0, 0], [(1, 2)]),  # a fork: block 0 shared, block 1 copied (CoW)
        ([[0, 3], [0, 2]], [2, 0, 1, 1, 0, 0, 0, 0], [(2, 3)]),  # beam [2] dropped (block 1 freed), [1] forked
        ([], [0] * 8, []),  # max_tokens: all beams finished, every block free
    ]
