"""Structured outputs in the engine (vLLM's StructuredOutputManager), switched on by
enable_structured_outputs=True: each request's grammar constrains what its sequences may sample.

The chapter is three subclasses of the core's, which do nothing without its config:
1. `StructuredOutputsEngineCore.add`: the request's spec is compiled (once per distinct spec:
   grammar.py caches it), before it is queued, and each of its n sequences gets a matcher of its
   own, kept by the manager by seq id: preemption, by recompute or swap, leaves it as it is.
2. The manager's `prepare` and `apply` (a logits processor, vLLM's interface, on the input
   builder): each constrained row of the step's bitmask gets the tokens its matcher allows next, and
   the sampler sets the others to -inf. With k draft tokens (speculative decoding; the proposer cut
   them to what the grammar allows) a request has 1 + k rows, one mask per drafted position: its
   matcher fills them walking through the drafts, then rolls back.
3. `StructuredOutputsEngineCore._output`: each emitted token (1 + the accepted drafts, with
   speculative decoding) advances its sequence's matcher; the rejected drafts were never accepted. A
   grammar that has accepted its stop token is complete, and the sequence finishes with
   finish_reason "stop".
With async scheduling a sequence with a grammar sits out the step planned before its newest token is
known (`StructuredOutputsScheduler.needs_newest_token`): its next mask depends on it. xgrammar is
imported only here (an optional extra).
"""
import torch

from nanoserve.config import Config, has_tokenizer
from nanoserve.engine.core import EngineCore
from nanoserve.engine.output_processor import EngineCoreOutput
from nanoserve.engine.sequence import Request, Sequence
from nanoserve.scheduling.async_scheduling import AsyncScheduler


class StructuredOutputManager:
    """The grammars' compiler, and each constrained sequence's matcher, by seq id."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        from nanoserve.structured_output.grammar import GrammarCompiler  # (xgrammar: an extra)

        # the model's logits' width (may exceed the tokenizer's: those never pass); EOS ends a
        # complete grammar
        self.vocab_size = vocab_size
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids=eos_token_ids)
        self.matchers: dict[int, object] = {}

    def grammar(self, seq: Sequence):
        """seq's matcher, or None: its request has no grammar."""
        return self.matchers.get(seq.seq_id)

    def add_request(self, request: Request) -> None:
        """Compile the request's spec (a cache hit for a spec seen before) and give each sequence a
        matcher. (Forks of n > 1 split off before any token is accepted, so a fresh matcher is the
        parent's state.)"""
        for seq in request.seqs:
            self.matchers[seq.seq_id] = self.compiler.matcher(
                request.sampling_params.structured_outputs)

    def prepare(self, rows: list[tuple[Sequence, int]]) -> torch.Tensor | None:
        """int32 [len(rows), ceil(vocab_size / 32)], bit t of row i set if rows[i] may sample token
        t next (all set for a sequence without a grammar); None when no row has one. A sequence with
        k drafts has 1 + k rows."""
        if not self.matchers or all(seq.seq_id not in self.matchers for seq, _ in rows):
            return None
        from nanoserve.structured_output.grammar import allocate_bitmask

        bitmask = allocate_bitmask(len(rows), self.vocab_size)
        for row, (seq, j) in enumerate(rows):
            grammar = self.grammar(seq)
            if grammar is not None and j == 0:  # its first row: the matcher fills all 1 + k
                grammar.fill_bitmask(bitmask, row, seq.spec_token_ids)
        return bitmask

    @staticmethod
    def apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """Rule out what the grammar does not allow: column t is bit t % 32 of word t // 32."""
        bitmask = bitmask.to(logits.device, non_blocking=True)
        bits = bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = (bits & 1).flatten(1)[:, : logits.shape[1]].bool()
        return logits.masked_fill(~allowed, float("-inf"))

    def advance(self, seq: Sequence, num_new: int) -> bool:
        """seq's num_new newest tokens advance its matcher; True once the grammar is complete."""
        grammar = self.matchers[seq.seq_id]
        for token_id in seq.token_ids[len(seq.token_ids) - num_new :]:
            if not grammar.accept(token_id):  # the masks allowed only what the grammar accepts
                raise RuntimeError(f"request {seq.request_id}: token {token_id} broke its grammar")
        return grammar.is_terminated()


class StructuredOutputsScheduler(AsyncScheduler):
    """With async scheduling, a sequence with a grammar waits for its newest token: its next mask
    depends on it."""

    structured_output_manager: StructuredOutputManager | None = None

    def needs_newest_token(self, seq: Sequence) -> bool:
        manager = self.structured_output_manager
        return (manager is not None and seq.seq_id in manager.matchers
                or super().needs_newest_token(seq))


class StructuredOutputsEngineCore(EngineCore):
    """Compiles each structured request's grammar as it is queued, and advances its sequences'
    matchers with their new tokens."""

    scheduler: StructuredOutputsScheduler

    def __init__(self, config: Config, *args, **kwargs):
        if config.structured_outputs_config is not None and not has_tokenizer(config.model):
            raise ValueError("enable_structured_outputs: this model folder has no tokenizer "
                             "to build the grammar's mask")
        super().__init__(config, *args, **kwargs)
        self.structured_output_manager = None
        if config.structured_outputs_config is not None:
            self.structured_output_manager = manager = StructuredOutputManager(
                self.tokenizer, config.hf_config.vocab_size, config.eos_token_ids)
            self.input_builder.logits_processors.append(manager)
            self.scheduler.structured_output_manager = manager

    def check_option(self, name: str, value: object) -> None:
        # (SamplingParams checked the spec; it compiles as the request is queued)
        if name != "structured_outputs" or self.structured_output_manager is None:
            super().check_option(name, value)

    def add(self, request: Request) -> None:
        if request.sampling_params.structured_outputs is not None:  # (off the step path)
            self.structured_output_manager.add_request(request)
        super().add(request)

    def _output(self, request: Request, seq: Sequence, num_new: int) -> EngineCoreOutput:
        """seq's new tokens advance its matcher first: a complete grammar finishes seq (through the
        scheduler, which frees its blocks)."""
        manager = self.structured_output_manager
        if manager is not None and seq.seq_id in manager.matchers:
            if manager.advance(seq, num_new) and not seq.is_finished:  # (e.g. with ignore_eos)
                self.scheduler.finish(seq)
                seq.finish_reason = "stop"
            if seq.is_finished:
                del manager.matchers[seq.seq_id]
        return super()._output(request, seq, num_new)

    def abort_request(self, request_id: str) -> bool:
        if self.structured_output_manager is not None and request_id in self.requests:
            for seq in self.requests[request_id].seqs:
                self.structured_output_manager.matchers.pop(seq.seq_id, None)
        return super().abort_request(request_id)
