from enum import Enum, auto

import torch

from nanoserve.outputs import Logprob
from nanoserve.sampling_params import SamplingParams
from nanoserve.utils.math import cdiv


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    SWAPPED = auto()  # preempted with its KV copied to host memory (preemption_mode="swap")
    FINISHED = auto()


class Sequence:
    """One sequence of a request (engine/request.py; n > 1 gives it several): its tokens, where their KV
    lives, and how far the model has got. The scheduler and the model runner see only sequences."""

    def __init__(self, seq_id: int, token_ids: list[int], sampling_params: SamplingParams, block_size: int,
                 priority: int = 0, request_id: str = "", index: int = 0):
        self.seq_id = seq_id  # ids count up in arrival order
        self.request_id = request_id  # the caller's name for it
        self.index = index  # which of the request's n sequences (SamplingParams.n) it is
        self.group = [self]  # the request's n sequences: Request.seqs, one list shared by all of them
        self.priority = priority  # scheduling_policy="priority": lower values are served first
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params
        self.block_size = block_size
        self.block_table: list[int] = []  # logical block i of this sequence lives in physical block_table[i]
        self.num_cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.num_computed_tokens = 0  # tokens whose KV is in the cache (or being computed): resume from here
        # Async scheduling: tokens a step in flight is sampling, not yet known. They count in len(seq), so the
        # next step is planned (blocks, positions) as if they were there (vLLM's num_output_placeholders).
        self.num_output_placeholders = 0
        self.spec_token_ids: list[int] = []  # draft tokens the next step verifies (docs/speculative.md)
        self.finish_reason: str | None = None
        self.beam_search = None  # the BeamSearch (engine/beam_search.py) this sequence is a live beam of
        self.grammar = None  # structured outputs: its GrammarMatcher (engine/structured_output_manager.py)
        seed = sampling_params.seed
        self.generator = None if seed is None else torch.Generator().manual_seed(seed + index)
        # Filled by the model runner when asked for: one dict per generated token, one per prompt token.
        self.logprobs: list[dict[int, Logprob]] | None = None if sampling_params.logprobs is None else []
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            None if sampling_params.prompt_logprobs is None else [None] * len(token_ids))

    def __len__(self) -> int:
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
        1 while the step before is still sampling it, else 0. (Read on a sequence that samples in the planned
        step: its own placeholder counts from then on; a fork samples from its parent's row and has none.)"""
        return max(self.num_output_placeholders - 1, 0)

    @property
    def num_blocks(self) -> int:
        return cdiv(len(self), self.block_size)

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
