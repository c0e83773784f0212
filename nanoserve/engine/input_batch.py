"""A step's plan (SchedulerOutput) -> the tensors the model and the sampler take (ModelInput), built
on the host with plain loops over the batch's tokens, as nano-vllm's prepare_prefill/prepare_decode
do. Where host time matters (CUDA, async scheduling) the persistent input batch
(persistent_batch.py, a subclass) builds the same host arrays from rows kept between steps.
tests/test_input_batch.py needs no model."""
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from nanoserve.config import Config
from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.engine.sequence import Sequence
from nanoserve.layers.attention import AttentionMetadata
from nanoserve.layers.sampling_metadata import LogitsProcessor, PenaltyMetadata, SamplingMetadata

# The sampling parameters a row may set, each with its "unused" value: a column no row uses is None.
PARAMS = {"temperature": 0.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0, "presence_penalty": 0.0,
          "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0}
PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
# A sampling row: (seq, j), seq's next token after its first j lookahead tokens (a verification has
# 1 + k rows).
SamplingRow = tuple[Sequence, int]


@dataclass
class StepArrays:
    """One step's batch on the host, in the plan's order (lists here, numpy arrays from the
    persistent batch)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)  # each token's cache slot
    block_tables: list[list[int]] = field(default_factory=list)
    q_lens: list[int] = field(default_factory=list)  # the tokens each sequence computes
    context_lens: list[int] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)  # the row each sampling row samples from
    # per name of PARAMS, a value per sampling row (None: read them here)
    params: dict[str, list] | None = None
    # a chapter's, for ModelInput.extras (placeholders)
    extras: dict[str, object] = field(default_factory=dict)


@dataclass
class ModelInput:
    """One step's batch as tensors. Rows of logits_rows: first one per sequence that samples (a
    request's n > 1 forks repeat its row), in `sample_seq_ids` order; then those features add (the
    extra_logits_rows seam)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # the rows of the flat batch whose logits are computed
    sampling: SamplingMetadata  # for the first len(sample_seq_ids) rows of logits
    sample_seq_ids: list[int]  # who samples, row by row (the next step finds its placeholders here)
    spec_decode_tokens: dict[int, list[int]]  # seq_id -> lookahead tokens: its 1 + k rows verified
    # A feature's state: for its logits rows (extra_logits_rows); async scheduling's placeholders
    # (persistent_batch.py).
    extras: dict[str, object] = field(default_factory=dict)


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
    # The seams (engine/seams.py).
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    extra_logits_rows: dict[str, Callable] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: Config, **seams) -> "InputBuilder":
        return cls(config.block_size, config.hf_config.vocab_size, config.eos_token_ids,
                   torch.device(config.device), **seams)

    def prepare_inputs(self, out: SchedulerOutput) -> ModelInput | None:
        """The tokens each sequence computes this step as one batch, with their cache slots, and the
        rows whose logits are needed: the last one of each sequence that samples."""
        if not out.rows:  # everyone was preempted this step
            return None
        step = self.flatten(out)
        meta = self.attention_metadata(step.block_tables, step.slot_mapping, step.q_lens,
                                       step.context_lens)
        # Who samples: a row per sequence whose step reaches its end, 1 + k with k lookahead tokens,
        # one per fork.
        rows = [(s, j) for row in out.rows if row.do_sample and not row.seq.raw_logits
                for s, j in [(row.seq, j) for j in range(len(row.seq.spec_token_ids) + 1)]
                + [(f, 0) for f in row.forks]]
        # the seam: the prompt logprobs', the beams' rows
        for name, extra_rows in self.extra_logits_rows.items():
            more, step.extras[name] = extra_rows(out, rows, len(step.logits_rows))
            step.logits_rows += more
        return ModelInput(input_ids=self._tensor(step.input_ids, torch.int64),
                          positions=self._tensor(step.positions, torch.int64),
                          meta=meta, logits_rows=self._tensor(step.logits_rows, torch.int64),
                          sampling=self.prepare_sampling(rows, step.params),
                          sample_seq_ids=[seq.seq_id for seq, _ in rows],
                          spec_decode_tokens={seq.seq_id: list(seq.spec_token_ids)
                                              for seq, j in rows if j == 0 and seq.spec_token_ids},
                          extras=step.extras)

    def flatten(self, out: SchedulerOutput) -> StepArrays:
        """The step's host arrays: each scheduled token's id, position and cache slot, sequence by
        sequence."""
        step, bs = StepArrays(), self.block_size
        for row in out.rows:
            seq, start, end = row.seq, row.start, row.start + row.num_tokens
            # (Lookahead tokens follow the newest, speculative decoding; slices, not copies of whole
            # sequences.)
            step.input_ids += (seq.token_ids[start:] + seq.spec_token_ids)[: row.num_tokens]
            step.positions += range(start, end)
            step.slot_mapping += [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]
            step.block_tables.append(seq.block_table)
            step.q_lens.append(row.num_tokens)
            step.context_lens.append(end)
            if row.do_sample and not seq.raw_logits:  # the newest token's row, each lookahead's
                newest = len(step.input_ids) - 1 - len(seq.spec_token_ids)
                step.logits_rows += [newest + j for j in range(len(seq.spec_token_ids) + 1)]
                step.logits_rows += [newest] * len(row.forks)  # one per fork
        return step

    def attention_metadata(self, block_tables: np.ndarray | list[list[int]],
                           slot_mapping: np.ndarray | list[int], q_lens: np.ndarray | list[int],
                           context_lens: np.ndarray | list[int]) -> AttentionMetadata:
        """Where a batch's new tokens go in the paged cache, and what each sequence attends to."""
        q_lens, context_lens = np.asarray(q_lens), np.asarray(context_lens)
        tables = (self._tensor(block_tables, torch.int32) if isinstance(block_tables, np.ndarray)
                  else self._padded(block_tables, -1, torch.int32))
        return AttentionMetadata(
            slot_mapping=self._tensor(slot_mapping, torch.int64), block_tables=tables,
            context_lens=self._tensor(context_lens, torch.int32),
            cu_seqlens_q=self._tensor(np.append(0, np.cumsum(q_lens)), torch.int32),
            cu_seqlens_k=self._tensor(np.append(0, np.cumsum(context_lens)), torch.int32),
            max_seqlen_q=int(q_lens.max()), max_seqlen_k=int(context_lens.max()))

    def prepare_sampling(self, rows: list[SamplingRow],
                         params: dict[str, list] | None = None) -> SamplingMetadata:
        """The sampler's inputs, an option no row uses None. Row (seq, j) counts seq's first j
        lookahead tokens as output already (penalties, min_tokens)."""
        # read row by row only what some row sets: most steps share one SamplingParams
        if params is None:
            distinct = {id(seq.sampling_params): seq.sampling_params for seq, _ in rows}.values()
            used = {name for name, unused in PARAMS.items()
                    if any(getattr(p, name) != unused for p in distinct)}
            params = {name: [getattr(seq.sampling_params, name) for seq, _ in rows] if name in used
                      else [unused] * len(rows) for name, unused in PARAMS.items()}
        else:  # the persistent batch's columns
            used = {name for name, unused in PARAMS.items()
                    if (np.asarray(params[name]) != unused).any()}

        def column(name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
            return self._tensor(params[name], dtype) if name in used else None

        top_ks = column("top_k", torch.int64)  # -1: all (masked to the vocabulary's size below)
        penalties = None
        if used.intersection(PENALTIES):
            prompts = [seq.prompt_token_ids for seq, _ in rows]
            outputs = [seq.completion_token_ids + seq.spec_token_ids[:j]
                       + [-1] * seq.num_outputs_in_flight for seq, j in rows]
            penalties = PenaltyMetadata(
                prompt_token_ids=self._padded(prompts, self.vocab_size),
                output_token_ids=self._padded(outputs, self.vocab_size),
                presence_penalties=self._tensor(params["presence_penalty"], torch.float32),
                frequency_penalties=self._tensor(params["frequency_penalty"], torch.float32),
                repetition_penalties=self._tensor(params["repetition_penalty"], torch.float32))
        processors = [(p, state) for p in self.logits_processors
                      if (state := p.prepare(rows)) is not None]
        return SamplingMetadata(
            temperatures=column("temperature"), top_ps=column("top_p"), min_ps=column("min_p"),
            top_ks=None if top_ks is None else top_ks.masked_fill(top_ks == -1, self.vocab_size),
            generators=[seq.generator for seq, _ in rows], penalties=penalties,
            min_tokens_mask=self.min_tokens_mask(rows) if "min_tokens" in used else None,
            logits_processors=processors)

    def min_tokens_mask(self, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, token ids) the sampler rules out: EOS and the stop tokens, for a request that has
        fewer than min_tokens output tokens before this one (vLLM's MinTokensLogitsProcessor)."""
        masked, token_ids = [], []
        for row, (seq, j) in enumerate(rows):
            p = seq.sampling_params
            if seq.num_completion_tokens + j + seq.num_outputs_in_flight < p.min_tokens:
                stop_ids = p.stop_token_ids + ([] if p.ignore_eos else self.eos_token_ids)
                masked += [row] * len(stop_ids)
                token_ids += stop_ids
        return ((self._tensor(masked, torch.int64), self._tensor(token_ids, torch.int64))
                if masked else None)

    def _tensor(self, data: list | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return to_device(data, dtype, self.device)

    def _padded(self, rows: list[list[int]], pad: int,
                dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Rows of unequal length as one tensor, padded with `pad` (numpy: far faster than
        torch.tensor)."""
        table = np.full((len(rows), max(map(len, rows))), pad, dtype=np.int64)
        for i, row in enumerate(rows):
            table[i, : len(row)] = row
        return self._tensor(table, dtype)
