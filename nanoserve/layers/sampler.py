"""Which token comes next, from a row of logits to a token id, in vLLM's order: tokens ruled out,
penalties, then greedy where temperature is 0, else temperature, min_p, top-k, top-p and a draw,
each one tensor op over the batch. The engine builds the SamplingMetadata
(layers/sampling_metadata.py) on the host (engine/model_runner.py); its logits processors join
`rule_out` (a grammar's mask). (Speculative decoding's verification takes the place of `draw`:
SpecDecodeModelRunner.sample.)"""
import torch
from torch import nn

from nanoserve.layers.sampling_metadata import PenaltyMetadata, SamplingMetadata


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, sampling: SamplingMetadata,
                newest_token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """A token id per row. newest_token_ids: each row's last input token, the newest output
        token when the row decodes (the penalties count it; with async scheduling the plan could
        not)."""
        greedy, probs = self.process(logits, sampling, newest_token_ids)
        return greedy if probs is None else torch.where(sampling.temperatures == 0, greedy,
                                                        draw(probs, sampling.generators))

    def process(self, logits: torch.Tensor, sampling: SamplingMetadata,
                newest_token_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's greedy token and the distribution a draw is made from (None: all greedy)."""
        logits = rule_out(logits.float(), sampling)
        if sampling.penalties is not None:
            logits = apply_penalties(logits, sampling.penalties, newest_token_ids)
        greedy = logits.argmax(dim=-1)
        if sampling.temperatures is None:
            return greedy, None
        logits = logits / sampling.temperatures.clamp(min=1e-5).unsqueeze(1)
        if sampling.min_ps is not None:
            probs = logits.softmax(dim=-1)
            too_unlikely = probs < sampling.min_ps[:, None] * probs.amax(dim=-1, keepdim=True)
            logits = logits.masked_fill(too_unlikely, float("-inf"))
        if sampling.top_ks is not None or sampling.top_ps is not None:
            logits = apply_top_k_top_p(logits, sampling.top_ks, sampling.top_ps)
        return greedy, torch.softmax(logits, dim=-1)


def rule_out(logits: torch.Tensor, sampling: SamplingMetadata) -> torch.Tensor:
    """Set to -inf the tokens a row may not sample: those the logits processors rule out (a
    grammar's), and EOS and the stop tokens before min_tokens (vLLM's MinTokensLogitsProcessor)."""
    for processor, state in sampling.logits_processors:
        logits = processor.apply(logits, state)
    mask = sampling.min_tokens_mask
    return logits if mask is None else logits.index_put(mask, logits.new_tensor(float("-inf")))


def apply_penalties(logits: torch.Tensor, p: PenaltyMetadata,
                    newest_token_ids: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties. repetition (as transformers'): every token of the prompt or the output gets
    its logit divided by the penalty if positive, multiplied if negative. frequency: minus penalty x
    times generated; presence: minus penalty once if generated. The id rows are padded with
    vocab_size: a column dropped after."""
    num_seqs, vocab_size = logits.shape
    output_token_ids = torch.where(p.output_token_ids == -1, newest_token_ids[:, None],
                                   p.output_token_ids)
    device = logits.device
    output_counts = torch.zeros(num_seqs, vocab_size + 1, device=device).scatter_add_(
        1, output_token_ids, torch.ones(output_token_ids.shape, device=device))[:, :vocab_size]
    in_prompt = torch.zeros(num_seqs, vocab_size + 1, dtype=torch.bool, device=device).scatter_(
        1, p.prompt_token_ids, True)[:, :vocab_size]
    penalty = torch.where(in_prompt | (output_counts > 0), p.repetition_penalties[:, None], 1.0)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    return (logits - p.frequency_penalties[:, None] * output_counts
            - p.presence_penalties[:, None] * (output_counts > 0))


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None
                      ) -> torch.Tensor:
    """Mask (to -inf) every token outside the row's top_k, then outside its top_p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device)
    drop = rank[None, :] >= (top_ks[:, None] if top_ks is not None else logits.shape[1])
    if top_ps is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Drop a token when the more likely ones before it already reach top_p (the first always
        # stays). (drop may be one row so far)
        drop = drop | ((probs.cumsum(dim=-1) - probs) >= top_ps[:, None])
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One sample per row. Speculative decoding verifies its draft tokens against probs instead
    (spec_decode/verify.py: accept each with min(1, p / q), else draw from the residual)."""
    # Gumbel-max trick: argmax(p / Exp(1) noise) is a sample from p, with no sync for multinomial.
    noise = torch.empty_like(probs).exponential_()
    vocab_size = probs.shape[1]
    for i, generator in enumerate(generators):
        if generator is not None:  # a seeded request draws its own reproducible noise
            noise[i] = torch.empty(vocab_size).exponential_(generator=generator).to(probs.device)
    return (probs / noise).argmax(dim=-1)

