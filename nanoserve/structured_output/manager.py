"""Structured outputs in the engine (vLLM's StructuredOutputManager): the three seams a grammar uses.

It plugs in when the engine is built with enable_structured_outputs=True (nanoserve/chapters.py):
1. `add_request` (the request_options seam): the request's spec is compiled (once per distinct spec:
   grammar.py caches it), off the step path, and each of its n sequences gets a matcher of its own
   (`seq.grammar`), which lives on the sequence: preemption, by recompute or swap, leaves it as it is.
2. `prepare` and `apply` (a logits processor): each constrained row of the step's bitmask gets the tokens its
   matcher allows next, and the sampler sets the others to -inf. With k draft tokens (speculative decoding; the
   proposer cut them to what the grammar allows) a request has 1 + k rows, one mask per drafted position: its
   matcher fills them walking through the drafts, then rolls back.
3. `advance` (the after_step seam): each emitted token (1 + the accepted drafts, with speculative decoding)
   advances its sequence's matcher; the rejected drafts were never accepted. A grammar that has accepted its stop
   token is complete, and the sequence finishes with finish_reason "stop".
With async scheduling a sequence with a grammar sits out the step planned before its newest token is known
(needs_newest_token): its next mask depends on it. xgrammar is imported only here (an optional extra).
"""
import torch

from nanoserve.engine.core import EngineCore
from nanoserve.engine.output_processor import EngineCoreOutput
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.engine.sequence import Request, Sequence
from nanoserve.structured_output.grammar import GrammarCompiler, allocate_bitmask


def has_grammar(seq: Sequence) -> bool:
    return seq.grammar is not None


class StructuredOutputManager:
    def __init__(self, engine: EngineCore):
        if engine.tokenizer is None:
            raise ValueError("enable_structured_outputs: this model folder has no tokenizer "
                             "to build the grammar's mask")
        self.scheduler = engine.scheduler
        # the model's logits' width (may exceed the tokenizer's: those never pass); EOS ends a complete grammar
        self.vocab_size = engine.config.hf_config.vocab_size
        self.compiler = GrammarCompiler(engine.tokenizer, self.vocab_size, stop_token_ids=engine.config.eos_token_ids)

    @classmethod
    def plug_in(cls, engine: EngineCore) -> "StructuredOutputManager":
        engine.seams.features["structured_outputs"] = manager = cls(engine)
        engine.seams.logits_processors.append(manager)
        engine.seams.after_step.insert(0, manager.advance)  # first: the drafts proposed after it must fit the grammar
        engine.seams.needs_newest_token.append(has_grammar)
        return manager

    def add_request(self, request: Request) -> None:
        """Compile the request's spec (a cache hit for a spec seen before) and give each sequence a matcher.
        (Forks of n > 1 split off before any token is accepted, so a fresh matcher is the parent's state.)"""
        for seq in request.seqs:
            seq.grammar = self.compiler.matcher(request.sampling_params.structured_outputs)

    def prepare(self, rows: list[tuple[Sequence, int]]) -> torch.Tensor | None:
        """int32 [len(rows), ceil(vocab_size / 32)], bit t of row i set if rows[i] may sample token t next (all set
        for a sequence without a grammar); None when no row has one. A sequence with k drafts has 1 + k rows."""
        if all(seq.grammar is None for seq, _ in rows):
            return None
        bitmask = allocate_bitmask(len(rows), self.vocab_size)
        for row, (seq, j) in enumerate(rows):
            if seq.grammar is not None and j == 0:  # its first row: the matcher fills all 1 + k
                seq.grammar.fill_bitmask(bitmask, row, seq.spec_token_ids)
        return bitmask

    @staticmethod
    def apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """Rule out what the grammar does not allow: column t is bit t % 32 of word t // 32."""
        bitmask = bitmask.to(logits.device, non_blocking=True)
        bits = bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = (bits & 1).flatten(1)[:, : logits.shape[1]].bool()
        return logits.masked_fill(~allowed, float("-inf"))

    def advance(self, out: SchedulerOutput, updated: dict[Sequence, int]) -> list[EngineCoreOutput]:
        """Each sequence's num_new newest tokens (updated: seq -> num_new) advance its matcher; a complete grammar
        finishes the sequence (through the scheduler, which frees its blocks)."""
        for seq, num_new in updated.items():
            if seq.grammar is None:
                continue
            for token_id in seq.token_ids[len(seq.token_ids) - num_new :]:
                if not seq.grammar.accept(token_id):  # the masks allowed only what the grammar accepts
                    raise RuntimeError(f"request {seq.request_id}: token {token_id} broke its grammar")
            if seq.grammar.is_terminated() and not seq.is_finished:  # (e.g. with ignore_eos)
                self.scheduler.finish(seq)
                seq.finish_reason = "stop"
        return []
