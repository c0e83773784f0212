"""The scheduler's books for speculative decoding (docs/speculative.md, "Accounting").

A request with k draft tokens computes 1 + k tokens in one step: its newest token and the k drafts (vLLM V1
counts them in num_tokens_with_spec = prompt + output + spec_token_ids, seed 000). The verification emits
a + 1 tokens: the a drafts accepted and one more from the target. The KV of the k - a rejected drafts was
written but is wrong for what follows, so num_computed_tokens rolls back over them.
"""
from dataclasses import dataclass, field


def num_spec_tokens_allowed(k: int, num_output_tokens: int, max_tokens: int) -> int:
    """How many drafts a request may verify: a step emits up to k + 1 tokens, and a draft past the request's
    last output token (max_tokens) would be computed for nothing."""
    return max(0, min(k, max_tokens - num_output_tokens - 1))


def num_rejected_tokens(num_draft_tokens: int, num_emitted_tokens: int) -> int:
    """Of num_draft_tokens drafts verified, how many were rejected, from how many tokens the step emitted
    (the accepted drafts and the target's own next token): num_computed_tokens rolls back by this much."""
    if not 1 <= num_emitted_tokens <= num_draft_tokens + 1:
        raise ValueError(f"a step verifying {num_draft_tokens} drafts emits 1 to {num_draft_tokens + 1} tokens, "
                         f"got {num_emitted_tokens}")
    return num_draft_tokens + 1 - num_emitted_tokens


@dataclass
class SpecDecodingStats:
    """vLLM's speculative decoding counters: how often the guesses pay off."""

    num_drafts: int = 0  # verifications of one request's drafts (requests x steps that speculated)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i

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
        """[i]: the share of verifications whose draft i was accepted (so all drafts before it too)."""
        return [n / self.num_drafts for n in self.num_accepted_tokens_per_pos]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification: the accepted drafts plus the target's own token (1: no gain)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
