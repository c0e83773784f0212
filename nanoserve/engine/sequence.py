"""The units the scheduler moves: a `Sequence`, its `Request` (n sequences, each with an
`IncrementalDetokenizer` for its text), and the `RequestQueue` they wait in."""
from collections import deque
from collections.abc import Iterator
from enum import Enum, auto

import numpy as np
import torch
import xxhash
from tokenizers.decoders import DecodeStream

from nanoserve.sampling_params import RequestOutputKind, SamplingParams


def compute_hash(token_ids: list[int], prefix_hash: int) -> int:
    """A block's hash covers its own tokens and, through prefix_hash, every token before it."""
    h = xxhash.xxh64()
    if prefix_hash != -1:
        h.update(prefix_hash.to_bytes(8, "little"))
    h.update(np.array(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    # preempted with its KV copied to host memory (the swap chapter, nanoserve/scheduling/swap.py)
    SWAPPED = auto()
    FINISHED = auto()


class Sequence:
    """One sequence of a request: its tokens, where their KV lives, how far the model has got."""

    def __init__(self, seq_id: int, token_ids: list[int], sampling_params: SamplingParams,
                 block_size: int, request_id: str = "", index: int = 0):
        self.seq_id = seq_id  # ids count up in arrival order
        self.request_id = request_id  # the caller's name for it
        self.index = index  # which of its request's n
        self.group = [self]  # the request's n sequences: Request.seqs, one list shared by them all
        self.status = SequenceStatus.WAITING
        self.token_ids, self.num_prompt_tokens = list(token_ids), len(token_ids)
        self.sampling_params, self.block_size = sampling_params, block_size
        self.block_table: list[int] = []  # its logical block i lives in physical block_table[i]
        # The chained hash of each full block of its tokens, computed once as they come (vLLM's
        # Request.block_hashes); the first chains from hash_root (vLLM's extra keys: a LoRA adapter
        # sets its own, since the same tokens under it have other KV).
        self.hash_root = -1
        self._block_hashes: list[int] = []
        self.num_cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.num_computed_tokens = 0  # tokens with KV in the cache (or being computed): resume here
        self.num_output_placeholders = 0  # tokens a step in flight is sampling, counted in len(seq)
        # lookahead tokens the next step verifies (nanoserve/spec_decode/)
        self.spec_token_ids: list[int] = []
        self.finish_reason: str | None = None
        seed = sampling_params.seed
        self.generator = None if seed is None else torch.Generator().manual_seed(seed + index)

    def __len__(self) -> int:
        """The tokens the scheduler plans for (vLLM's num_tokens_with_spec): known, in flight and
        lookahead."""
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
        # async scheduling: 1 while the step before still samples
        return max(self.num_output_placeholders - 1, 0)

    @property
    def num_blocks(self) -> int:
        return (len(self) + self.block_size - 1) // self.block_size  # ceiling division

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    @property
    def block_hashes(self) -> list[int]:
        """The hash of each full block of known tokens: what the prefix cache, its host tier and a
        KV connector name a block's KV by. Each is computed once, when its block fills."""
        num_full_blocks = len(self.token_ids) // self.block_size
        del self._block_hashes[num_full_blocks:]  # (a stop string cut the tokens)
        for i in range(len(self._block_hashes), num_full_blocks):
            parent = self._block_hashes[-1] if i else self.hash_root
            self._block_hashes.append(compute_hash(self.block(i), parent))
        return self._block_hashes

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)


class Request:
    """One request (vLLM's name): its n sequences (SamplingParams.n), each with a detokenizer."""

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, *, block_size: int, seq_ids: Iterator[int],
                 tokenizer=None):
        self.request_id, self.sampling_params = request_id, sampling_params
        self.prompt_token_ids = list(prompt_token_ids)  # (beam search restarts from it)
        self.seqs = [Sequence(next(seq_ids), prompt_token_ids, sampling_params, block_size,
                              request_id, i)
                     for i in range(sampling_params.n)]
        for seq in self.seqs:
            seq.group = self.seqs
        self.detokenizers = [IncrementalDetokenizer(tokenizer, sampling_params) if tokenizer
                             else None for _ in self.seqs]

    @property
    def first_seq(self) -> Sequence:
        """The sequence that prefills the prompt for all n: its cache hits are the request's."""
        return self.seqs[0]

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


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


def num_seats(seq: Sequence) -> int:
    """The max_num_seqs seats a sequence takes: n until its prompt is done (the rest fork then),
    else 1."""
    return seq.sampling_params.n if seq.num_completion_tokens == 0 else 1


class RequestQueue(deque):
    """waiting or running (vLLM's request_queue.py): first come, first served; the preempted go to
    the front."""

    def add(self, seq: Sequence, front: bool = False) -> None:
        self.appendleft(seq) if front else self.append(seq)

    def pop_group(self) -> list[Sequence]:
        """The head and its request's other sequences in this queue, taken out together."""
        seq = self.popleft()
        group = [seq] + [s for s in seq.group if s is not seq and s in self]
        for s in group[1:]:
            self.remove(s)
        return group
