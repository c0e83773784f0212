"""What the sampler takes for a step (vLLM's v1/sample/metadata.py): records the engine fills on the
host (engine/model_runner.py), and the LogitsProcessor interface a chapter's processor has (vLLM's
logits processors)."""
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class PenaltyMetadata:
    """The token ids of each row's prompt and output, padded with vocab_size, and each row's
    penalties."""

    prompt_token_ids: torch.Tensor
    # -1: the newest token, unknown when the step was planned (async scheduling)
    output_token_ids: torch.Tensor
    presence_penalties: torch.Tensor
    frequency_penalties: torch.Tensor
    repetition_penalties: torch.Tensor


class LogitsProcessor(Protocol):
    """vLLM's interface for what rules tokens out of the rows the sampler draws from (InputBuilder.
    logits_processors: structured outputs' grammar mask).
    Once per step, on the host, `prepare` gets the sampling rows ((sequence, j): its next token
    after j lookahead tokens) and returns its state for them, or None when no row is its; the
    sampler then calls `apply` in order."""

    def prepare(self, rows: list[tuple[Any, int]]) -> Any | None: ...

    def apply(self, logits: torch.Tensor, state: Any) -> torch.Tensor: ...


@dataclass
class SamplingMetadata:
    """One row per sequence that samples. None for an option: no row uses it (temperatures None:
    every row is greedy). The engine knows that on the host, so the sampler never waits for the GPU
    to find it out."""

    temperatures: torch.Tensor | None
    top_ks: torch.Tensor | None
    top_ps: torch.Tensor | None
    min_ps: torch.Tensor | None
    generators: list[torch.Generator | None]  # a seeded request draws its own reproducible noise
    penalties: PenaltyMetadata | None = None
    # (rows, token ids): EOS, stop tokens
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    # (processor, its state)
    logits_processors: list[tuple[LogitsProcessor, Any]] = field(default_factory=list)
