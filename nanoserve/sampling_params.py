from dataclasses import dataclass, field
from enum import Enum


class RequestOutputKind(Enum):
    """What each streamed RequestOutput carries (vLLM's names)."""

    CUMULATIVE = 0  # everything so far
    DELTA = 1  # the new text and token ids since the last output
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop, as in vLLM."""

    temperature: float = 1.0  # 0 means greedy (argmax)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = -1  # keep the k most likely tokens; -1 keeps all
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None  # per-request seed: the same seed gives the same sample
    stop: str | list[str] | None = None  # stop when the text contains one (finish_reason "stop")
    include_stop_str_in_output: bool = False
    min_tokens: int = 0  # no EOS, stop token or stop string before this many output tokens
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if "" in self.stop:
            raise ValueError("stop: an empty string would stop at once")
