"""Speculative decoding's options, as vLLM spells them: `LLM(..., speculative_config={...})`.

A leaf module (no torch, no transformers), like sampling_params.py, so that config.py can import it.
"""
from dataclasses import dataclass, field

from nanoserve.utils.records import record_from_dict

METHODS = ("ngram", "draft_model")
# Most draft tokens verified per request per step (vLLM's rejection sampler has the same cap): a
# step computes 1 + k tokens per request, and past a few the chance that all are accepted is tiny.
MAX_SPEC_LEN = 32


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    """An int (not a bool, not a float such as 3.0 or NaN) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative_config.{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"speculative_config.{name} must be {bounds}, got {value}")


@dataclass
class SpeculativeConfig:
    """How to guess tokens ahead. "ngram" (prompt lookup): the request's own tokens propose what
    followed the latest n-gram earlier on. "draft_model": a smaller model with the same tokenizer
    runs k cheap steps."""

    # "ngram" or "draft_model"; None with a `model` given means "draft_model"
    method: str | None = None
    # k: draft tokens proposed and verified per request per step
    num_speculative_tokens: int | None = None
    model: str | None = None  # draft_model: the draft model's folder or hub name
    # ngram: shortest suffix matched (None: prompt_lookup_max, or 5)
    prompt_lookup_min: int | None = None
    # ngram: longest suffix matched (None: prompt_lookup_min, or 5)
    prompt_lookup_max: int | None = None
    # no speculation in a step with more running requests than this
    disable_by_batch_size: int | None = None

    @classmethod
    def from_dict(cls, options: "dict | SpeculativeConfig") -> "SpeculativeConfig":
        """What `LLM(..., speculative_config=...)` and `--speculative-config JSON` receive."""
        return record_from_dict(cls, options, "speculative_config")

    def __post_init__(self) -> None:
        if self.method is None and self.model is not None:
            self.method = "draft_model"  # vLLM too infers the method from a model
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, "
                             f"got {self.method!r}")
        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config.num_speculative_tokens is required (k >= 1)")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPEC_LEN)
        if self.disable_by_batch_size is not None:
            # (vLLM's rule: a batch of one always speculates)
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 2)
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config.model is for method='draft_model'; 'ngram' "
                                 "needs no model")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    _check_int(name, getattr(self, name), 1)
            # vLLM's defaults: neither given, both 5; one given, the other equals it.
            given = [n for n in (self.prompt_lookup_min, self.prompt_lookup_max)
                     if n is not None] or [5]
            self.prompt_lookup_min = self.prompt_lookup_min or given[0]
            self.prompt_lookup_max = self.prompt_lookup_max or given[-1]
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) "
                                 f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config.model: method='draft_model' needs the draft "
                                 f"model's folder or name, got {self.model!r}")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} is for method='ngram', not "
                                     "'draft_model'")

    def enabled_for(self, num_running: int) -> bool:
        """Does a step with num_running running requests speculate? Big batches already keep the
        hardware busy, so verifying guesses there costs more than it saves (vLLM's
        disable_by_batch_size)."""
        return self.disable_by_batch_size is None or num_running <= self.disable_by_batch_size


@dataclass
class SpecDecodingStats:
    """vLLM's speculative decoding counters: how often the guesses pay off."""

    num_drafts: int = 0  # verifications of one request's drafts (requests x steps that speculated)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: drafts accepted at position i
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verification: its first num_accepted_tokens drafts were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        missing = num_draft_tokens - len(self.num_accepted_tokens_per_pos)
        self.num_accepted_tokens_per_pos += [0] * max(0, missing)
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts per draft proposed."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """[i]: the share of verifications whose draft i was accepted (so all drafts before it
        too)."""
        return [n / self.num_drafts for n in self.num_accepted_tokens_per_pos]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification: the accepted drafts plus the target's own token (1: no
        gain)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
