"""The way back out: a request's tokens become text (IncrementalDetokenizer, with its stop strings),
and its EngineCoreOutputs become the RequestOutputs a front end returns (RequestState)."""
from dataclasses import dataclass, replace

from tokenizers.decoders import DecodeStream

from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling_params import RequestOutputKind, SamplingParams


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


class IncrementalDetokenizer:
    """One request's output text, token by token, and its stop strings (vLLM's semantics).
    Byte-level BPE splits a character like an emoji over several tokens: tokenizers' DecodeStream
    gives a token's text (None while a character is still incomplete) from the few tokens before it,
    as vLLM's FastIncrementalDetokenizer does."""

    def __init__(self, tokenizer, params: SamplingParams):
        self.tokenizer, self.params, self.token_ids, self.text = tokenizer, params, [], ""
        self.stream = DecodeStream(skip_special_tokens=True)
        self.num_sent = 0  # characters of text already handed out
        # Text no one reads before the end (LLM.generate asks for FINAL_ONLY) and no stop string
        # looks at is decoded all at once when the sequence finishes: its steps spend nothing on it.
        self.at_end = params.output_kind == RequestOutputKind.FINAL_ONLY and not params.stop
        # Without include_stop_str_in_output, the tail that might begin a stop string is held back.
        longest_stop = max(map(len, params.stop), default=1)
        self.hold_back = 0 if params.include_stop_str_in_output else longest_stop - 1

    def update(self, token_id: int, finished: bool) -> str | None:
        """Take in a new token (the last one if finished); returns the stop string its text
        completes, if any (the text is cut there)."""
        self.token_ids.append(token_id)
        new_text = None if self.at_end else self.stream.step(self.tokenizer._tokenizer, token_id)
        # all at once: at_end, or cut off inside a character (it ends in U+FFFD)
        if new_text is None and finished:
            full_text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
            new_text = full_text[len(self.text) :]
        self.text += new_text or ""
        if not new_text or len(self.token_ids) <= self.params.min_tokens:
            return None
        for stop in self.params.stop:
            # Only where the new text can complete it: the match may begin in earlier tokens' text.
            i = self.text.find(stop, max(len(self.text) - len(new_text) - len(stop) + 1, 0))
            if i != -1:
                end = i + len(stop) if self.params.include_stop_str_in_output else i
                self.text = self.text[:end]
                return stop
        return None

    def get_delta(self, finished: bool) -> str:
        """The text not handed out yet (all of it once finished)."""
        end = len(self.text) if finished else max(len(self.text) - self.hold_back, self.num_sent)
        delta, self.num_sent = self.text[self.num_sent : end], end
        return delta
