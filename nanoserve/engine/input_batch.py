"""A step's plan (SchedulerOutput) -> the tensors the model and the sampler take (ModelInput), built on the host.

With async scheduling this runs while the step before is on the GPU, so it reads only the plan: a token that
step is still sampling is a placeholder here (input id 0, output id -1), filled in on the device later.
Nothing here needs a model: tests/test_input_batch.py builds inputs from a hand-made plan.
"""
from dataclasses import dataclass, field

import numpy as np
import torch

from nanoserve.config import Config
from nanoserve.engine.persistent_batch import InputBatch, StepArrays
from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.engine.sequence import Sequence
from nanoserve.layers.attention import AttentionMetadata
from nanoserve.layers.sampler import LogitsProcessor, PenaltyMetadata, SamplingMetadata

PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
LogprobsPlace = tuple[Sequence, int | None, int]  # (seq, prompt position or None for the sampled token, logits row)
# A sampling row: (seq, j), seq's next token after its first j lookahead tokens (a verification has 1 + k rows).
SamplingRow = tuple[Sequence, int]


@dataclass
class ModelInput:
    """One step's batch as tensors. Rows of logits_rows: first one per sequence that samples (a request's
    n > 1 forks repeat its row), in `sample_seq_ids` order; then the prompt-logprobs rows."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # the rows of the flat batch whose logits are computed
    sampling: SamplingMetadata  # for the first len(sample_seq_ids) rows of logits
    sample_seq_ids: list[int]  # who samples, row by row (the next step finds its placeholders here)
    placeholder_rows: list[int]  # rows of input_ids whose token the previous step is still sampling...
    placeholder_seq_ids: list[int]  # ...for these sequences
    logprobs: list[LogprobsPlace]  # logits rows to score (ModelRunner.record_logprobs)
    spec_decode_tokens: dict[int, list[int]]  # seq_id -> lookahead tokens: its 1 + k rows are verified
    raw_rows: list[int]  # logits rows of requests that pick their own tokens (raw_logits), after the sampled ones


def to_device(data: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.as_tensor(data, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()  # pinned host memory lets the copy overlap with GPU work
    return host.to(device, non_blocking=True)


@dataclass
class InputBuilder:
    """Builds each step's ModelInput for one engine (rank 0: the workers get the tensors)."""

    block_size: int
    vocab_size: int
    eos_token_ids: list[int]
    device: torch.device
    logits_processors: list[LogitsProcessor] = field(default_factory=list)  # a seam (engine/seams.py)
    batch: InputBatch = field(init=False)  # the rows that persist between steps

    def __post_init__(self) -> None:
        self.batch = InputBatch(self.block_size, self.vocab_size)

    @classmethod
    def from_config(cls, config: Config, logits_processors: list[LogitsProcessor] | None = None) -> "InputBuilder":
        return cls(block_size=config.block_size, vocab_size=config.hf_config.vocab_size,
                   eos_token_ids=config.eos_token_ids, device=torch.device(config.device),
                   logits_processors=[] if logits_processors is None else logits_processors)

    def prepare_inputs(self, out: SchedulerOutput) -> ModelInput | None:
        """Flatten the tokens each sequence computes this step into one batch, with their cache slots, and
        the rows whose logits are needed: the last one of each sequence that samples."""
        if not out.seqs:  # everyone was preempted this step
            return None
        step = self.batch.flatten(out)  # from the rows kept between steps (engine/persistent_batch.py)
        meta = self.attention_metadata(step.block_tables, step.slot_mapping, step.q_lens, step.context_lens)
        # Who samples: a row per sequence whose step reaches its end, 1 + k with k lookahead tokens, one per fork.
        rows = [(s, j) for seq, do_sample, forks in zip(out.seqs, out.do_sample, out.forks)
                if do_sample and not seq.raw_logits
                for s, j in [*((seq, j) for j in range(len(seq.spec_token_ids) + 1)), *((f, 0) for f in forks)]]
        # Logprobs: of the sampled tokens, and of prompt tokens (extra logits rows after the sampled ones).
        logprobs = [(seq, None, row) for row, (seq, _) in enumerate(rows) if seq.logprobs is not None]
        prompt_rows, prompt_places = self.prompt_logprobs_rows(out)
        logits_rows = step.logits_rows.tolist() + step.raw_rows.tolist()  # raw rows: scored, nothing drawn
        logprobs += [(seq, p, row) for row, (seq, p) in enumerate(prompt_places, len(logits_rows))]
        return ModelInput(
            input_ids=self._tensor(step.input_ids, torch.int64), positions=self._tensor(step.positions, torch.int64),
            meta=meta, logits_rows=self._tensor(logits_rows + prompt_rows, torch.int64),
            sampling=self.prepare_sampling(rows, step), sample_seq_ids=[seq.seq_id for seq, _ in rows],
            placeholder_rows=step.placeholder_rows, placeholder_seq_ids=step.placeholder_seq_ids, logprobs=logprobs,
            spec_decode_tokens=out.scheduled_spec_decode_tokens,
            raw_rows=list(range(len(step.logits_rows), len(logits_rows))))

    def attention_metadata(self, block_tables: np.ndarray | list[list[int]], slot_mapping: np.ndarray | list[int],
                           q_lens: np.ndarray | list[int], context_lens: np.ndarray | list[int]) -> AttentionMetadata:
        """Where a batch's new tokens go in the paged cache, and what each sequence attends to."""
        q_lens, context_lens = np.asarray(q_lens), np.asarray(context_lens)
        return AttentionMetadata(
            slot_mapping=self._tensor(slot_mapping, torch.int64), context_lens=self._tensor(context_lens, torch.int32),
            block_tables=self._tensor(block_tables, torch.int32) if isinstance(block_tables, np.ndarray)
            else self._padded(block_tables, -1, torch.int32),
            cu_seqlens_q=self._tensor(np.append(0, np.cumsum(q_lens)), torch.int32),
            cu_seqlens_k=self._tensor(np.append(0, np.cumsum(context_lens)), torch.int32),
            max_seqlen_q=int(q_lens.max()), max_seqlen_k=int(context_lens.max()))

    def prepare_sampling(self, rows: list[SamplingRow], step: StepArrays) -> SamplingMetadata:
        """The sampler's inputs, one row per sampling row; an option no row uses is None. Row (seq, j) counts seq's
        first j lookahead tokens as output already (penalties, min_tokens)."""
        def column(name: str, dtype: torch.dtype) -> torch.Tensor | None:
            values = step.column(name)
            return None if values is None else self._tensor(values, dtype)

        penalties = None
        if any(step.column(name) is not None for name in PENALTIES):
            penalties = PenaltyMetadata(
                prompt_token_ids=self._padded([seq.prompt_token_ids for seq, _ in rows], self.vocab_size),
                output_token_ids=self._padded([seq.completion_token_ids + seq.spec_token_ids[:j]
                                               + [-1] * seq.num_outputs_in_flight for seq, j in rows], self.vocab_size),
                presence_penalties=self._tensor(step.values("presence_penalty"), torch.float32),
                frequency_penalties=self._tensor(step.values("frequency_penalty"), torch.float32),
                repetition_penalties=self._tensor(step.values("repetition_penalty"), torch.float32))
        processors = [(p, state) for p in self.logits_processors if (state := p.prepare(rows)) is not None]
        return SamplingMetadata(
            temperatures=column("temperature", torch.float32), top_ks=column("top_k", torch.int64),
            top_ps=column("top_p", torch.float32), min_ps=column("min_p", torch.float32),
            generators=[seq.generator for seq, _ in rows],
            penalties=penalties,
            min_tokens_mask=None if step.column("min_tokens") is None else self.min_tokens_mask(rows),
            logits_processors=processors,
        )

    def min_tokens_mask(self, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, token ids) the sampler rules out: EOS and the stop tokens, for a request that has fewer than
        min_tokens output tokens before this one (vLLM's MinTokensLogitsProcessor)."""
        masked, token_ids = [], []
        for row, (seq, j) in enumerate(rows):
            p = seq.sampling_params
            if seq.num_completion_tokens + j + seq.num_outputs_in_flight < p.min_tokens:
                stop_ids = p.stop_token_ids + ([] if p.ignore_eos else self.eos_token_ids)
                masked += [row] * len(stop_ids)
                token_ids += stop_ids
        return (self._tensor(masked, torch.int64), self._tensor(token_ids, torch.int64)) if masked else None

    def prompt_logprobs_rows(self, out: SchedulerOutput) -> tuple[list[int], list[tuple[Sequence, int]]]:
        """For requests with prompt_logprobs: the batch rows whose logits score a prompt token (the row of
        position p scores token p + 1), and where each result goes: (sequence, p + 1)."""
        rows, places, offset = [], [], 0
        for seq, start, num_tokens in zip(out.seqs, out.num_computed_tokens, out.num_scheduled_tokens):
            if seq.prompt_logprobs is not None:
                end = min(start + num_tokens, seq.num_prompt_tokens - 1)
                rows += range(offset, offset + end - start)
                places += [(seq, p + 1) for p in range(start, end)]
            offset += num_tokens
        return rows, places

    def _tensor(self, data: list | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return to_device(data, dtype, self.device)

    def _padded(self, rows: list[list[int]], pad: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Rows of unequal length as one tensor, padded with `pad` (numpy fills rows far faster than
        torch.tensor converts a list of lists)."""
        table = np.full((len(rows), max(map(len, rows))), pad, dtype=np.int64)
        for i, row in enumerate(rows):
            table[i, : len(row)] = row
        return self._tensor(table, dtype)
