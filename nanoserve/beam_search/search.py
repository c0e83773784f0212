"""Beam search, one token at a time, with the rules of transformers' generate(num_beams=...).

The search knows nothing of the model or the KV cache. Each step the engine hands it the next-token
logits of the live beams, and it answers who goes on from whom: `BeamStepOutput.children` (a parent
with several children is forked, its blocks shared), `dropped` (parents with no child: their blocks
are freed) and the candidates that finished. docs/beam_search.md tells how the engine turns that
into BlockManager.fork / free / copy-on-write.

The rules, as transformers 5 runs them (generation/utils.py, `_beam_search`), each followed here:
- Scores are log_softmax of the raw logits (greedy beam search applies no temperature).
  temperature > 0 scores with log_softmax(logits / temperature) instead, vLLM V0's meaning (its
  logprobs came after temperature).
- Candidates: the k = max(2, 1 + number of EOS ids) * beam_width best (beam, token) continuations by
  cumulative log-probability, over all live beams at once. More than beam_width, so that beam_width
  candidates that do not end in EOS remain to go on with even when the best ones all do.
- A candidate that ends in EOS (unless ignore_eos), or that reaches max_tokens, is finished. Only
  one ranked among the best beam_width candidates becomes a hypothesis; a finished one ranked lower
  was a spare and is dropped.
- The next live beams are the best beam_width unfinished candidates, in rank order (the best first).
- A hypothesis scores cumulative_logprob / length ** length_penalty, where length counts the
  generated tokens, the EOS included and the prompt not. (vLLM's own beam search counts the prompt
  and leaves the EOS out.) The beam_width best hypotheses are kept, and returned best first.
- The search ends when no candidate is left unfinished (all reached max_tokens), or once beam_width
  hypotheses are held: at once with early_stopping=True; otherwise when the best live beam, scored
  at its current length (at max_tokens for early_stopping="never" with length_penalty > 0, as longer
  then scores higher), would not beat the worst hypothesis. With length_penalty > 0 that is
  transformers' heuristic, not a proof.
- The first step has one live beam, the prompt. transformers starts beam_width copies of it, all but
  the first at -1e9, which picks the same candidates as long as the vocabulary holds k tokens (else
  a ValueError here).
- beam_width 1: generate runs greedy search, which stops at the first EOS whatever length_penalty
  and early_stopping say; here that is early_stopping=True.
The arithmetic is transformers' too (float32 cumulative log-probabilities, torch.topk over the
flattened (beam, token) scores, the penalty divided in float32), so that near-ties fall the same
way.
"""
from dataclasses import dataclass

import torch

from nanoserve.beam_search_params import BeamSearchParams


@dataclass
class Beam:
    """A live beam: the tokens generated so far (no prompt) and the sum of their
    log-probabilities."""

    token_ids: list[int]
    cumulative_logprob: float


@dataclass
class Hypothesis:
    """A finished beam, with its length-penalised score."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str  # "stop": it ends in EOS; "length": it reached max_tokens


@dataclass
class Candidate:
    """A continuation: live beam `parent` (its index in the beams passed to step) followed by
    token_id."""

    parent: int
    token_id: int
    cumulative_logprob: float


@dataclass
class BeamChild(Candidate):
    # False for the first child of its parent: it takes over the parent's sequence (blocks and all)
    # in place. True for the others: each needs a sequence of its own, forked from the parent before
    # anyone appends.
    is_fork: bool = False


@dataclass
class BeamStepOutput:
    children: list[BeamChild]  # the live beams of the next step, in order; empty once done
    finished: list[Candidate]  # candidates that joined the hypotheses this step
    dropped: list[int]  # parents without a child (all of them once done): free their blocks
    done: bool


def penalised_score(cumulative_logprob: torch.Tensor, length: int,
                    length_penalty: float) -> torch.Tensor:
    """transformers' score: a float32 tensor divided by a Python float, computed as it does."""
    return cumulative_logprob / (length**length_penalty)


class BeamSearch:
    """One request's beam search: its live beams (best first) and its finished hypotheses (best
    first)."""

    def __init__(self, params: BeamSearchParams, eos_token_ids: list[int]):
        self.params = params
        self.eos_token_ids = [] if params.ignore_eos else list(eos_token_ids)
        # Spares: even if every beam's best continuation is an EOS, beam_width others are left to go
        # on with.
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * params.beam_width
        # generate(num_beams=1) is greedy search: it stops at the first EOS, as early_stopping=True
        # does here.
        self.early_stopping = True if params.beam_width == 1 else params.early_stopping
        self.beams = [Beam(token_ids=[], cumulative_logprob=0.0)]
        self.hypotheses: list[Hypothesis] = []
        self.done = False

    def logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """The log-probabilities a beam is scored with, from its raw next-token logits."""
        logits = logits.float()
        temperature = self.params.temperature
        return torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)

    def step(self, logits: torch.Tensor) -> BeamStepOutput:
        """Grow the beams by one token. logits: (len(self.beams), vocab_size), the live beams'
        next-token logits, in order."""
        if self.done:
            raise RuntimeError("step() after the beam search is done")
        num_live, vocab_size = logits.shape
        if num_live != len(self.beams):
            raise ValueError(f"logits has {num_live} rows for {len(self.beams)} live beams")
        if self.num_candidates > num_live * vocab_size:
            raise ValueError(f"beam_width={self.params.beam_width} needs {self.num_candidates} "
                             f"candidates, more than the {vocab_size} tokens of the vocabulary")
        width, max_tokens = self.params.beam_width, self.params.max_tokens
        cumulative = torch.tensor([b.cumulative_logprob for b in self.beams], dtype=torch.float32,
                                  device=logits.device)
        totals = (self.logprobs(logits) + cumulative[:, None]).flatten()
        top_logprobs, top_indices = torch.topk(totals, self.num_candidates)
        # generated tokens after this step, the same for every beam
        length = len(self.beams[0].token_ids) + 1
        scores = penalised_score(top_logprobs, length, self.params.length_penalty)

        children: list[BeamChild] = []
        joined: list[tuple[Candidate, Hypothesis]] = []
        for rank, (index, logprob, score) in enumerate(zip(top_indices.tolist(),
                                                           top_logprobs.tolist(), scores.tolist())):
            parent, token_id = divmod(index, vocab_size)
            stop = token_id in self.eos_token_ids
            if stop or length == max_tokens:
                if rank < width:  # a finished spare is dropped: only the best beam_width may finish
                    hypothesis = Hypothesis(token_ids=self.beams[parent].token_ids + [token_id],
                                            cumulative_logprob=logprob, score=score,
                                            finish_reason="stop" if stop else "length")
                    joined.append((Candidate(parent, token_id, logprob), hypothesis))
            elif len(children) < width:
                is_fork = any(c.parent == parent for c in children)
                children.append(BeamChild(parent, token_id, logprob, is_fork=is_fork))

        # Stable sort: on an exact tie the older hypothesis stays ahead.
        self.hypotheses = sorted(self.hypotheses + [h for _, h in joined], key=lambda h: h.score,
                                 reverse=True)[:width]
        finished = [c for c, h in joined if any(h is kept for kept in self.hypotheses)]
        self.beams = [Beam(token_ids=self.beams[c.parent].token_ids + [c.token_id],
                           cumulative_logprob=c.cumulative_logprob) for c in children]
        self.done = not children or self._is_done(length)
        if self.done:
            children, self.beams = [], []
        survivors = {c.parent for c in children}
        dropped = [i for i in range(num_live) if i not in survivors]
        return BeamStepOutput(children=children, finished=finished, dropped=dropped, done=self.done)

    def _is_done(self, length: int) -> bool:
        """With beam_width hypotheses held: stop now (early_stopping=True), or when the best live
        beam could not beat the worst hypothesis, scored at its current length or, for "never" with
        a positive penalty, at max_tokens (transformers' _check_early_stop_heuristic)."""
        if len(self.hypotheses) < self.params.beam_width:
            return False
        if self.early_stopping is True:
            return True
        penalty = self.params.length_penalty
        at_max_tokens = self.early_stopping == "never" and penalty > 0
        best_length = self.params.max_tokens if at_max_tokens else length
        best = torch.tensor(self.beams[0].cumulative_logprob, dtype=torch.float32)
        return not penalised_score(best, best_length, penalty).item() > self.hypotheses[-1].score
