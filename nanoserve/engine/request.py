from collections.abc import Iterator
from dataclasses import dataclass
from time import monotonic

from nanoserve.engine.detokenizer import IncrementalDetokenizer
from nanoserve.engine.sequence import Sequence
from nanoserve.sampling_params import SamplingParams


@dataclass
class EngineCoreOutput:
    """What one step did for one request (vLLM's name); the front ends turn these into RequestOutputs."""

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
    cumulative_logprob: float | None = None  # a beam search's result: its sum of token log-probabilities
    error: BaseException | None = None  # the request failed (and is gone): the front end raises this


class Request:
    """One request (vLLM's name): its prompt, sampling params, priority and arrival time, and its n sequences
    (SamplingParams.n), each with its detokenizer. EngineCore keeps them by request id; the scheduler sees
    only the sequences (`seq.group` is `request.seqs`)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, *,
                 block_size: int, seq_ids: Iterator[int], tokenizer=None, priority: int = 0):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival_time = monotonic()
        self.seqs = [Sequence(next(seq_ids), prompt_token_ids, sampling_params, block_size, priority, request_id, i)
                     for i in range(sampling_params.n)]
        for seq in self.seqs:
            seq.group = self.seqs
        self.detokenizers = [IncrementalDetokenizer(tokenizer, sampling_params) if tokenizer else None
                             for _ in self.seqs]

    @property
    def first_seq(self) -> Sequence:
        """The sequence that prefills the prompt for all n (the others fork from it): the scheduler gets this
        one; its cache hits and prompt logprobs are the request's."""
        return self.seqs[0]

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)
