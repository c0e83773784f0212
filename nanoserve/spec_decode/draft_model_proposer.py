"""The draft model proposer (speculative_config method "draft_model", docs/speculative.md): a
smaller model with the target's tokenizer guesses each request's next k tokens, one cheap decode
step at a time.

Its layers are more layers of the target's KV cache (ModelRunner allocates them together), so its KV
lives in the same blocks under the same block tables: preemption, swapping, copy-on-write and the
prefix cache move it with the target's and need no books of their own. That holds because the draft
computes its KV for exactly the positions and tokens the target does in every step: every block that
holds verified target KV holds the draft's too, and a rollback of num_computed_tokens rolls both
back.

A step with draft_model, after the scheduler reserved 1 + k slots for each speculating request:
  forward 0:   every scheduled sequence's tokens but the drafts (prompt chunks, newest tokens);
               a speculating request's last row gives draft 1
  forward j:   draft j of each request with k >= j, at the position after the one before; gives
  draft j + 1
               (the last draft goes in too: if all are accepted, its KV must be there)
then the target verifies the newest token and the k drafts in one forward, as with n-gram drafts.
The drafts are the draft's greedy tokens: a one-hot draft distribution, so rejection sampling keeps
the target's exactly.

The proposer lives on rank 0, with the scheduler, but each draft forward runs on every rank
(`run_draft`, from Executor.launch): with tensor parallelism each rank holds its share of the
draft's layers, as of the target's.
"""
from collections.abc import Callable

import torch

from nanoserve.engine.model_runner import InputBuilder, ModelInput, to_device
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.engine.sequence import Sequence
from nanoserve.layers.attention import AttentionMetadata
from nanoserve.utils.math import token_slots

# (sequence, first position, the tokens computed from there)
Chunk = tuple[Sequence, int, list[int]]
# (input_ids, positions, attention metadata, rows) -> the draft model's logits of those rows, on
# rank 0
RunDraft = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]


class DraftModelProposer:
    def __init__(self, input_builder: InputBuilder):
        self.input_builder = input_builder

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput, inputs: ModelInput | None,
                run_draft: RunDraft) -> ModelInput | None:
        """Run the draft over a scheduled step (after its block copies): fill in the drafts of the
        sequences that verify some (their spec_token_ids and the plan's
        scheduled_spec_decode_tokens), and return the step's inputs rebuilt with them (as they were
        when nobody speculates). run_draft: the draft's forward on every rank (Executor.launch)."""
        if inputs is None:
            return None
        chunks, speculating = [], []  # speculating: (seq, position of its newest token, k)
        for row in out.rows:
            seq, start, k = row.seq, row.start, len(row.seq.spec_token_ids)
            chunks.append((seq, start, seq.token_ids[start : start + row.num_tokens - k]))
            if k:
                speculating.append((seq, start + row.num_tokens - k - 1, k))
        drafts = self.forward(run_draft, chunks, [bool(seq.spec_token_ids) for seq in out.seqs])
        for j in range(1, max((k for _, _, k in speculating), default=0) + 1):
            # drafts[i]: draft j of speculating[i]
            speculating = [s for s in speculating if s[2] >= j]
            for (seq, _, _), token_id in zip(speculating, drafts, strict=True):
                seq.spec_token_ids[j - 1] = token_id
            chunks = [(seq, newest + j, [seq.spec_token_ids[j - 1]])
                      for seq, newest, _ in speculating]
            drafts = self.forward(run_draft, chunks, [k > j for _, _, k in speculating])
        if not out.scheduled_spec_decode_tokens:
            return inputs
        for seq in out.seqs:
            if seq.spec_token_ids:
                out.scheduled_spec_decode_tokens[seq.seq_id] = list(seq.spec_token_ids)
        return self.input_builder.prepare_inputs(out)

    def forward(self, run_draft: RunDraft, chunks: list[Chunk], sample: list[bool]) -> list[int]:
        """One forward of the draft over the chunks (writing their KV); the greedy next token after
        each chunk whose `sample` is True."""
        input_ids, positions, slot_mapping, rows = [], [], [], []
        for (seq, start, token_ids), wanted in zip(chunks, sample):
            input_ids += token_ids
            positions += range(start, start + len(token_ids))
            slot_mapping += token_slots(seq.block_table, start, start + len(token_ids),
                                        self.input_builder.block_size)
            if wanted:
                rows.append(len(input_ids) - 1)
        meta = self.input_builder.attention_metadata([seq.block_table for seq, _, _ in chunks],
                                                     slot_mapping, [len(t) for _, _, t in chunks],
                                                     [s + len(t) for _, s, t in chunks])
        input_ids, positions, rows = (to_device(x, torch.int64, self.input_builder.device)
                                      for x in (input_ids, positions, rows))
        return run_draft(input_ids, positions, meta, rows).argmax(dim=-1).tolist()
