from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, a stop token or string), "length" (max_tokens), None while running
    stop_reason: int | str | None = None  # the stop token id or stop string; None for EOS or length


@dataclass
class RequestOutput:
    """One prompt's result, shaped like vLLM's so code written for it reads the same fields."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    outputs: list[CompletionOutput]
    finished: bool = True
