"""Verification on rank 0 (docs/speculative.md): a step with drafts computes the logits of each request's 1 + k
positions; the sampler processes every row with the request's options, and the rejection sampler, not a draw,
picks what to emit. A request without drafts in the same step is a verification of k = 0: a plain draw."""
import torch

from nanoserve.engine.model_runner import ModelRunner
from nanoserve.spec_decode.rejection_sampler import RejectionSampler

rejection_sampler = RejectionSampler()


def verify(runner: ModelRunner, logits: torch.Tensor, inputs) -> torch.Tensor:
    """The sample seam (ModelRunner.sample; inputs: the step's ModelInput). Returns the token each sampling row
    emits, PLACEHOLDER_TOKEN_ID past a request's emitted run: 1 + k entries for a request with k drafts, one
    for any other row, in row order (Scheduler.postprocess reads them so). A step without drafts is a plain draw."""
    if not inputs.spec_decode_tokens:
        return runner.draw(logits, inputs)
    num_rows, first_rows, drafts, row = len(inputs.sample_seq_ids), [], [], 0
    while row < num_rows:  # a request's 1 + k rows are consecutive
        first_rows.append(row)
        drafts.append(inputs.spec_decode_tokens.get(inputs.sample_seq_ids[row], []))
        row += 1 + len(drafts[-1])
    newest = inputs.input_ids[inputs.logits_rows[:num_rows]] if inputs.sampling.penalties else None
    greedy, probs = runner.sampler.process(logits[:num_rows], inputs.sampling, newest)
    temperatures = inputs.sampling.temperatures
    output = rejection_sampler(drafts, greedy, probs, None if temperatures is None else temperatures[first_rows] == 0,
                               [inputs.sampling.generators[r] for r in first_rows])
    ks = torch.tensor([len(d) for d in drafts], device=output.device)
    return output[torch.arange(output.shape[1], device=output.device) <= ks[:, None]]
