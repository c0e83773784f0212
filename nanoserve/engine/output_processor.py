"""The way back out: a step's EngineCoreOutputs (their text made by each Request's
IncrementalDetokenizer, engine/sequence.py) become the RequestOutputs a front end returns
(RequestState)."""
from dataclasses import dataclass, replace

from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling_params import RequestOutputKind


@dataclass
class EngineCoreOutput:
    """What a step did for one request (vLLM's name); front ends turn these into RequestOutputs."""

    request_id: str
    new_token_ids: list[int]
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_logprobs: list | None = None  # with SamplingParams(logprobs=k): one dict per new token
    prompt_logprobs: list | None = None  # with prompt_logprobs=k
    index: int = 0  # which of the request's n sequences; finished says it finished
    cumulative_logprob: float | None = None  # a beam search's result: its sum of token logprobs
    error: BaseException | None = None  # the request failed (and is gone): the front end raises it


class RequestState:
    """One request in a front end (LLM, AsyncLLM): gathers its EngineCoreOutputs, step by step, into
    the RequestOutputs its output_kind asks for, with one CompletionOutput per sequence
    (SamplingParams.n)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 kind: RequestOutputKind, n: int = 1):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.kind = kind
        self.completions = [CompletionOutput(i, "", [], None) for i in range(n)]
        self.num_finished = 0

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.completions)

    def update(self, out: EngineCoreOutput) -> RequestOutput | None:
        c = self.completions[out.index]
        c.text += out.new_text
        c.token_ids += out.new_token_ids
        c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
        c.cumulative_logprob = out.cumulative_logprob
        if out.new_logprobs is not None:
            c.logprobs = c.logprobs or []
            c.logprobs += out.new_logprobs  # (in place: linear, not quadratic)
        self.num_finished += out.finished
        if out.finish_reason == "abort":  # an abort ends all of the request's sequences
            for c in self.completions:
                c.finish_reason = c.finish_reason or "abort"
            self.num_finished = len(self.completions)
        if self.kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        if self.kind == RequestOutputKind.DELTA:
            completions = [CompletionOutput(out.index, out.new_text, list(out.new_token_ids),
                                            out.finish_reason, out.stop_reason, out.new_logprobs)]
        else:  # copies, lists included: later steps go on appending to ours
            completions = [replace(c, token_ids=list(c.token_ids),
                                   logprobs=c.logprobs and list(c.logprobs))
                           for c in self.completions]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             out.num_cached_tokens, completions, self.finished, out.prompt_logprobs)
