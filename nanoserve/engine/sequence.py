"""A request and its sequences, the units the scheduler moves: a `Sequence` (tokens, status, block_table,
num_computed_tokens), a `Request` (its n sequences, their detokenizers), and the `RequestQueue` they wait in."""
from collections import deque
from collections.abc import Iterator
from enum import Enum, auto

import torch

from nanoserve.engine.output_processor import IncrementalDetokenizer
from nanoserve.lora_request import LoRARequest
from nanoserve.outputs import Logprob
from nanoserve.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    SWAPPED = auto()  # preempted with its KV copied to host memory (the swap chapter, nanoserve/scheduling/swap.py)
    FINISHED = auto()


class Sequence:
    """One sequence of a request (n > 1 gives it several): its tokens, where their KV lives, and how far the
    model has got. The scheduler and the model runner see only sequences."""

    def __init__(self, seq_id: int, token_ids: list[int], sampling_params: SamplingParams, block_size: int,
                 priority: int = 0, request_id: str = "", index: int = 0, lora_request: LoRARequest | None = None):
        self.seq_id = seq_id  # ids count up in arrival order
        self.request_id, self.index = request_id, index  # the caller's name for it; which of its request's n
        self.group = [self]  # the request's n sequences: Request.seqs, one list shared by all of them
        self.priority, self.lora_request = priority, lora_request  # records a chapter reads (priority, LoRA)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params
        self.block_size = block_size
        self.block_table: list[int] = []  # logical block i of this sequence lives in physical block_table[i]
        self.num_cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.num_computed_tokens = 0  # tokens whose KV is in the cache (or being computed): resume from here
        # Tokens a step in flight is still sampling (async scheduling, 0 otherwise): counted in len(seq), so the
        # next step is planned as if they were there (vLLM's num_output_placeholders).
        self.num_output_placeholders = 0
        # Lookahead slots (seed 001): guesses the next step computes after the newest token and keeps only as far
        # as they are verified. Speculative decoding's drafts (nanoserve/spec_decode/) fill them.
        self.spec_token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.raw_logits = False  # its request picks its own tokens from the raw logits (beam search): none drawn
        self.grammar = None  # structured outputs' matcher, if its request has a grammar (nanoserve/structured_output/)
        seed = sampling_params.seed
        self.generator = None if seed is None else torch.Generator().manual_seed(seed + index)
        # Filled by the model runner when asked for: one dict per generated token, one per prompt token.
        self.logprobs: list[dict[int, Logprob]] | None = None if sampling_params.logprobs is None else []
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            None if sampling_params.prompt_logprobs is None else [None] * len(token_ids))

    def __len__(self) -> int:
        """The tokens the scheduler plans for (vLLM's num_tokens_with_spec): the known ones, the placeholders of
        those in flight, and the lookahead tokens. A step computes from num_computed_tokens up to here."""
        return len(self.token_ids) + self.num_output_placeholders + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_outputs_in_flight(self) -> int:
        """Output tokens before the one the planned step samples that are not known yet: with async scheduling,
        1 while the step before is still sampling it, else 0."""
        return max(self.num_output_placeholders - 1, 0)

    @property
    def num_blocks(self) -> int:
        return (len(self) + self.block_size - 1) // self.block_size  # ceiling division

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)


class Request:
    """One request (vLLM's name): its prompt, sampling params and its n sequences (SamplingParams.n), each with its
    detokenizer. EngineCore keeps them by request id; the scheduler sees only the sequences (`seq.group`)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, *,
                 block_size: int, seq_ids: Iterator[int], tokenizer=None, priority: int = 0,
                 lora_request: LoRARequest | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.seqs = [Sequence(next(seq_ids), prompt_token_ids, sampling_params, block_size, priority, request_id, i,
                              lora_request) for i in range(sampling_params.n)]
        for seq in self.seqs:
            seq.group = self.seqs
        self.detokenizers = [IncrementalDetokenizer(tokenizer, sampling_params) if tokenizer else None
                             for _ in self.seqs]

    @property
    def first_seq(self) -> Sequence:
        """The sequence that prefills the prompt for all n (the others fork from it): its cache hits and prompt
        logprobs are the request's."""
        return self.seqs[0]

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


def num_seats(seq: Sequence) -> int:
    """The max_num_seqs seats a sequence takes: n for a request's first one until its prompt is done (the
    others fork from it then), else 1."""
    return seq.sampling_params.n if seq.num_completion_tokens == 0 else 1


class RequestQueue(deque):
    """waiting or running (vLLM's request_queue.py): first come, first served; a preempted request goes back to
    the front. (The priority chapter sorts it instead: nanoserve/scheduling/priority.py.)"""

    def add(self, seq: Sequence, front: bool = False) -> None:
        self.appendleft(seq) if front else self.append(seq)

    def pop_group(self) -> list[Sequence]:
        """The head with the other sequences of its request in this queue (n > 1), taken out together."""
        seq = self.popleft()
        group = [seq] + [s for s in seq.group if s is not seq and s in self]
        for s in group[1:]:
            self.remove(s)
        return group
