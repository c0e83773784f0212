import torch
from torch import nn


class Sampler(nn.Module):
    """Turns each row of logits into one token: penalties first, then greedy where temperature is 0, else
    temperature, min_p, top-k, top-p and a draw (vLLM's order). Each is one tensor op over the whole batch."""

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor | None, top_ks: torch.Tensor | None,
                top_ps: torch.Tensor | None, generators: list[torch.Generator | None],
                min_ps: torch.Tensor | None = None, penalties: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """None for an option: no row uses it (temperatures None: every row is greedy). The engine knows that
        on the host, so the sampler never waits for the GPU to find it out, and a GPU step runs ahead."""
        logits = logits.float()
        if penalties is not None:
            logits = apply_penalties(logits, **penalties)
        greedy = logits.argmax(dim=-1)
        if temperatures is None:
            return greedy
        logits = logits / temperatures.clamp(min=1e-5).unsqueeze(1)
        if min_ps is not None:
            probs = logits.softmax(dim=-1)
            logits = logits.masked_fill(probs < min_ps[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
        if top_ks is not None or top_ps is not None:
            logits = self._apply_top_k_top_p(logits, top_ks, top_ps)
        probs = torch.softmax(logits, dim=-1)
        # Gumbel-max trick: argmax(p / Exp(1) noise) is a sample from p, with no sync for multinomial.
        noise = torch.empty_like(probs).exponential_()
        for i, generator in enumerate(generators):
            if generator is not None:  # a seeded request draws its own reproducible noise
                noise[i] = torch.empty(probs.shape[1]).exponential_(generator=generator).to(probs.device)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(temperatures == 0, greedy, sampled)

    @staticmethod
    def _apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None
                           ) -> torch.Tensor:
        """Mask (to -inf) every token outside the row's top_k, then outside its top_p nucleus."""
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(logits.shape[1], device=logits.device)
        drop = rank[None, :] >= (top_ks[:, None] if top_ks is not None else logits.shape[1])
        if top_ps is not None:
            probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            # Drop a token when the more likely ones before it already reach top_p (the first always stays).
            drop = drop | ((probs.cumsum(dim=-1) - probs) >= top_ps[:, None])  # (drop may be one row so far)
        return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def apply_penalties(logits: torch.Tensor, prompt_token_ids: torch.Tensor, output_token_ids: torch.Tensor,
                    presence_penalties: torch.Tensor, frequency_penalties: torch.Tensor,
                    repetition_penalties: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties. repetition (as transformers'): every token of the prompt or the output gets its logit
    divided by the penalty if positive, multiplied if negative. frequency: minus penalty x times generated;
    presence: minus penalty once if generated. The id rows are padded with vocab_size: a column dropped after."""
    num_seqs, vocab_size = logits.shape
    output_counts = torch.zeros(num_seqs, vocab_size + 1, device=logits.device).scatter_add_(
        1, output_token_ids, torch.ones(output_token_ids.shape, device=logits.device))[:, :vocab_size]
    in_prompt = torch.zeros(num_seqs, vocab_size + 1, dtype=torch.bool, device=logits.device).scatter_(
        1, prompt_token_ids, True)[:, :vocab_size]
    penalty = torch.where(in_prompt | (output_counts > 0), repetition_penalties[:, None], 1.0)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    return logits - frequency_penalties[:, None] * output_counts - presence_penalties[:, None] * (output_counts > 0)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> tuple[torch.Tensor, ...]:
    """Of the raw model distribution (before penalties and temperature: vLLM's default): each row's logprob of
    its token and that token's rank (1 = most likely), and the row's num_logprobs most likely tokens."""
    logprobs = logits.float().log_softmax(dim=-1)
    token_logprobs = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    return token_logprobs.squeeze(1), ranks, top_ids, top_logprobs
