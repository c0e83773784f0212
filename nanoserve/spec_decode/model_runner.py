"""Speculative decoding's model runner and executor (docs/speculative.md): the core's, with the
draft model loaded beside the target and the drafts verified instead of a draw.

Verification on rank 0: a step with drafts computes the logits of each request's 1 + k positions;
the sampler processes every row with the request's options, and the rejection sampler, not a draw,
picks what to emit. A request without drafts in the same step is a verification of k = 0: a plain
draw.
"""
from dataclasses import dataclass, field

import torch
from torch import nn

from nanoserve.engine.model_runner import Executor, InputBuilder, ModelInput, ModelRunner
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.layers.attention import AttentionMetadata
from nanoserve.models import load_model
from nanoserve.spec_decode.draft_model_proposer import DraftModelProposer
from nanoserve.spec_decode.rejection_sampler import RejectionSampler


@dataclass
class SpecDecodeModelInput(ModelInput):
    """The batch, with the drafts each sequence verifies: seq_id -> its lookahead tokens (its 1 + k
    sampling rows are verified together)."""

    spec_decode_tokens: dict[int, list[int]] = field(default_factory=dict)


class SpecDecodeInputBuilder(InputBuilder):
    input_class = SpecDecodeModelInput

    def prepare_inputs(self, out: SchedulerOutput) -> SpecDecodeModelInput | None:
        inputs = super().prepare_inputs(out)
        if inputs is not None:
            inputs.spec_decode_tokens = {row.seq.seq_id: list(row.seq.spec_token_ids)
                                         for row in out.rows
                                         if out.draws(row) and row.seq.spec_token_ids}
        return inputs


class SpecDecodeModelRunner(ModelRunner):
    """The ModelRunner that verifies drafts, and with method "draft_model" holds the draft model (on
    every rank, split as the target is); the core's own without a speculative_config."""

    rejection_sampler = RejectionSampler()

    def load_models(self, model_class: type | None) -> list[nn.Module]:
        """The target, then the draft model: its layers are more layers of the same KV cache, so its
        KV shares the target's blocks and block tables (draft_model_proposer.py)."""
        models, config = super().load_models(model_class), self.config
        self.draft_model = None if config.draft_hf_config is None else load_model(
            config.draft_hf_config, config.speculative_config.model, config.torch_dtype,
            self.device)
        return models if self.draft_model is None else [*models, self.draft_model]

    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  logits_rows: torch.Tensor, draft: bool = False) -> torch.Tensor | None:
        """draft=True: the draft model's logits of those rows (eager: no CUDA graph)."""
        if not draft:
            return super().run_model(input_ids, positions, meta, logits_rows)
        hidden = self.draft_model(input_ids, positions, meta)
        return self.draft_model.compute_logits(hidden, logits_rows)

    def sample(self, logits: torch.Tensor, inputs: SpecDecodeModelInput) -> torch.Tensor:
        """The token each sampling row emits, PLACEHOLDER_TOKEN_ID past a request's emitted run:
        1 + k entries for a request with k drafts, one for any other row, in row order
        (SpecDecodeScheduler.accept_tokens reads them so). A step without drafts is a plain draw."""
        if not inputs.spec_decode_tokens:
            return super().sample(logits, inputs)
        num_rows, first_rows, drafts, row = len(inputs.sample_seq_ids), [], [], 0
        while row < num_rows:  # a request's 1 + k rows are consecutive
            first_rows.append(row)
            drafts.append(inputs.spec_decode_tokens.get(inputs.sample_seq_ids[row], []))
            row += 1 + len(drafts[-1])
        sampling = inputs.sampling
        newest = inputs.input_ids[inputs.logits_rows[:num_rows]] if sampling.penalties else None
        greedy, probs = self.sampler.process(logits[:num_rows], sampling, newest)
        temperatures = sampling.temperatures
        is_greedy = None if temperatures is None else temperatures[first_rows] == 0
        output = self.rejection_sampler(drafts, greedy, probs, is_greedy,
                                        [sampling.generators[r] for r in first_rows])
        ks = torch.tensor([len(d) for d in drafts], device=output.device)
        return output[torch.arange(output.shape[1], device=output.device) <= ks[:, None]]


class SpecDecodeExecutor(Executor):
    """The Executor that, with a draft model, runs it over the step once the step's KV is in place
    (after its block copies) and before the target's forward: it fills the lookahead slots."""

    # The draft pass (None: no draft model), with the engine's InputBuilder (SpecDecodeEngineCore).
    proposer: DraftModelProposer | None = None

    def forward(self, out: SchedulerOutput,
                inputs: ModelInput | None) -> tuple[ModelInput | None, torch.Tensor | None]:
        if self.proposer is not None:
            inputs = self.proposer.propose(out, inputs, self.run_draft)
        return super().forward(out, inputs)

    def run_draft(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  rows: torch.Tensor) -> torch.Tensor:
        """One forward of the draft model on every rank; its logits of those rows, on rank 0."""
        return self.call("run_model", input_ids, positions, meta, rows, True)
