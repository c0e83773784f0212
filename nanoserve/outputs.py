from dataclasses import dataclass


@dataclass
class Logprob:
    """A token's log probability under the model, and its rank in the vocabulary (1 = most
    likely)."""

    logprob: float
    rank: int


# Per position, token id -> Logprob: the token there and the `logprobs` most likely ones (vLLM's
# format).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop" (EOS, a stop token or string), "length" (max_tokens), None while running
    finish_reason: str | None
    stop_reason: int | str | None = None  # the stop token id or stop string; None for EOS or length
    logprobs: SampleLogprobs | None = None  # with SamplingParams(logprobs=k)
    # LLM.beam_search: the sum of the tokens' log-probabilities
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """One prompt's result, shaped like vLLM's so code written for it reads the same fields."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    outputs: list[CompletionOutput]
    finished: bool = True
    # prompt_logprobs=k; the first token's is None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
