"""vLLM V1's persistent input batch (InputBatch): every scheduled sequence keeps a row of
preallocated arrays, its token ids, block table and sampling parameters, from step to step. A step
writes only what changed since (the tokens sampled, the blocks added) and gathers its flat inputs
from the rows with a few numpy operations, where the core's InputBuilder.flatten loops in Python
over every token of the batch (benchmarks/input_batch_host.py). A performance chapter: InputBatch is
the core's InputBuilder with its own `flatten`; nanoserve/chapters.py builds it on CUDA and always
with async scheduling, whose placeholders it writes (BatchModelInput.placeholders).

A sequence's token ids only grow while it is scheduled (a stop string cuts them as it finishes); its
block table is rewritten when it may have changed otherwise: a new list (preemption, swapping, a
fork, rejected drafts), a shorter one, or a step with copy-on-write copies (the last block replaced
in place).
"""
from dataclasses import dataclass, field

import numpy as np

from nanoserve.config import Config
from nanoserve.engine.model_runner import PARAMS, InputBuilder, ModelInput, StepArrays
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.engine.sequence import Sequence


def grown(array: np.ndarray, rows: int, cols: int, fill) -> np.ndarray:
    """array, or a copy enlarged to hold [rows, cols] (an axis that grows at least doubles); new
    cells: fill."""
    shape = tuple(have if need <= have else max(need, 2 * have)
                  for have, need in zip(array.shape, (rows, cols)))
    if shape == array.shape:
        return array
    new = np.full(shape, fill, array.dtype)
    new[: array.shape[0], : array.shape[1]] = array
    return new


@dataclass
class BatchModelInput(ModelInput):
    """The batch, with the placeholders of async scheduling: (flat batch row, the sequence whose
    token the previous step is sampling), filled in on the device before the forward."""

    placeholders: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class InputBatch(InputBuilder):
    """The InputBuilder that keeps the rows of the sequences the last steps scheduled; a row is
    reused once its sequence is gone. On CPU without async scheduling (persistent False) it is the
    core's InputBuilder."""

    persistent: bool = True

    input_class = BatchModelInput

    @classmethod
    def from_config(cls, config: Config) -> "InputBatch":
        builder = super().from_config(config)
        # Where host time matters (CUDA), and for async scheduling, whose placeholders its rows
        # hold.
        builder.persistent = (config.device.startswith("cuda")
                              or config.scheduler_config.async_scheduling)
        return builder

    def __post_init__(self) -> None:
        self.placeholders: list[tuple[int, int]] = []  # the step being flattened's
        self.row_of: dict[Sequence, int] = {}
        # the sequences of the step being flattened keep their rows
        self.step_seqs: list[Sequence] = []
        # how many of its token ids each row holds (token_ids only grow)
        self.num_tokens: list[int] = []
        self.block_lists: list[list[int]] = []  # the block_table list each row was copied from...
        self.num_blocks: list[int] = []  # ...and how much of it
        self.token_ids = np.zeros((0, 0), np.int64)
        self.block_table = np.full((0, 0), -1, np.int32)
        # Sampling parameters, one column each (PARAMS): float64, so that "no row uses it" sees them
        # as given.
        self.params = np.zeros((0, len(PARAMS)), np.float64)
        self.free_rows: list[int] = []

    def prepare_inputs(self, out: SchedulerOutput) -> BatchModelInput | None:
        self.placeholders = []
        inputs = super().prepare_inputs(out)  # (flatten finds the placeholders)
        if inputs is not None:
            inputs.placeholders = self.placeholders
        return inputs

    def flatten(self, out: SchedulerOutput) -> StepArrays:
        """Bring the rows of out's sequences up to date, then gather the step's inputs from them
        (what the core's InputBuilder.flatten builds with its loops)."""
        if not self.persistent:
            return super().flatten(out)
        self.step_seqs = seqs = out.seqs
        rewrite_blocks = bool(out.blocks_to_copy)  # copy-on-write replaced a last block in place
        rows = np.array([self._sync(seq, rewrite_blocks) for seq in seqs], np.int64)
        n, bs = len(rows), self.block_size
        q_lens = np.array([row.num_tokens for row in out.rows], np.int64)
        starts = np.array([row.start for row in out.rows], np.int64)
        cu_q = np.cumsum(q_lens) - q_lens  # where each sequence's tokens start in the flat batch
        owner = np.repeat(np.arange(n), q_lens)  # the sequence of each token of the flat batch
        positions = np.arange(len(owner)) - cu_q[owner] + starts[owner]
        token_rows = rows[owner]
        input_ids = self.token_ids[token_rows, positions]
        num_drafts = np.array([len(seq.spec_token_ids) for seq in seqs], np.int64)
        known = np.array(self.num_tokens)[rows] + num_drafts
        # async scheduling: filled in on the device
        placeholders = np.flatnonzero(positions >= known[owner])
        input_ids[placeholders] = 0
        self.placeholders = [(row, seqs[i].seq_id)
                             for row, i in zip(placeholders.tolist(), owner[placeholders].tolist())]
        blocks = self.block_table[token_rows, positions // bs].astype(np.int64)
        slot_mapping = blocks * bs + positions % bs
        # Sampling rows: a sequence's newest token, after its drafts' rows; n > 1: once more per
        # fork.
        drawn = np.array([out.draws(row) for row in out.rows])
        counts = drawn * (1 + num_drafts + np.array([len(row.forks) for row in out.rows]))
        sampler = np.repeat(np.arange(n), counts)
        j = np.arange(len(sampler)) - (np.cumsum(counts) - counts)[sampler]
        logits_rows = (cu_q + q_lens - 1 - num_drafts)[sampler] + np.minimum(j, num_drafts[sampler])
        params = self.params[rows[sampler]]
        return StepArrays(
            input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
            block_tables=self.block_table[rows, : np.array(self.num_blocks)[rows].max()],
            q_lens=q_lens, context_lens=starts + q_lens, logits_rows=logits_rows.tolist(),
            params={name: params[:, i] for i, name in enumerate(PARAMS)})

    def _sync(self, seq: Sequence, rewrite_blocks: bool) -> int:
        """seq's row, with the tokens and blocks seq gained since its last step written into it."""
        row = self.row_of.get(seq)
        if row is None:
            row = self._add(seq)
        tokens, done, drafts = seq.token_ids, self.num_tokens[row], seq.spec_token_ids
        end = len(tokens) + len(drafts)
        if end + seq.num_output_placeholders > self.token_ids.shape[1]:
            self.token_ids = grown(self.token_ids, 0, end + seq.num_output_placeholders, 0)
        if end == done + 1 and not drafts:
            # a decode's new token: a scalar write is far cheaper than a slice
            self.token_ids[row, done] = tokens[done]
            self.num_tokens[row] = end
        elif end > done:  # drafts sit after the tokens until the step that verifies them is done
            self.token_ids[row, done:end] = tokens[done:] + drafts
            self.num_tokens[row] = len(tokens)
        table = seq.block_table
        if (rewrite_blocks or table is not self.block_lists[row]
                or len(table) < self.num_blocks[row]):
            self.block_table[row] = -1
            self.block_lists[row], self.num_blocks[row] = table, 0
        if len(table) > self.num_blocks[row]:
            done = self.num_blocks[row]
            self.block_table = grown(self.block_table, 0, len(table), -1)
            self.block_table[row, done : len(table)] = table[done:]
            self.num_blocks[row] = len(table)
        return row

    def _add(self, seq: Sequence) -> int:
        """A row for seq: a free one, one whose sequence is not in this step, or a new one."""
        if not self.free_rows:
            scheduled = set(self.step_seqs)
            self.free_rows = [self.row_of.pop(s) for s in list(self.row_of) if s not in scheduled]
        if not self.free_rows:
            num_rows = len(self.num_tokens)
            # double (and one); pop() takes the lowest
            self.free_rows = list(range(2 * num_rows, num_rows - 1, -1))
            self.block_lists += [[]] * (num_rows + 1)
            self.num_tokens += [0] * (num_rows + 1)
            self.num_blocks += [0] * (num_rows + 1)
            self.token_ids = grown(self.token_ids, 2 * num_rows + 1, 0, 0)
            self.block_table = grown(self.block_table, 2 * num_rows + 1, 0, -1)
            self.params = grown(self.params, 2 * num_rows + 1, len(PARAMS), 0.0)
        row = self.free_rows.pop()
        self.row_of[seq] = row
        self.block_lists[row], self.num_tokens[row], self.num_blocks[row] = [], 0, 0
        self.block_table[row] = -1
        self.params[row] = [getattr(seq.sampling_params, name) for name in PARAMS]
        return row
