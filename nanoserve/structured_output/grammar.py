"""Structured outputs at the token level, with xgrammar (the library vLLM uses by default).

A spec (`StructuredOutputsParams`) becomes a grammar; `GrammarCompiler` compiles it once against the
vocabulary (for every parser state, which tokens can follow: the expensive part) and caches it by
spec. Each sequence then drives its own `GrammarMatcher`: before a step, `fill_bitmask` writes the
tokens the grammar allows next into the sequence's row of a bitmask (one bit per vocabulary token),
`apply_bitmask` sets every other logit to -inf, and after sampling, `accept` advances the matcher by
the sampled token. Once the grammar is complete it allows only the stop tokens; accepting one
terminates the matcher. Speculative decoding: `valid_drafts` cuts a request's drafts to what the
grammar allows, and `fill_bitmask` fills a row per drafted position by accepting the drafts and
rolling them back (`rollback` undoes accepted tokens); after verification only the emitted tokens
are accepted.
"""
from collections import OrderedDict
from collections.abc import Sequence

import torch
import xgrammar as xgr

from nanoserve.structured_outputs import StructuredOutputsParams


class GrammarCompiler:
    """Compiles specs into xgrammar's CompiledGrammar for one tokenizer, each distinct spec once (an
    LRU cache: requests of an application mostly repeat a few schemas). Specs are validated when
    they are made, so compiling does not fail; it takes milliseconds (large schemas: more), so it
    belongs off the step path."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None,
                 any_whitespace: bool = False, max_cached: int = 256):
        # vocab_size: the model's (its logits' width), which may exceed the tokenizer's.
        # stop_token_ids: the tokens that end a completed grammar (default: the tokenizer's EOS).
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids)
        self.vocab_size = vocab_size
        # our cache below, keyed by the spec
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        # JSON with free whitespace lets a small model emit newlines forever; compact JSON cannot
        # loop there.
        self.any_whitespace = any_whitespace
        self.cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self.max_cached = max_cached
        self.num_compiled = 0  # cache misses

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        key = params.grammar_source()
        compiled = self.cache.pop(key, None)
        if compiled is None:
            compiled = self._compile(*key)
            self.num_compiled += 1
        self.cache[key] = compiled  # the most recently used last
        if len(self.cache) > self.max_cached:
            self.cache.popitem(last=False)
        return compiled

    def _compile(self, kind: str, source: str) -> xgr.CompiledGrammar:
        if kind == "json":
            return self.compiler.compile_json_schema(source, any_whitespace=self.any_whitespace)
        if kind == "json_object":
            # an object (xgrammar's builtin JSON grammar would allow any value)
            return self.compiler.compile_json_schema('{"type": "object"}',
                                                     any_whitespace=self.any_whitespace)
        if kind == "regex":
            return self.compiler.compile_regex(source)
        return self.compiler.compile_grammar(source)

    def matcher(self, params: StructuredOutputsParams) -> "GrammarMatcher":
        """A fresh matcher for one sequence (with n > 1, one per sequence: they sample different
        tokens)."""
        return GrammarMatcher(self.compile(params))


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar):
        self.matcher = xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int,
                     draft_token_ids: Sequence[int] = ()) -> None:
        """Write the tokens allowed next into bitmask[row] (a CPU tensor from `allocate_bitmask`).
        With k draft tokens (speculative decoding, from `valid_drafts`), rows row .. row + k: those
        allowed after each prefix of the drafts, one row per position the target verifies; the
        matcher is left where it was."""
        for j, token_id in enumerate(draft_token_ids):
            self.matcher.fill_next_token_bitmask(bitmask, row + j)
            self.matcher.accept_token(token_id)
        self.matcher.fill_next_token_bitmask(bitmask, row + len(draft_token_ids))
        self.rollback(len(draft_token_ids))

    def valid_drafts(self, draft_token_ids: list[int]) -> list[int]:
        """The drafts cut before the first one the grammar refuses, or one that would complete it
        (the stop token is left to the target: nothing may follow it, not even a mask); the matcher
        is left where it was."""
        num_valid = 0
        for token_id in draft_token_ids:
            if not self.accept(token_id):
                break
            if self.is_terminated():
                self.rollback(1)
                break
            num_valid += 1
        self.rollback(num_valid)
        return draft_token_ids[:num_valid]

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) if the grammar does not allow it there."""
        return self.matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: the sequence is done."""
        return self.matcher.is_terminated()


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [num_rows, ceil(vocab_size / 32)], all ones (everything allowed): bit t % 32 of word
    t // 32 is token t."""
    return xgr.allocate_token_bitmask(num_rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                  rows: list[int] | None = None) -> None:
    """In place: logits[r, t] = -inf where bit t of bitmask[r] is 0, for r in rows (None: every
    row); the other rows (requests without a grammar) stay as they are. Before temperature,
    top-k/top-p and greedy, so every sampler picks among the allowed tokens only."""
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    vocab_size=logits.shape[-1], indices=rows)
