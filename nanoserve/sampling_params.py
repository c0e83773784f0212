import math
import numbers
from dataclasses import dataclass, field
from enum import Enum

from nanoserve.structured_outputs import StructuredOutputsParams

# Request options a chapter serves (its EngineCore.check_option), and how to turn it on: a plain
# engine refuses a request that sets one.
FEATURE_OPTIONS = {"priority": "it needs scheduling_policy='priority'",
                   "lora_request": "pass enable_lora=True",
                   "structured_outputs": "pass enable_structured_outputs=True",
                   **dict.fromkeys(("logprobs", "prompt_logprobs"),
                                   "nanoserve.LLM plugs it in, with max_logprobs > 0"),
                   "kv_transfer_params": "it needs a kv_transfer_config (docs/disaggregated.md)"}


class RequestOutputKind(Enum):
    """What each streamed RequestOutput carries (vLLM's names)."""

    CUMULATIVE = 0  # everything so far
    DELTA = 1  # the new text and token ids since the last output
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop, as in vLLM."""

    n: int = 1  # sequences sampled for the prompt; with a seed, sequence i draws with seed + i
    temperature: float = 1.0  # 0 means greedy (argmax)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = -1  # keep the k most likely tokens; -1 keeps all
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated so far
    # divides positive (multiplies negative) logits of prompt and output tokens
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None  # per-request seed: the same seed gives the same sample
    logprobs: int | None = None  # per output token: its logprob and the `logprobs` most likely ones
    prompt_logprobs: int | None = None  # the same per prompt token (the prefix cache is skipped)
    stop: str | list[str] | None = None  # stop when the text contains one (finish_reason "stop")
    include_stop_str_in_output: bool = False
    min_tokens: int = 0  # no EOS, stop token or stop string before this many output tokens
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # the output matches a schema, regex, choice or grammar
    structured_outputs: StructuredOutputsParams | None = None
    # disaggregated prefill: send or receive the prompt's KV (kv_transfer/)
    kv_transfer_params: dict | None = None

    def __post_init__(self) -> None:
        for name, (kind, interval) in LIMITS.items():
            if getattr(self, name) is not None or name not in OPTIONAL:
                setattr(self, name, checked_number(name, getattr(self, name), kind, interval))
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or an integer >= 1, got 0")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens}")
        for name, (kind, what) in TYPES.items():
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be {what}, got {getattr(self, name)!r}")
        self.stop_token_ids = [checked_number("stop_token_ids", t, int, "[0, inf)")
                               for t in self.stop_token_ids]
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, none empty (an empty "
                             f"string would stop at once), got {self.stop!r}")
        self.stop = list(stop)
        # a complete output allows EOS alone, which min_tokens would rule out
        if self.structured_outputs is not None and self.min_tokens:
            raise ValueError("min_tokens: must be 0 with structured_outputs "
                             "(the grammar decides where it ends)")


# Every number a request may hold, in interval notation ("inf" is never reached, so floats must be
# finite): a value outside it, NaN, infinity, a bool, a string or a float where an integer belongs
# is a ValueError naming the field.
# (Checked after the table: top_k is not 0, min_tokens <= max_tokens.)
LIMITS: dict[str, tuple[type, str]] = {
    "n": (int, "[1, inf)"), "temperature": (float, "[0, inf)"), "top_p": (float, "(0, 1]"),
    "top_k": (int, f"[-1, {2 ** 63})"),  # (the sampler's column is int64)
    "min_p": (float, "[0, 1]"), "presence_penalty": (float, "[-2, 2]"),
    "frequency_penalty": (float, "[-2, 2]"), "repetition_penalty": (float, "(0, inf)"),
    "max_tokens": (int, "[1, inf)"), "min_tokens": (int, "[0, inf)"),
    # what torch.Generator.manual_seed takes, with room for seed + i
    "seed": (int, f"[{-2 ** 63}, {2 ** 63})"),
    "logprobs": (int, "[0, inf)"), "prompt_logprobs": (int, "[0, inf)")}
OPTIONAL = {"seed", "logprobs", "prompt_logprobs"}  # None: not asked for
TYPES = {"ignore_eos": (bool, "True or False"),
         "include_stop_str_in_output": (bool, "True or False"),
         "output_kind": (RequestOutputKind, "a RequestOutputKind"),
         "stop_token_ids": ((list, tuple), "a list of token ids"),
         "structured_outputs": ((StructuredOutputsParams, type(None)), "a StructuredOutputsParams")}


def checked_number(name: str, value, kind: type, interval: str) -> int | float:
    """`value` as a plain int or float if a number of `kind` within `interval`, else ValueError."""
    low_text, high_text = interval[1:-1].split(", ")
    # (exact for the bounds above; ints compare with floats exactly)
    low, high = float(low_text), float(high_text)
    lower_bound = f">= {low_text}" if interval[0] == "[" else f"> {low_text}"
    bound = lower_bound if high == math.inf else f"in {interval}"
    what = "an integer" if kind is int else "a finite number"
    error = f"{name} must be {what} {bound}, got {value!r}"
    number_type = numbers.Integral if kind is int else numbers.Real
    if isinstance(value, bool) or not isinstance(value, number_type):
        raise ValueError(f"{error} ({type(value).__name__})")
    above_low = low < value if interval[0] == "(" else low <= value
    below_high = value < high if interval[-1] == ")" else value <= high
    if not (above_low and below_high):  # NaN fails both; infinity fails "inf)"
        raise ValueError(error)
    try:
        return kind(value)  # numpy's int64 and float32 become Python's own
    except OverflowError:  # an integer too large for a float
        raise ValueError(error) from None
