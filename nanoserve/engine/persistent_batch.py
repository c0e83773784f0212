"""vLLM V1's persistent input batch (InputBatch): every scheduled sequence keeps a row of preallocated arrays,
its token ids, block table and sampling parameters, from step to step. A step writes only what changed since
(the tokens sampled, the blocks added) and gathers its flat inputs from the rows with a few numpy operations,
where a fresh build loops in Python over every token and block of the batch (benchmarks/input_batch_host.py).

A sequence's token ids only grow while it is scheduled (a stop string cuts them as it finishes); its block table
is rewritten when it may have changed otherwise: a new list (preemption, swapping, a fork, rejected drafts), a
shorter one, or a step with copy-on-write copies (the last block replaced in place).
"""
from dataclasses import dataclass

import numpy as np

from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.engine.sequence import Sequence

# The sampling parameters kept per row, each with the value that means "unused" (top_k's is the vocabulary size).
PARAMS = {"temperature": 0.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0, "presence_penalty": 0.0,
          "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0}


@dataclass
class StepArrays:
    """One step's batch as host arrays, in the plan's order (InputBuilder turns them into a ModelInput)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray  # [num_seqs, most blocks of any]: padded with -1
    q_lens: np.ndarray  # the tokens each sequence computes
    context_lens: np.ndarray
    logits_rows: np.ndarray  # per sampling row: its newest token's row (drafts: each draft's; forks: repeated)
    raw_rows: np.ndarray  # the same for sequences whose request picks its own tokens (raw_logits): nothing drawn
    params: np.ndarray  # per sampling row, its sampling parameters (a column per key of PARAMS)
    used: np.ndarray  # per key of PARAMS: does any sampling row use it (a value other than "unused")
    placeholder_rows: list[int]  # rows whose token the step before is still sampling (async scheduling)...
    placeholder_seq_ids: list[int]  # ...for these sequences

    def values(self, name: str) -> np.ndarray:
        """A sampling parameter (a key of PARAMS), one value per sampling row."""
        return self.params[:, list(PARAMS).index(name)]

    def column(self, name: str) -> np.ndarray | None:
        """values(name), or None when no sampling row uses the parameter."""
        return self.values(name) if self.used[list(PARAMS).index(name)] else None


def grown(array: np.ndarray, rows: int, cols: int, fill) -> np.ndarray:
    """array, or a copy enlarged to hold [rows, cols] (an axis that grows at least doubles); new cells: fill."""
    shape = tuple(have if need <= have else max(need, 2 * have) for have, need in zip(array.shape, (rows, cols)))
    if shape == array.shape:
        return array
    new = np.full(shape, fill, array.dtype)
    new[: array.shape[0], : array.shape[1]] = array
    return new


class InputBatch:
    """The rows of the sequences the last steps scheduled; a row is reused once its sequence is gone."""

    def __init__(self, block_size: int, vocab_size: int):
        self.block_size, self.vocab_size = block_size, vocab_size
        self.row_of: dict[Sequence, int] = {}
        self.step_seqs: list[Sequence] = []  # the sequences of the step being flattened keep their rows
        self.num_tokens: list[int] = []  # how many of its token ids each row holds (token_ids only grow)
        self.block_lists: list[list[int]] = []  # the block_table list each row was copied from...
        self.num_blocks: list[int] = []  # ...and how much of it
        self.token_ids = np.zeros((0, 0), np.int64)
        self.block_table = np.full((0, 0), -1, np.int32)
        # Sampling parameters, one column each (PARAMS): float64, so that "no row uses it" sees them as given.
        self.params = np.zeros((0, len(PARAMS)), np.float64)
        self.unused = np.array([vocab_size if name == "top_k" else v for name, v in PARAMS.items()], np.float64)
        self.free_rows: list[int] = []

    def flatten(self, out: SchedulerOutput) -> StepArrays:
        """Bring the rows of out's sequences up to date, then gather the step's inputs from them."""
        self.step_seqs = out.seqs
        rewrite_blocks = bool(out.blocks_to_copy)  # copy-on-write replaced a last block in place
        rows = np.array([self._sync(seq, rewrite_blocks) for seq in out.seqs], np.int64)
        n, bs = len(rows), self.block_size
        q_lens = np.array(out.num_scheduled_tokens, np.int64)
        starts = np.array(out.num_computed_tokens, np.int64)
        cu_q = np.cumsum(q_lens) - q_lens  # where each sequence's tokens start in the flat batch
        owner = np.repeat(np.arange(n), q_lens)  # the sequence of each token of the flat batch
        positions = np.arange(len(owner)) - cu_q[owner] + starts[owner]
        token_rows = rows[owner]
        input_ids = self.token_ids[token_rows, positions]
        num_drafts = np.array([len(seq.spec_token_ids) for seq in out.seqs] if out.scheduled_spec_decode_tokens
                              else np.zeros(n), np.int64)
        known = np.array(self.num_tokens)[rows] + num_drafts
        placeholders = np.flatnonzero(positions >= known[owner])  # async scheduling: filled in on the device
        input_ids[placeholders] = 0
        slot_mapping = self.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        # Sampling rows: a sequence's newest token, after its drafts' rows; n > 1: once more per fork.
        counts = np.array(out.do_sample, np.int64) * (1 + num_drafts + np.array([len(f) for f in out.forks]))
        sampler = np.repeat(np.arange(n), counts)
        j = np.arange(len(sampler)) - (np.cumsum(counts) - counts)[sampler]
        logits_rows = (cu_q + q_lens - 1 - num_drafts)[sampler] + np.minimum(j, num_drafts[sampler])
        raw = np.array([seq.raw_logits for seq in out.seqs], bool)[sampler]
        context_lens, params = starts + q_lens, self.params[rows[sampler[~raw]]]
        return StepArrays(
            input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
            block_tables=self.block_table[rows, : np.array(self.num_blocks)[rows].max()], q_lens=q_lens,
            context_lens=context_lens,
            logits_rows=logits_rows[~raw], raw_rows=logits_rows[raw],
            params=params, used=(params != self.unused).any(axis=0),
            placeholder_rows=placeholders.tolist(),
            placeholder_seq_ids=[out.seqs[i].seq_id for i in owner[placeholders].tolist()])

    def _sync(self, seq: Sequence, rewrite_blocks: bool) -> int:
        """seq's row, with the tokens and blocks seq gained since its last step written into it."""
        row = self.row_of.get(seq)
        if row is None:
            row = self._add(seq)
        tokens, done, drafts = seq.token_ids, self.num_tokens[row], seq.spec_token_ids
        end = len(tokens) + len(drafts)
        if end + seq.num_output_placeholders > self.token_ids.shape[1]:
            self.token_ids = grown(self.token_ids, 0, end + seq.num_output_placeholders, 0)
        if end == done + 1 and not drafts:  # a decode's new token: a scalar write is far cheaper than a slice
            self.token_ids[row, done] = tokens[done]
            self.num_tokens[row] = end
        elif end > done:  # drafts sit after the tokens until the step that verifies them is done
            self.token_ids[row, done:end] = tokens[done:] + drafts
            self.num_tokens[row] = len(tokens)
        table = seq.block_table
        if rewrite_blocks or table is not self.block_lists[row] or len(table) < self.num_blocks[row]:
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
            self.free_rows = list(range(2 * num_rows, num_rows - 1, -1))  # double (and one); pop() takes the lowest
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
        p = seq.sampling_params
        self.params[row] = [getattr(p, name) for name in PARAMS]
        if p.top_k == -1:
            self.params[row, 1] = self.vocab_size
        return row
