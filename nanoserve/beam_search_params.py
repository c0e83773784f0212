import math
from dataclasses import dataclass
from typing import Literal


@dataclass
class BeamSearchParams:
    """How to run a beam search, in vLLM's shape; the search itself follows transformers
    (docs/beam_search.md)."""

    beam_width: int  # beams kept each step, and sequences returned
    max_tokens: int  # a beam that reaches this many generated tokens is finished
    ignore_eos: bool = False  # EOS is a token like any other: every beam runs to max_tokens
    # > 0: beams are scored by log_softmax(logits / temperature); 0 (the default) as 1
    temperature: float = 0.0
    length_penalty: float = 1.0  # a finished beam scores sum_logprobs / (length ** length_penalty)
    # when to stop once beam_width beams are finished
    early_stopping: bool | Literal["never"] = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:  # (type(): a bool is an int to isinstance)
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if type(self.ignore_eos) is not bool:
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        for name, low in (("temperature", 0.0), ("length_penalty", -math.inf)):
            value = getattr(self, name)
            if type(value) not in (int, float) or not math.isfinite(value) or value < low:
                limit = "a finite number >= 0" if low == 0 else "a finite number"
                raise ValueError(f"{name} must be {limit}, got {value!r}")
        if not (type(self.early_stopping) is bool or self.early_stopping == "never"):
            raise ValueError('early_stopping must be True, False or "never", '
                             f'got {self.early_stopping!r}')
