"""Structured outputs in the engine (vLLM's StructuredOutputManager): the three places a grammar touches a step.

1. `add_request`: the request's spec is compiled (once per distinct spec: engine/grammar.py caches it), off the
   step path, and each of its n sequences gets a matcher of its own (`seq.grammar`), which lives on the sequence:
   preemption, by recompute or swap, leaves it as it is.
2. `grammar_bitmask` (the InputBuilder calls it): each constrained row of the step's bitmask gets the tokens its
   matcher allows next; the sampler (layers/sampler.py `rule_out`) sets the others to -inf. With k draft tokens
   (speculative decoding; the proposer cut them to what the grammar allows) a request has 1 + k rows, one mask per
   drafted position: its matcher fills them walking through the drafts, then rolls back.
3. `advance` (after the step): each emitted token (1 + the accepted drafts, with speculative decoding) advances
   its sequence's matcher; the rejected drafts were never accepted. A grammar that has accepted its stop token is
   complete, and the sequence finishes with finish_reason "stop".

xgrammar is imported only when a request asks for structured outputs (it is an optional extra).
"""
from collections.abc import Callable

import torch

from nanoserve.engine.request import Request
from nanoserve.engine.sequence import Sequence


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits' width (may exceed the tokenizer's: those never pass)
        self.eos_token_ids = eos_token_ids  # what ends a complete grammar
        self.compiler = None  # a GrammarCompiler, built for the first structured request

    def add_request(self, request: Request) -> None:
        """Compile the request's spec (a cache hit for a spec seen before) and give each sequence a matcher.
        (Forks of n > 1 split off before any token is accepted, so a fresh matcher is the parent's state.)"""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        if self.tokenizer is None:
            raise ValueError("structured_outputs: this model folder has no tokenizer to build the grammar's mask")
        if self.compiler is None:
            from nanoserve.engine.grammar import GrammarCompiler
            self.compiler = GrammarCompiler(self.tokenizer, self.vocab_size, stop_token_ids=self.eos_token_ids)
        for seq in request.seqs:
            seq.grammar = self.compiler.matcher(params)

    def advance(self, updated: dict[Sequence, int], finish: Callable[[Sequence], None]) -> None:
        """Each sequence's num_new newest tokens (updated: seq -> num_new) advance its matcher; a complete grammar
        finishes the sequence (finish: the scheduler's, which frees its blocks)."""
        for seq, num_new in updated.items():
            if seq.grammar is None:
                continue
            for token_id in seq.token_ids[len(seq.token_ids) - num_new :]:
                if not seq.grammar.accept(token_id):  # the masks allowed only what the grammar accepts
                    raise RuntimeError(f"request {seq.request_id}: token {token_id} broke its grammar")
            if seq.grammar.is_terminated() and not seq.is_finished:  # (e.g. with ignore_eos)
                finish(seq)
                seq.finish_reason = "stop"


def grammar_bitmask(seqs: list[Sequence], vocab_size: int) -> torch.Tensor | None:
    """int32 [len(seqs), ceil(vocab_size / 32)], bit t of row i set if seqs[i] may sample token t next (all set
    for a sequence without a grammar); None when no sequence has one. seqs: the sampling rows, where a sequence
    with k drafts has 1 + k consecutive rows (spec_decode/accounting.py `draft_rows`)."""
    if all(seq.grammar is None for seq in seqs):
        return None
    from nanoserve.engine.grammar import allocate_bitmask
    bitmask, row = allocate_bitmask(len(seqs), vocab_size), 0
    while row < len(seqs):
        seq = seqs[row]
        if seq.grammar is not None:
            seq.grammar.fill_bitmask(bitmask, row, seq.spec_token_ids)
        row += 1 + len(seq.spec_token_ids)
    return bitmask


def waits_for_grammar(group: list[Sequence]) -> bool:
    """Async scheduling: a sequence whose newest token is still being sampled cannot have its next mask yet, so
    its request sits this planned step out (and runs in the one after)."""
    return any(seq.grammar is not None and seq.num_output_placeholders > 0 for seq in group)
